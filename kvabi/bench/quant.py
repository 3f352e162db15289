"""``kvabi bench quant``: what a quantized cache costs the ``reference`` backend.

One step per setting, ``write_kv`` + ``attention`` of one layer, side by side in one run
(the variants alternate within every repetition), on the same K/V and queries:

- ``float16``: unquantized, ``vllm.LBHNC``;
- ``int8 per_token_head``: codes and one float32 scale per (token, head), vLLM's packed
  record ``vllm.int8_per_token_head`` (rounding ``nearest_away``);
- ``fp8 per_token_head``: the same with float8 e4m3 codes (``vllm.fp8_per_token_head``);
- ``fp8 per_tensor``: float8 e4m3 codes under the layer's static scales (``vllm.LBHNC``).

Settings: a decode batch (``--batch`` requests, one new token over ``--context`` cached
tokens) and a prefill (``--prefill`` tokens of two fresh requests).  Figures: the median
and fastest wall time and the process CPU time per layer, and each variant's ratios to
``float16`` (median, fastest, CPU; the goal: int8 per-token-head within 1.5x of float16).
No figure is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from ..util.argtypes import int_arg

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 8, 32, 128, 16
#: (label, cache dtype, quant, rounding, layout preset)
VARIANTS = (("float16", "float16", "none", "nearest_even", "vllm.LBHNC"),
            ("int8 per_token_head", "int8", "per_token_head", "nearest_away",
             "vllm.int8_per_token_head"),
            ("fp8 per_token_head", "float8_e4m3fn", "per_token_head", "nearest_even",
             "vllm.fp8_per_token_head"),
            ("fp8 per_tensor", "float8_e4m3fn", "per_tensor", "nearest_even", "vllm.LBHNC"))
#: the goal printed beside the figures: int8 per-token-head vs float16
GOAL = 1.5


def _steps(batch: int, context: int, prefill: int):
    """{setting: metadata} of the decode batch and the prefill."""
    from ..step.metadata import CommonAttentionMetadata

    per = -(-(context + 1) // BLOCK)
    decode = CommonAttentionMetadata.from_lengths(
        [1] * batch, [context] * batch, np.arange(batch * per).reshape(batch, per), BLOCK,
        num_blocks=max(batch * per, 2 * -(-prefill // BLOCK)))
    p = -(-prefill // BLOCK)
    fresh = CommonAttentionMetadata.from_lengths(
        [prefill, prefill], [0, 0], np.arange(2 * p).reshape(2, p), BLOCK,
        num_blocks=decode.num_blocks)
    return {f"decode {batch} x 1 over {context}": decode,
            f"prefill 2 x {prefill}": fresh}


def _variant(backend, label, dtype, quant, rounding, preset, meta, rng):
    """(per-layer callable) for one variant over ``meta``: a cache whose context holds
    values, then the step's write and attention."""
    from ..layout.descriptor import Layout
    from ..model.spec import KVSpec

    spec = KVSpec("full", BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, quant=quant,
                  rounding=rounding)
    layout = Layout.preset(preset, spec, num_blocks=meta.num_blocks)
    cache = backend.allocate(layout)
    scales = {"k_scale": 0.02, "v_scale": 0.02} if quant == "per_tensor" else {}
    t = meta.num_tokens
    kv = rng.standard_normal((2, t, KV_HEADS, HEAD_DIM)).astype(np.float32)
    q = rng.standard_normal((t, Q_HEADS, HEAD_DIM)).astype(np.float32)
    if dtype == "float16":
        kv, q = kv.astype(np.float16), q.astype(np.float16)
    plan = backend.plan(meta, spec, layout, num_q_heads=Q_HEADS)

    def layer():
        backend.write_kv(plan, cache, key=kv[0], value=kv[1], **scales)
        backend.attention(plan, cache, query=q, **scales)
    return layer


def measure(batch=8, context=256, prefill=128, repeat=5, progress=None) -> dict:
    """{setting: {variant: figures}}; every repetition runs every variant."""
    from ..backend.registry import get_backend

    backend = get_backend("reference")
    rng = np.random.default_rng(0)
    out = {}
    for setting, meta in _steps(batch, context, prefill).items():
        layers = {v[0]: _variant(backend, *v, meta, rng) for v in VARIANTS}
        wall = {n: [] for n in layers}
        cpu = {n: [] for n in layers}
        for f in layers.values():  # warm-up
            f()
        for r in range(repeat):
            for n, f in layers.items():
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                wall[n].append((time.perf_counter() - t0) * 1e3)
                cpu[n].append((time.process_time() - c0) * 1e3)
            if progress:
                progress(f"{setting}: repetition {r + 1}/{repeat}")
        base, base_cpu = statistics.median(wall["float16"]), statistics.median(cpu["float16"])
        base_min = min(wall["float16"])
        out[setting] = {n: {"layer_ms": statistics.median(wall[n]), "layer_min_ms": min(wall[n]),
                            "layer_cpu_ms": statistics.median(cpu[n]),
                            "ratio": statistics.median(wall[n]) / base,
                            "min_ratio": min(wall[n]) / base_min,
                            "cpu_ratio": statistics.median(cpu[n]) / base_cpu}
                        for n in layers}
    return out


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench quant", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int_arg(1, 1024), default=8,
                   help="decoding requests (default 8)")
    p.add_argument("--context", type=int_arg(1, 1 << 16), default=256,
                   help="cached tokens per decoding request (default 256)")
    p.add_argument("--prefill", type=int_arg(1, 1 << 14), default=128,
                   help="tokens of each of the two prefilled requests (default 128)")
    p.add_argument("--repeat", type=int_arg(1, 10_000), default=5,
                   help="repetitions per setting (median reported; default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    args = p.parse_args(argv)
    prog = None if args.quiet else (lambda s: print(s, file=sys.stderr, end="\r",
                                                    flush=True))
    rows = measure(args.batch, args.context, args.prefill, args.repeat, prog)
    if prog:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps({"goal": GOAL, "heads": [Q_HEADS, KV_HEADS, HEAD_DIM],
                          "settings": rows}, indent=1))
        return 0
    print(f"reference write_kv + attention per layer: {Q_HEADS}/{KV_HEADS} heads x "
          f"{HEAD_DIM}, block {BLOCK}; median of {args.repeat}")
    for setting, r in rows.items():
        print(f"\n{setting}")
        print(f"{'variant':<22}{'layer ms':>10}{'(min)':>9}{'(cpu)':>9}{'x fp16':>8}"
              f"{'min x':>7}{'cpu x':>7}")
        for n, f in r.items():
            print(f"{n:<22}{f['layer_ms']:>10.2f}{f['layer_min_ms']:>9.2f}"
                  f"{f['layer_cpu_ms']:>9.2f}{f['ratio']:>8.2f}{f['min_ratio']:>7.2f}"
                  f"{f['cpu_ratio']:>7.2f}")
    worst = max(r["int8 per_token_head"]["ratio"] for r in rows.values())
    worst_min = max(r["int8 per_token_head"]["min_ratio"] for r in rows.values())
    print(f"\ngoal: reference on an int8 per-token-head cache within {GOAL}x of float16; "
          f"measured: {worst:.2f}x median, {worst_min:.2f}x of the fastest runs (the slower "
          f"setting; on a loaded machine the fastest runs are the least disturbed)")
    return 0
