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
    """ABI 1.1 keywords the kit's checks need not use: out= is filled in place and
    returned; sinks given to attention override the plan's (one plan, two layers)."""
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
        ref_plan = ref.plan(meta, spec, layout, sinks=sinks[layer])
        ref.write_kv(ref_cache, layout, k + layer, v - layer, ref_plan, layer=layer)
        ours.write_kv(cache, layout, torch.from_numpy(k + layer), torch.from_numpy(v - layer),
                      plan, layer=layer)
        want, want_lse = ref.attention(q, ref_cache, layout, ref_plan, layer=layer,
                                       return_lse=True)
        buf = torch.full((meta.num_tokens, 4, 8), float("nan"))
        got, got_lse = ours.attention(torch.from_numpy(q), cache, layout, plan, layer=layer,
                                      sinks=torch.from_numpy(sinks[layer]), out=buf,
                                      return_lse=True)
        assert got is buf and got.dtype == torch.float32 and got_lse.dtype == torch.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_lse.numpy(), want_lse, rtol=1e-5, atol=1e-6)
