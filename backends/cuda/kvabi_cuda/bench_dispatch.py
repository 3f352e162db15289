"""Host cost of ``cuda.triton`` per step and per layer: what Python does around the kernels.

The workload of issue-style overhead figures: one decode token over 16 cached tokens,
32 query heads over 8 KV heads of 128, a 32-layer ``vllm.BLHNC`` cache.  Timed with the
kernel launches replaced by no-ops (the host work alone: checks, views, buffers, launch
arguments), for the two ways an engine can call the backend:

- ABI 1.0: a plain list of planes (checked against the layout on every call), no
  ``num_q_heads`` (query tiles built at the first layer), a new output per call;
- ABI 1.1: the :class:`kvabi.KVCache` handle (views a lookup), ``num_q_heads`` at plan
  time, ``out=`` reused.

On a CUDA device the same calls are also timed with the kernels (compiled; synchronized
once per step), which is what a decode step pays.
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
    """Per-step plan cost and per-layer write_kv + attention cost (seconds), 1.0 vs 1.1."""
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
    handle = be.allocate(layout)
    planes = list(handle)
    dt = handle[0].dtype
    q = torch.randn(1, 32, 128, device=dev).to(dt)
    k = torch.randn(1, 8, 128, device=dev).to(dt)
    v = torch.randn(1, 8, 128, device=dev).to(dt)
    out = torch.empty(1, 32, 128, dtype=dt, device=dev)

    def step_10():
        p = be.plan(meta, spec, layout)
        for layer in range(layers):
            be.write_kv(p, planes, key=k, value=v, layer=layer)
            be.attention(p, planes, query=q, layer=layer)

    def step_11():
        p = be.plan(meta, spec, layout, num_q_heads=32)
        for layer in range(layers):
            be.write_kv(p, handle, key=k, value=v, layer=layer)
            be.attention(p, handle, query=q, layer=layer, out=out)

    def layers_only(call_11: bool):
        p = be.plan(meta, spec, layout, num_q_heads=32 if call_11 else None)

        def run():
            for layer in range(layers):
                if call_11:
                    be.write_kv(p, handle, key=k, value=v, layer=layer)
                    be.attention(p, handle, query=q, layer=layer, out=out)
                else:
                    be.write_kv(p, planes, key=k, value=v, layer=layer)
                    be.attention(p, planes, query=q, layer=layer)
        return run

    res = {"layers": layers, "dtype": dtype, "device": str(dev), "repeats": repeats}
    with kernels_stubbed():
        res["plan_10_s"] = _best(lambda: be.plan(meta, spec, layout), repeats)
        res["plan_11_s"] = _best(lambda: be.plan(meta, spec, layout, num_q_heads=32), repeats)
        res["layer_10_s"] = _best(layers_only(False), repeats) / layers
        res["layer_11_s"] = _best(layers_only(True), repeats) / layers
        res["step_10_s"] = _best(step_10, repeats)
        res["step_11_s"] = _best(step_11, repeats)
    if dev.type == "cuda":
        def synced(fn):
            def run():
                fn()
                torch.cuda.synchronize(dev)
            return run

        res["step_11_kernels_s"] = _best(synced(step_11), repeats)
        res["step_10_kernels_s"] = _best(synced(step_10), repeats)
    return res


def report(res: dict) -> list[str]:
    """Text lines for :func:`measure_dispatch`'s figures."""
    us = 1e6
    lines = [f"cuda.triton host cost: decode 1 token over 16 cached, 32 q heads / 8 KV heads "
             f"x 128, {res['layers']}-layer vllm.BLHNC, {res['dtype']}, on {res['device']} "
             f"(kernels replaced by no-ops; best of {res['repeats']})",
             f"  {'what':<44}{'ABI 1.0':>10}{'ABI 1.1':>10}{'1.0/1.1':>9}"]
    for name, a, b in (("plan, per step (us)", res["plan_10_s"], res["plan_11_s"]),
                       ("write_kv + attention, per layer (us)", res["layer_10_s"],
                        res["layer_11_s"]),
                       ("plan + all layers, per step (us)", res["step_10_s"],
                        res["step_11_s"])):
        lines.append(f"  {name:<44}{a * us:>10.1f}{b * us:>10.1f}{a / b:>9.2f}")
    if "step_11_kernels_s" in res:
        lines.append(f"  {'with the kernels, per step (us)':<44}"
                     f"{res['step_10_kernels_s'] * us:>10.1f}"
                     f"{res['step_11_kernels_s'] * us:>10.1f}"
                     f"{res['step_10_kernels_s'] / res['step_11_kernels_s']:>9.2f}")
    return lines
