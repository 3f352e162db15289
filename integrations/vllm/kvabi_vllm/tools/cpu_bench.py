"""``kvabi bench cpu.vllm``: what kvabi costs around vLLM's CPU attention kernels.

One decode step (``--batch`` requests, one new token each over ``--context`` cached
tokens; 32 query heads over 8 KV heads of 128, block 32), per layer, side by side in one
run (the variants alternate within every repetition):

- ``vllm``: the kernels as vLLM's own CPU backend calls them: ``cpu_attn_reshape_and_cache``
  of the new K/V and ``cpu_attention_with_kv_cache`` over the cache in the kernels' order,
  scheduler metadata once per step;
- ``cpu.vllm <layout>``: the kvabi backend's ``write_kv`` + ``attention`` over a kvabi
  cache, ``plan`` once per step: ``vllm.cpu`` (vLLM's own cache: the kernels' write, both
  read in place), ``vllm.cpu_kt`` (keys read in place, values of the step's blocks copied)
  and ``vllm.LBHNC`` (both copied).

``--kv-dtype fp8`` (or ``fp8_e5m2``) runs an fp8 cache: vLLM's kernels with
``kv_cache_dtype`` and per-tensor scales, kvabi's spec ``per_tensor`` with vLLM's rounding.

Figures: median wall time per layer (and the process CPU time, less sensitive to other
processes on a shared machine), plan per step, and each variant's ratio to ``vllm``. No
figure is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from kvabi.util.argtypes import int_arg

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 32
LAYOUTS = ("vllm.cpu", "vllm.cpu_kt", "vllm.LBHNC")
#: vLLM's fp8 cache dtypes -> kvabi's; the static scales both sides use
FP8 = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
SCALES = {"k_scale": 0.05, "v_scale": 0.04}
#: the goal: kvabi's step on vLLM's own cache within this of vLLM's own
GOAL = 1.05


def _setup(batch: int, context: int, dtype: str, kv_dtype: str = "auto"):
    import torch

    import kvabi

    quant = {} if kv_dtype == "auto" else dict(dtype=FP8[kv_dtype], quant="per_tensor",
                                                rounding="toward_zero")
    spec = kvabi.KVSpec("full", block_size=BLOCK, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                        **{"dtype": dtype, **quant})
    per = -(-(context + 1) // BLOCK)
    blocks = batch * per
    rng = np.random.default_rng(0)
    table = rng.permutation(blocks).reshape(batch, per)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1] * batch, [context] * batch, table,
                                                      BLOCK, num_blocks=blocks)
    tdt = kvabi.tensors.torch_dtype(dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(tdt)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).to(tdt)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g).to(tdt)
    return spec, meta, blocks, q, k, v


def _vllm_variant(spec, meta, blocks, q, k, v, kv_dtype="auto"):
    """(per-step, per-layer) callables running the kernels as vLLM's CPU backend does."""
    import torch
    from vllm import _custom_ops as ops

    from ..cpu_layout import choose_isa, kernel_scratch

    tdt = q.dtype
    fp8 = dict(SCALES, kv_cache_dtype=kv_dtype) if kv_dtype != "auto" else {}
    _, kc, vc = kernel_scratch(torch, blocks, KV_HEADS, BLOCK, HEAD_DIM,
                               torch.uint8 if fp8 else tdt)
    kc.zero_(), vc.zero_()
    isa = choose_isa(HEAD_DIM, BLOCK)
    qsl = torch.from_numpy(meta.query_start_loc.astype(np.int32))
    seq = torch.from_numpy(meta.seq_lens.astype(np.int32))
    table = torch.from_numpy(meta.block_table.astype(np.int32))
    slots = torch.from_numpy(meta.slot_mapping.astype(np.int64))
    out = torch.empty_like(q)
    state = {}

    def step():
        state["md"] = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=meta.num_reqs, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            seq_lens=seq, dtype=tdt, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False)

    def layer():
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa, **fp8)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
            seq_lens=seq, scale=HEAD_DIM ** -0.5, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=state["md"], s_aux=None, **fp8)
    return step, layer


def _kvabi_variant(backend, name, spec, meta, blocks, q, k, v):
    import kvabi

    layout = kvabi.Layout.preset(name, spec, num_blocks=blocks)
    cache = backend.allocate(layout)
    state = {}

    def step():
        state["plan"] = backend.plan(meta, spec, layout, num_q_heads=HEADS)

    scales = SCALES if spec.is_quantized else {}

    def layer():
        backend.write_kv(state["plan"], cache, key=k, value=v, **scales)
        backend.attention(state["plan"], cache, query=q, **scales)
    return step, layer


def measure(batch=8, context=512, dtype="float32", repeat=30, layers=8, progress=None,
            kv_dtype="auto") -> dict:
    """{variant: figures} for one setting; every repetition runs every variant."""
    from ..cpu_backend import CpuVllmBackend

    backend = CpuVllmBackend()
    ok, why = backend.available()
    if not ok:
        raise SystemExit(f"kvabi bench cpu.vllm: cpu.vllm unavailable: {why}")
    spec, meta, blocks, q, k, v = _setup(batch, context, dtype, kv_dtype)
    variants = {"vllm": _vllm_variant(spec, meta, blocks, q, k, v, kv_dtype)}
    for name in LAYOUTS:
        variants[f"cpu.vllm {name}"] = _kvabi_variant(backend, name, spec, meta, blocks, q, k, v)
    wall = {n: [] for n in variants}
    cpu = {n: [] for n in variants}
    plan = {n: [] for n in variants}
    for step, layer in variants.values():  # warm-up
        step(), layer()
    for r in range(repeat):
        for n, (step, layer) in variants.items():
            t0 = time.perf_counter()
            step()
            t1, c1 = time.perf_counter(), time.process_time()
            for _ in range(layers):
                layer()
            t2, c2 = time.perf_counter(), time.process_time()
            plan[n].append((t1 - t0) * 1e6)
            wall[n].append((t2 - t1) / layers * 1e6)
            cpu[n].append((c2 - c1) / layers * 1e6)
        if progress:
            progress(f"repetition {r + 1}/{repeat}")
    base = statistics.median(wall["vllm"])
    base_cpu = statistics.median(cpu["vllm"])
    return {n: {"layer_us": statistics.median(wall[n]), "layer_min_us": min(wall[n]),
                "layer_cpu_us": statistics.median(cpu[n]), "plan_us": statistics.median(plan[n]),
                "ratio": statistics.median(wall[n]) / base,
                "cpu_ratio": statistics.median(cpu[n]) / base_cpu}
            for n in variants}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench cpu.vllm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--batch", type=int_arg(1, 1024), default=8,
                   help="decoding requests (default 8)")
    p.add_argument("--context", type=int_arg(1, 1 << 17), default=512,
                   help="cached tokens per request (default 512)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype: queries and new K/V (and the cache, with --kv-dtype "
                        "auto)")
    p.add_argument("--kv-dtype", default="auto", choices=("auto", *FP8),
                   help="the cache: the model dtype (auto) or fp8 codes with per-tensor "
                        "scales (vLLM's kv_cache_dtype)")
    p.add_argument("--repeat", type=int_arg(1, 100_000), default=30,
                   help="repetitions (default 30)")
    p.add_argument("--layers", type=int_arg(1, 10_000), default=8,
                   help="layers per timed step (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    prog = None if args.quiet else (lambda s: print(s, file=sys.stderr, end="\r"))
    rows = measure(args.batch, args.context, args.dtype, args.repeat, args.layers, prog,
                   args.kv_dtype)
    if args.json:
        print(json.dumps({"batch": args.batch, "context": args.context, "dtype": args.dtype,
                          "kv_dtype": args.kv_dtype, "goal": GOAL, "variants": rows},
                         indent=1))
        return 0
    print(f"decode step: {args.batch} requests x 1 token over {args.context} cached tokens, "
          f"{HEADS}/{KV_HEADS} heads x {HEAD_DIM}, block {BLOCK}, {args.dtype}, cache "
          f"{args.kv_dtype} (per layer: write + attention; median of {args.repeat})")
    print(f"{'variant':<22}{'layer us':>10}{'(min)':>9}{'(cpu)':>9}{'plan us':>9}"
          f"{'x vllm':>8}{'cpu x':>7}")
    for n, r in rows.items():
        print(f"{n:<22}{r['layer_us']:>10.1f}{r['layer_min_us']:>9.1f}"
              f"{r['layer_cpu_us']:>9.1f}{r['plan_us']:>9.1f}{r['ratio']:>8.2f}"
              f"{r['cpu_ratio']:>7.2f}")
    own = rows["cpu.vllm vllm.cpu"]
    print(f"goal: cpu.vllm on vLLM's own cache (vllm.cpu) <= {GOAL}x vLLM's own step; "
          f"measured: {own['ratio']:.2f}x (cpu time {own['cpu_ratio']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
