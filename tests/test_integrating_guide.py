"""The engine integrator's guide (docs/integrating.md) runs as written: every ```python
block, in order, in one namespace, from the repository root; then its results are checked
against direct computations (not against the code under test)."""
import re
from pathlib import Path

import numpy as np

import kvabi

ROOT = Path(__file__).parents[1]
GUIDE = ROOT / "docs" / "integrating.md"


def blocks():
    return re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.S | re.M)


def test_guide_runs(monkeypatch):
    monkeypatch.chdir(ROOT)
    ns = {}
    code = blocks()
    assert len(code) >= 10
    for i, block in enumerate(code):
        exec(compile(block, f"{GUIDE.name} block {i + 1}", "exec"), ns)
    model, where = ns["model"], ns["where"]
    # layer indices: the owner's position on its group's L axis, computed directly
    assert where == {"l0": (0, 0), "l2": (0, 1), "l4": (0, 1),
                     "l1": (1, 0), "l3": (1, 1), "l5": (1, 1)}
    assert model.owners == ("l0", "l1", "l2", "l3")
    # a shared layer reads its owner's cache: its query over the owner's index again gives
    # its output (requests 0 and 1: the host-pool block onloaded request 0's blocks over
    # request 2's afterwards)
    layouts, caches, plans = ns["layouts"], ns["caches"], ns["plans"]
    backend = ns["backend"]
    q, out5 = ns["outputs"]["l5"]
    own = backend.attention(plans[1], caches[1], query=q, layer=1)
    n = int(ns["query_lens"][:2].sum())
    assert np.array_equal(kvabi.tensors.to_numpy(own)[:n], kvabi.tensors.to_numpy(out5)[:n])
    # and the host round trip: request 0's first 3 blocks now also sit in request 2's
    for kv in (0, 1):
        view = np.asarray(caches[1].kv_view(1, kv))
        t = ns["tables"][1]
        assert np.array_equal(view[t[2][:3]], view[t[0][:3]])
    # request 1's 23 tokens arrived exactly (byte offsets, both layouts): moved by NIXL
    # where it is installed (the NIXL block rebinds ``dst``), else by the local execute
    src, dst = layouts[0], ns["dst_layout"]
    blocks0 = ns["tables"][0][1]
    for layer in range(src.num_layers):
        for kv in (0, 1):
            s = np.asarray(caches[0].kv_view(layer, kv))
            d = np.asarray(ns["dst"].kv_view(layer, kv))
            pos = np.arange(23)
            want = s[blocks0[pos // 16], pos % 16]
            got = d[(pos + 32) // 32, (pos + 32) % 32]
            assert np.array_equal(got, want)
    check_tp_section(ns)
    check_pd_section(ns)


def check_pd_section(ns):
    """Joining P/D: the consumer's blocks 2, 7 (32 tokens each) hold the producer's 40
    prompt tokens of blocks 3, 5, 6 (16 each), every layer, K and V; the pull ended, and
    the producer freed its blocks."""
    from kvabi.transfer import nixl

    if not nixl.available()[0]:
        return
    assert "d-1" in ns["pulled"] and "p-1" in ns["freed"] and ns["hold"]
    pos = np.arange(40)
    src_slot = np.array([3, 5, 6])[pos // 16] * 16 + pos % 16
    dst_slot = np.array([2, 7])[pos // 32] * 32 + pos % 32
    for layer in range(2):
        for kv in (0, 1):
            s = np.asarray(ns["pd_src"].kv_view(layer, kv))
            d = np.asarray(ns["pd_dst"].kv_view(layer, kv))
            assert np.array_equal(d[dst_slot // 32, dst_slot % 32], s[src_slot // 16, src_slot % 16])


def _element_bytes(cache, name, layer, slots, head, c):
    """The bytes of every element of component ``name`` at ``slots`` of ``head``."""
    p, o = cache.layout.element_offset(name, layer=layer, block=slots[:, None] // 16,
                                       token=slots[:, None] % 16, head=head,
                                       index=np.arange(c.count))
    flat = kvabi.tensors.to_numpy(cache[int(np.unique(p)[0])]).view(np.uint8)
    return flat[np.asarray(o)[..., None] + np.arange(c.unit)]


def check_tp_section(ns):
    """Each decode rank's cache holds, at its slots, the prefill engine's KV of the global
    heads its shard names (read back through kv_view of both sides, from the shard
    definition: rank r of 4 holds heads 2r, 2r+1; prefill rank q of 2 holds 4q .. 4q+3)."""
    p_caches, d_caches = ns["p_caches"], ns["d_caches"]
    p_slots, d_slots = ns["p_slots"], ns["d_slots"]
    for r, cache in enumerate(d_caches):
        for layer in range(32):
            for kv in (0, 1):
                got = np.asarray(cache.kv_view(layer, kv))[d_slots // 16, d_slots % 16]
                for h in range(2):
                    g = 2 * r + h
                    src = np.asarray(p_caches[g // 4].kv_view(layer, kv))
                    want = src[p_slots // 16, p_slots % 16, g % 4]
                    assert np.array_equal(got[:, h], want)
    assert ns["n"].kind == "relayout" and ns["n"].sources == (1,)
    # component layouts: vLLM's CPU caches of TP 2 to FlashInfer at TP 1 is a relayout from
    # both ranks; every decode rank's scales (and codes) are the prefill's of its global
    # heads, read through element_offset on both sides
    assert ns["n_cpu"].kind == "relayout" and ns["n_cpu"].sources == (0, 1)
    q_cache, q_out = ns["q_cache"], ns["q_out"]
    for r, cache in enumerate(q_out):
        for name in ("key", "key_scale", "value", "value_scale"):
            c = cache.layout.component(name)
            for layer in range(32):
                for h in range(2):
                    got = _element_bytes(cache, name, layer, d_slots, h, c)
                    want = _element_bytes(q_cache, name, layer, p_slots, 2 * r + h, c)
                    assert np.array_equal(got, want), (r, name, layer, h)


def test_readme_links_the_guide_and_placeholders_are_marked():
    assert "docs/integrating.md" in (ROOT / "README.md").read_text()
    text = GUIDE.read_text()
    for section in ("## 9. vLLM", "## 10. Joining P/D", "## 11. Proving a layout"):
        assert section in text

