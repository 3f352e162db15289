"""Host cost of ``cuda.triton`` per step and per layer: what Python does around the kernels.

The workload of issue-style overhead figures: one decode token over 16 cached tokens,
32 query heads over 8 KV heads of 128, a 32-layer ``vllm.BLHNC`` cache.  Timed with the
kernel launches replaced by no-ops (the host work alone: checks, views, buffers, launch
arguments), with ``out=`` reused per layer as an engine does.  On a CUDA device the same
calls are also timed with the kernels (compiled; synchronized once per step), which is
what a decode step pays.
"""
from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def kernels_stubbed():
    """Replace the two kernel launchers with no-ops for the duration."""
    from . import triton_attention, triton_write

    saved = triton_attention.paged_attention, triton_write.write_kv
    triton_attention.paged_attention = triton_write.write_kv = lambda *a, **k: None
    try:
        yield
    finally:
        triton_attention.paged_attention, triton_write.write_kv = saved


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: compiles on CUDA, fills the view cache
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_dispatch(layers: int = 32, repeats: int = 20, dtype: str = "float32") -> dict:
    """Per-step plan cost, per-layer write_kv + attention cost and a whole step (seconds)."""
    import torch

    import kvabi
    from kvabi import CommonAttentionMetadata, KVSpec, Layout

    be = kvabi.get_backend("cuda.triton")
    ok, why = be.available()
    if not ok:
        raise RuntimeError(f"cuda.triton unavailable: {why}")
    dev = be.device()
    spec = KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype=dtype)
    layout = Layout.preset("vllm.BLHNC", spec, 8, layers)
    meta = CommonAttentionMetadata.from_lengths([1], [16], [[0, 1]], 16, num_blocks=8)
    cache = be.allocate(layout)
    dt = cache[0].dtype
    q = torch.randn(1, 32, 128, device=dev).to(dt)
    k = torch.randn(1, 8, 128, device=dev).to(dt)
    v = torch.randn(1, 8, 128, device=dev).to(dt)
    out = torch.empty(1, 32, 128, dtype=dt, device=dev)

    def plan():
        return be.plan(meta, spec, layout, num_q_heads=32)

    def all_layers(p):
        for layer in range(layers):
            be.write_kv(p, cache, key=k, value=v, layer=layer)
            be.attention(p, cache, query=q, layer=layer, out=out)

    p0 = plan()
    res = {"layers": layers, "dtype": dtype, "device": str(dev), "repeats": repeats}
    with kernels_stubbed():
        res["plan_s"] = _best(plan, repeats)
        res["layer_s"] = _best(lambda: all_layers(p0), repeats) / layers
        res["step_s"] = _best(lambda: all_layers(plan()), repeats)
    if dev.type == "cuda":
        def synced():
            all_layers(plan())
            torch.cuda.synchronize(dev)

        res["step_kernels_s"] = _best(synced, repeats)
    return res


def report(res: dict) -> list[str]:
    """Text lines for :func:`measure_dispatch`'s figures."""
    us = 1e6
    lines = [f"cuda.triton host cost: decode 1 token over 16 cached, 32 q heads / 8 KV heads "
             f"x 128, {res['layers']}-layer vllm.BLHNC, {res['dtype']}, on {res['device']} "
             f"(kernels replaced by no-ops; best of {res['repeats']})"]
    for name, x in (("plan, per step (us)", res["plan_s"]),
                    ("write_kv + attention, per layer (us)", res["layer_s"]),
                    ("plan + all layers, per step (us)", res["step_s"])):
        lines.append(f"  {name:<44}{x * us:>10.1f}")
    if "step_kernels_s" in res:
        lines.append(f"  {'with the kernels, per step (us)':<44}"
                     f"{res['step_kernels_s'] * us:>10.1f}")
    return lines
