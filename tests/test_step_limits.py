"""ABI 1.2: ``kvabi.StepLimits`` (validated, strict integers) and ``Backend.warmup`` (a
no-op in the base class, so every backend has it; 1.0/1.1 backends keep working)."""
from __future__ import annotations

import numpy as np
import pytest

import kvabi
from kvabi import KVABIError, StepLimits

SPEC = kvabi.KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")


def test_fields_and_numpy_ints():
    lim = StepLimits(max_tokens=np.int64(64), max_reqs=8, max_seq_len=1024)
    assert (lim.max_tokens, lim.max_reqs, lim.max_seq_len) == (64, 8, 1024)
    assert type(lim.max_tokens) is int
    assert lim == StepLimits(64, 8, 1024) and hash(lim) == hash(StepLimits(64, 8, 1024))
    with pytest.raises(AttributeError):
        lim.max_tokens = 5  # frozen


@pytest.mark.parametrize("field, bad, msg", [
    ("max_tokens", 0, "must be >= 1, got 0"),
    ("max_reqs", -3, "must be >= 1, got -3"),
    ("max_seq_len", 1 << 31, "must be <= 2147483647"),
    ("max_tokens", 1 << 25, "must be <= 16777216"),
    ("max_reqs", True, "must be an integer"),
    ("max_seq_len", 2.0, "must be an integer"),
    ("max_tokens", "8", "must be an integer"),
    ("max_reqs", None, "must be an integer"),
])
def test_bad_limits_name_the_field(field, bad, msg):
    kw = dict(max_tokens=8, max_reqs=2, max_seq_len=64)
    kw[field] = bad
    with pytest.raises(KVABIError, match=f"^StepLimits.{field}: {msg}"):
        StepLimits(**kw)


def test_check_names_the_exceeded_limit():
    lim = StepLimits(max_tokens=8, max_reqs=2, max_seq_len=20)
    ok = kvabi.CommonAttentionMetadata.from_lengths([3, 5], [12, 0], [[0, 1, 2, 3, 4],
                                                                      [5, 6, 7, 8, 9]], 4)
    lim.check(ok)
    for q, c, n, want in (([3, 6], [0, 0], None, "num_tokens: 9 exceeds the declared "
                                                  "StepLimits.max_tokens = 8"),
                          ([3, 5], [0, 0], 9, "num_tokens: 9 exceeds"),
                          ([1, 1], [20, 0], None, "seq_lens: 21 exceeds the declared "
                                                  "StepLimits.max_seq_len = 20")):
        meta = kvabi.CommonAttentionMetadata.from_lengths(q, c, [[0] * 6, [1] * 6], 4,
                                                          num_tokens=n)
        with pytest.raises(KVABIError, match=want):
            lim.check(meta)
    three = kvabi.CommonAttentionMetadata.from_lengths([1, 1, 1], [0, 0, 0], [[0], [1], [2]], 4)
    with pytest.raises(KVABIError, match="num_reqs: 3 exceeds .*max_reqs = 2"):
        lim.check(three)


def test_base_warmup_is_a_checked_no_op():
    ref = kvabi.get_backend("reference")
    assert ref.abi_version == kvabi.ABI_VERSION == (2, 1)
    layout = kvabi.Layout.preset("flashinfer.HND", SPEC, num_blocks=4)
    assert ref.warmup(SPEC, layout, StepLimits(8, 2, 16)) is None
    with pytest.raises(KVABIError, match="^limits: must be a kvabi.StepLimits, got dict"):
        ref.warmup(SPEC, layout, {"max_tokens": 8})
