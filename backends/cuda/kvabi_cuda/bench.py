"""``kvabi bench cuda [--json] [--suite write|dispatch|all]``: the cache write's bandwidth
as a ratio of a plain copy, and the host cost of ``cuda.triton`` per step and per layer.

Write: writes T new tokens of K and V into a ``flash_attn`` layout cache at a shuffled slot
mapping, with the Triton kernel and with the torch index_put fallback, and times a plain
``clone`` of the same K and V bytes on the same device.  A ratio of 1.0 means the write
moves bytes as fast as a copy.  Both writes are first checked equal to each other.
Without a CUDA device the Triton kernel runs in its interpreter: its figure then measures
Python, not a kernel, and the output says so.

Dispatch (:mod:`kvabi_cuda.bench_dispatch`): ``plan`` per step and ``write_kv`` +
``attention`` per layer with the kernels replaced by no-ops (the host work alone).
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np


def _parser():
    from kvabi.util.argtypes import int_arg

    pos = int_arg(lo=1, hi=1 << 24, name="positive integer")
    p = argparse.ArgumentParser(prog="kvabi bench cuda",
                                description=__doc__.split("\n\n")[0].strip('"` '))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--suite", choices=["write", "dispatch", "all"], default="all",
                   help="the cache-write bandwidth, the per-layer host cost, or both")
    p.add_argument("--tokens", type=pos, default=None,
                   help="new tokens written (default 16384 on CUDA, 512 interpreted)")
    p.add_argument("--heads", type=pos, default=8, help="KV heads")
    p.add_argument("--head-dim", type=pos, default=128)
    p.add_argument("--block-size", type=pos, default=16)
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--repeats", type=pos, default=None,
                   help="timed repetitions (default 20 on CUDA, 3 interpreted)")
    p.add_argument("--layers", type=pos, default=32,
                   help="layers of the dispatch suite's cross-layer cache")
    p.add_argument("--threads", type=pos, default=None,
                   help="torch CPU threads (default: torch's; on a busy machine 1 avoids "
                        "thread-pool contention dominating small copies)")
    return p


def _timer(device):
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def time_it(fn, repeats):
        fn()  # warm-up (compiles the kernel on CUDA)
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    return time_it


def measure(tokens=None, heads=8, head_dim=128, block_size=16, dtype="float16",
            repeats=None, threads=None) -> dict:
    """Run the benchmark; returns the figures as a dict."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    from kvabi import KVCache, KVSpec, Layout
    from kvabi.util.tensors import torch_dtype

    from . import runtime
    from .torch_write import write_kv_torch, write_rows
    from .triton_write import write_kv

    mode, why = runtime.triton_mode()
    if mode is None:
        raise RuntimeError(f"cuda.triton unavailable: {why}")
    interpret = mode == "interpret"
    if interpret and dtype == "bfloat16":
        raise RuntimeError("bfloat16 is refused in the Triton interpreter")
    tokens = tokens or (512 if interpret else 16384)
    repeats = repeats or (3 if interpret else 20)
    device = runtime.device()
    spec = KVSpec("full", block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                  dtype=dtype)
    nblocks = -(-tokens // block_size) * 2
    layout = Layout.preset("flash_attn", spec, nblocks)
    cache = KVCache.allocate(layout, "torch", device=device)
    k_view, v_view = cache.kv_view(0, 0), cache.kv_view(0, 1)
    rng = np.random.default_rng(0)
    slots_np = rng.permutation(nblocks * block_size)[:tokens]
    slots = torch.as_tensor(slots_np, device=device)
    rows = tuple(torch.as_tensor(a, device=device) for a in write_rows(slots_np, block_size))
    dt = torch_dtype(dtype)
    key = torch.randn(tokens, heads, head_dim, device=device).to(dt)
    value = torch.randn(tokens, heads, head_dim, device=device).to(dt)

    # Both writes must agree before either is timed.
    write_kv(key, value, k_view, v_view, slots, block_size, interpret=interpret)
    got = [c.clone() for c in cache]
    for c in cache:
        c.zero_()
    write_kv_torch(key, value, k_view, v_view, rows)
    if not all(torch.equal(a, b) for a, b in zip(got, cache)):
        raise RuntimeError("Triton and torch cache writes disagree")

    time_it = _timer(device)
    t_copy = time_it(lambda: (key.clone(), value.clone()), repeats)
    t_triton = time_it(lambda: write_kv(key, value, k_view, v_view, slots, block_size,
                                        interpret=interpret), repeats)
    t_torch = time_it(lambda: write_kv_torch(key, value, k_view, v_view, rows),
                      repeats)
    nbytes = 2 * key.numel() * key.element_size()  # K and V bytes written (and read)

    def gbs(t):
        return nbytes / t / 1e9

    return {
        "suite": "cuda",
        "device": str(device),
        "device_name": runtime.cuda_status()[1] if device.type == "cuda"
        else platform.processor() or platform.machine(),
        "triton_mode": mode,
        "tokens": tokens, "heads": heads, "head_dim": head_dim, "block_size": block_size,
        "dtype": dtype, "bytes": nbytes, "repeats": repeats,
        "cpu_threads": torch.get_num_threads(),
        "copy_s": t_copy, "triton_write_s": t_triton, "torch_write_s": t_torch,
        "copy_GBps": gbs(t_copy), "triton_write_GBps": gbs(t_triton),
        "torch_write_GBps": gbs(t_torch),
        "triton_vs_copy": t_copy / t_triton, "torch_vs_copy": t_copy / t_torch,
        "note": ("Triton interpreter (no CUDA device): the Triton figure measures Python "
                 "interpretation, not a kernel; only the torch fallback ratio is meaningful "
                 "here" if interpret else "compiled Triton on CUDA"),
    }


def run(argv=None) -> int:
    args = _parser().parse_args(argv)
    res = {"suite": "cuda"}
    if args.suite in ("write", "all"):
        res.update(measure(args.tokens, args.heads, args.head_dim, args.block_size,
                           args.dtype, args.repeats, args.threads))
    if args.suite in ("dispatch", "all"):
        from .bench_dispatch import measure_dispatch

        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        res["dispatch"] = measure_dispatch(args.layers, args.repeats or 20)
    if args.json:
        print(json.dumps(res, sort_keys=True))
        return 0
    if "bytes" in res:
        _print_write(res)
    if "dispatch" in res:
        from .bench_dispatch import report

        print("\n".join(report(res["dispatch"])))
    return 0


def _print_write(res: dict) -> None:
    print(f"cuda bench: cache write of {res['tokens']} tokens x {res['heads']} heads x "
          f"{res['head_dim']} ({res['dtype']}, block {res['block_size']}), "
          f"{res['bytes'] / 1e6:.2f} MB of K+V, on {res['device']} ({res['device_name']}, "
          f"{res['cpu_threads']} CPU threads)")
    print(f"  {'what':<26}{'best time':>12}{'GB/s':>10}{'vs copy':>10}")
    rows = [("plain copy (clone)", res["copy_s"], res["copy_GBps"], 1.0),
            ("Triton write_kv", res["triton_write_s"], res["triton_write_GBps"],
             res["triton_vs_copy"]),
            ("torch index_put write", res["torch_write_s"], res["torch_write_GBps"],
             res["torch_vs_copy"])]
    for name, t, bw, ratio in rows:
        print(f"  {name:<26}{t * 1e3:>10.3f}ms{bw:>10.2f}{ratio:>10.3f}")
    print(f"  note: {res['note']}")
