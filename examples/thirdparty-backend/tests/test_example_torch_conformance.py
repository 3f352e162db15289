"""example.torch through the kvabi conformance kit, as a backend author's own test suite.

``BackendConformance`` runs every check of the kit (writes byte for byte on a poisoned
cache, attention against the float64 reference, layouts, refusals, metadata transforms,
KV sharing) under the kit's profile (``ci`` unless ``--kvabi-profile``/
``KVABI_HYPOTHESIS_PROFILE`` say otherwise) and seed (``--kvabi-seed``/``KVABI_SEED``).
"""
import numpy as np
import torch

import kvabi
from kvabi.testing import BackendConformance


class TestExample(BackendConformance):
    backend_name = "example.torch"


def test_out_buffer_and_per_call_sinks_match_the_reference():
    """out= is filled in place and returned; sinks given to attention override the plan's
    (one plan, two layers)."""
    spec = kvabi.KVSpec("sliding_window", block_size=4, num_kv_heads=2, head_dim=8,
                        dtype="float32", window=3)
    layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=4, num_layers=2)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1, 3], [5, 0], [[2, 0], [1, 3]], 4,
                                                      num_blocks=4)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((meta.num_tokens, 4, 8)).astype(np.float32)
    k = rng.standard_normal((meta.num_tokens, 2, 8)).astype(np.float32)
    v = rng.standard_normal((meta.num_tokens, 2, 8)).astype(np.float32)
    sinks = {0: np.array([0.5, -1.0, 2.0, 0.0]), 1: np.array([-0.3, 1.5, 0.1, -2.0])}
    ref, ours = kvabi.get_backend("reference"), kvabi.get_backend("example.torch")
    ref_cache = kvabi.KVCache.allocate(layout, "numpy")
    cache = ours.allocate(layout)
    plan = ours.plan(meta, spec, layout, num_q_heads=4, sinks=sinks[0])
    for layer in (1, 0):
        ref_plan = ref.plan(meta, spec, layout, num_q_heads=4, sinks=sinks[layer])
        ref.write_kv(ref_plan, ref_cache, key=k + layer, value=v - layer, layer=layer)
        ours.write_kv(plan, cache, key=torch.from_numpy(k + layer),
                      value=torch.from_numpy(v - layer), layer=layer)
        want, want_lse = ref.attention(ref_plan, ref_cache, query=q, layer=layer,
                                       return_lse=True)
        buf = torch.full((meta.num_tokens, 4, 8), float("nan"))
        got, got_lse = ours.attention(plan, cache, query=torch.from_numpy(q), layer=layer,
                                      sinks=torch.from_numpy(sinks[layer]), out=buf,
                                      return_lse=True)
        assert got is buf and got.dtype == torch.float32 and got_lse.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_lse.numpy(), want_lse, rtol=1e-5, atol=1e-6)


def test_nan_outside_the_requests_never_reaches_a_result():
    """The request-major gather reads whole blocks (the tail of a request's last block,
    blocks before a sliding window, a shorter request's padded columns): every row it
    must not read is NaN here, and both attention paths (fused SDPA, and the einsum path
    that return_lse takes) still match the float64 reference on a mixed decode/prefill
    step with GQA."""
    for kind, extra in (("full", {}), ("sliding_window", {"window": 5})):
        spec = kvabi.KVSpec(kind, block_size=4, num_kv_heads=2, head_dim=8,
                            dtype="float32", **extra)
        layout = kvabi.Layout.preset("flash_attn", spec, num_blocks=12, num_layers=1)
        # decode at 13 tokens (3 context blocks + 1), a 6-token prefill, a 2-token chunk
        meta = kvabi.CommonAttentionMetadata.from_lengths(
            [1, 6, 2], [12, 0, 3], [[5, 1, 7, 9], [0, 11, 4, 4], [2, 8, 4, 4]], 4,
            num_blocks=12)
        rng = np.random.default_rng(1)
        n = meta.num_tokens
        q = rng.standard_normal((n, 4, 8)).astype(np.float32)
        k = rng.standard_normal((n, 2, 8)).astype(np.float32)
        v = rng.standard_normal((n, 2, 8)).astype(np.float32)
        ref, ours = kvabi.get_backend("reference"), kvabi.get_backend("example.torch")
        ref_cache = kvabi.KVCache.allocate(layout, "numpy")
        cache = kvabi.KVCache.allocate(layout, "torch", fill=0)
        for plane in cache:
            plane.fill_(float("nan"))
        # context tokens: the same random values written into both caches' slots
        ctx = {0: (12, [5, 1, 7]), 2: (3, [2])}
        for r, (c, blocks) in ctx.items():
            kc = rng.standard_normal((c, 2, 8)).astype(np.float32)
            vc = rng.standard_normal((c, 2, 8)).astype(np.float32)
            for p in range(c):
                b, o = blocks[p // 4], p % 4
                for kv, x in ((0, kc), (1, vc)):
                    ref_cache.kv_view(0, kv)[b, o] = x[p]
                    cache.kv_view(0, kv)[b, o] = torch.from_numpy(x[p])
        ref_plan = ref.plan(meta, spec, layout, num_q_heads=4)
        ref.write_kv(ref_plan, ref_cache, key=k, value=v)
        want, want_lse = ref.attention(ref_plan, ref_cache, query=q, return_lse=True)
        plan = ours.plan(meta, spec, layout, num_q_heads=4)
        ours.write_kv(plan, cache, key=torch.from_numpy(k), value=torch.from_numpy(v))
        got = ours.attention(plan, cache, query=torch.from_numpy(q))
        got2, got_lse = ours.attention(plan, cache, query=torch.from_numpy(q), return_lse=True)
        for x in (got, got2):
            assert torch.isfinite(x).all(), kind
            np.testing.assert_allclose(x.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=kind)
        np.testing.assert_allclose(got_lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)
