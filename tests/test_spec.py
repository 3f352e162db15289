"""KVSpec helpers against direct formulas from the semantics."""


def test_first_visible_key_follows_the_masks():
    """Direct from the semantics: window keeps j > p - W, chunk keeps j // C == p // C."""
    import numpy as np

    from kvabi import KVSpec

    p = np.arange(0, 100)
    sw = KVSpec(kind="sliding_window", block_size=4, num_kv_heads=1, head_dim=8, window=7)
    ch = KVSpec(kind="chunked_local", block_size=4, num_kv_heads=1, head_dim=8, chunk=12)
    full = KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=8)
    for pi, lo_w, lo_c, lo_f in zip(p, sw.first_visible_key(p), ch.first_visible_key(p),
                                    full.first_visible_key(p)):
        assert lo_w == min(j for j in range(pi + 1) if j > pi - 7)
        assert lo_c == min(j for j in range(pi + 1) if j // 12 == pi // 12)
        assert lo_f == 0


def test_kvspec_integers_are_strict():
    """bools are not ints (True would silently be a block size of 1), floats neither."""
    import pytest

    from kvabi import KVABIError, KVSpec

    base = dict(kind="full", block_size=4, num_kv_heads=2, head_dim=8)
    for field, bad in (("block_size", True), ("num_kv_heads", True), ("head_dim", 8.0),
                       ("page_align", False), ("head_dim_v", True), ("block_size", 2**63)):
        with pytest.raises(KVABIError, match=f"^{field}"):
            KVSpec(**{**base, field: bad})
    with pytest.raises(KVABIError, match="^window"):
        KVSpec(**{**base, "kind": "sliding_window", "window": True})
    with pytest.raises(KVABIError, match="^chunk"):
        KVSpec(**{**base, "kind": "chunked_local", "chunk": 4.0})
    with pytest.raises(KVABIError, match="^kind"):
        KVSpec(**{**base, "kind": ["full"]})
    with pytest.raises(KVABIError, match="^dtype"):
        KVSpec(**base, dtype=["bfloat16"])
    with pytest.raises(KVABIError, match="^max_len"):
        KVSpec(**base).blocks_per_request(True)
    with pytest.raises(KVABIError, match="^max_query_len"):
        KVSpec(**{**base, "kind": "sliding_window", "window": 8}).blocks_per_request(64, "2")


def test_kvspec_takes_numpy_and_torch_integers_as_python_ints():
    """specs/security.md: numpy, torch and jax integers are integers; the spec keeps them
    as Python ints (equal and hashing as a spec built from plain ints)."""
    import numpy as np

    from kvabi import KVSpec

    plain = KVSpec(kind="sliding_window", block_size=4, num_kv_heads=2, head_dim=8, window=7)
    spec = KVSpec(kind="sliding_window", block_size=np.int64(4), num_kv_heads=np.int32(2),
                  head_dim=np.uint8(8), window=np.int16(7), page_align=np.int64(1))
    assert spec == plain and hash(spec) == hash(plain)
    assert all(type(getattr(spec, f)) is int
               for f in ("block_size", "num_kv_heads", "head_dim", "head_dim_v", "window",
                         "page_align"))
    try:
        import torch
    except ImportError:
        return
    assert KVSpec(kind="full", block_size=torch.tensor(4), num_kv_heads=2, head_dim=8) == \
        KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8)
