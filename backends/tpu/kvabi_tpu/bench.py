"""``kvabi bench tpu [--json] [--quick]``: tokens per second of cache update and attention.

One mixed batch (decodes, chunked prefills with context, fresh prefills; shuffled block
ids) runs through ``tpu.jax`` and the ``reference`` oracle side by side, each on the same
cache contents and inputs: ``write_kv`` of the step's new K/V and ``attention`` of its
queries.  Tokens per second = real query tokens / median wall time (after a warm-up run
that compiles).  ``tpu.pallas`` joins by default where it compiles natively (a TPU);
name it in ``--backends`` to time its interpreted form (slow, for a sanity check only).

Then the cost of a write against the cache size: ``tpu.jax`` writes the same 64 tokens
into one ``tpu.combined`` layer of a 1 MiB and of a 256 MiB cache, side by side in one run,
in place (the cache donated, the default) and as a functional copy (``donate_cache=False``).
In place, both should take about the same time: a write costs the tokens it writes.

Then the steady state (:mod:`.bench_steps`): limits declared from ``--tokens``, ``--reqs``
and ``--context``, ``warmup``, and ``--steps`` random steps within them: compiles after
warm-up (goal 0) and each step's time against the median (goal: within 3x).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import kvabi
from kvabi import KVABIError, KVCache
from kvabi.util.dtypes import numpy_dtype
from kvabi.memory.views import allocate_numpy

from .env import on_tpu


def mixed_batch(num_reqs: int, num_tokens: int, max_context: int, block_size: int,
                seed: int):
    """Metadata: about half decodes, a quarter chunked prefills (context > 0), a quarter
    fresh prefills; query lengths sum to ``num_tokens``."""
    if num_tokens < num_reqs:
        raise KVABIError(f"--tokens: need at least one token per request ({num_reqs}), "
                         f"got {num_tokens}")
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=num_reqs, p=[0.5, 0.25, 0.25])  # decode, chunked, fresh
    kind[0] = 2
    pre = np.nonzero(kind > 0)[0]
    q = np.ones(num_reqs, np.int64)
    q[pre] += rng.multinomial(num_tokens - num_reqs, np.full(len(pre), 1.0 / len(pre)))
    c = np.where(kind == 2, 0, rng.integers(1, max_context + 1, num_reqs))
    need = -(-(q + c) // block_size)
    width = int(need.max())
    nb = num_reqs * width
    table = rng.permutation(nb).reshape(num_reqs, width)
    return kvabi.CommonAttentionMetadata.from_lengths(q, c, table, block_size, num_blocks=nb)


def median_seconds(fn, repeat: int, budget_s: float = 20.0) -> float:
    """Median of up to ``repeat`` timed runs after one warm-up run (which compiles); stops
    early once ``budget_s`` is spent (the float64 reference is slow on large batches)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max(1, repeat) and (not times or
                                           time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _ready(x):
    """Wait for a jax result (no-op for numpy)."""
    for a in (x if isinstance(x, (list, tuple)) else [x]):
        if hasattr(a, "block_until_ready"):
            a.block_until_ready()
    return x


def write_scaling(sizes_mib=(1, 256), tokens: int = 64, repeat: int = 5,
                  backend_name: str = "tpu.jax") -> list[dict]:
    """Median time of writing ``tokens`` new tokens (one request, whole pages) into one
    ``tpu.combined`` layer (8 KV heads x 128, 16-token pages, float32) of caches of
    ``sizes_mib`` MiB: in place (donated; at least 20 runs, each costs little) and as a
    copy (``repeat`` runs)."""
    backend = kvabi.get_backend(backend_name)
    spec = kvabi.KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype="float32")
    page = kvabi.Layout.preset("tpu.combined", spec, 1).plane_nbytes
    pages = -(-tokens // spec.block_size)
    rng = np.random.default_rng(0)
    k = kvabi.tensors.convert(rng.standard_normal((tokens, 8, 128)).astype(np.float32),
                              backend.framework)
    rows = []
    for mib in sizes_mib:
        nb = max(pages, (mib << 20) // page)
        layout = kvabi.Layout.preset("tpu.combined", spec, nb)
        # the last pages of the cache: nothing near the start to favour the small one
        meta = kvabi.CommonAttentionMetadata.from_lengths(
            [tokens], [0], np.arange(nb - pages, nb)[None, :], spec.block_size, num_blocks=nb)
        row = {"cache_mib": layout.plane_nbytes / 2**20, "tokens": tokens,
               "backend": backend.name}
        for mode, donate in (("in_place", True), ("copy", False)):
            b = type(backend)(donate_cache=donate)
            plan = b.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
            state = {"cache": b.allocate(layout)}

            def write(b=b, plan=plan, layout=layout):
                state["cache"] = _ready(b.write_kv(plan, state["cache"], key=k, value=k))

            row[f"{mode}_ms"] = median_seconds(write, max(20, repeat) if donate
                                               else repeat) * 1e3
            del state["cache"]
        rows.append(row)
    return rows


def measure(backend, spec, layout, meta, arrays, repeat: int) -> dict:
    """Median times of one backend on the batch; for the TPU backends the write is timed
    twice: in place (cache donated, the default) and functional (the cache is copied)."""
    key, value, query, pool = arrays
    n = meta.num_actual_tokens
    def arr(x):
        return kvabi.tensors.convert(x, backend.framework, device=backend.device())

    k, v, q = arr(key), arr(value), arr(query)
    state = {"cache": kvabi.KVCache.wrap(layout, [arr(np.array(p)) for p in pool])}
    hq = query.shape[1]
    plan_s = median_seconds(lambda: backend.plan(meta, spec, layout, num_q_heads=hq), repeat)
    plan = backend.plan(meta, spec, layout, num_q_heads=hq)

    def write(b, plan):
        state["cache"] = _ready(b.write_kv(plan, state["cache"], key=k, value=v))

    out = {"backend": backend.name, "mode": backend.available()[1], "plan_ms": plan_s * 1e3}
    write_s = median_seconds(lambda: write(backend, plan), repeat)
    if hasattr(backend, "donate_cache"):
        copying = type(backend)(donate_cache=False)
        copy_plan = copying.plan(meta, spec, layout, num_q_heads=hq)
        copy_s = median_seconds(lambda: write(copying, copy_plan), repeat)
        out.update(write_copy_ms=copy_s * 1e3, write_copy_tokens_per_s=n / copy_s)
    out.update(write_ms=write_s * 1e3, write_tokens_per_s=n / write_s)
    cache = state["cache"]
    attn_s = median_seconds(lambda: _ready(backend.attention(plan, cache, query=q)), repeat)
    out.update(attention_ms=attn_s * 1e3, attention_tokens_per_s=n / attn_s)
    return out


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvabi bench tpu", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quick", action="store_true", help="a small batch and few runs")
    p.add_argument("--reqs", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512, help="query tokens in the batch")
    p.add_argument("--context", type=int, default=1024, help="largest context length")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layout", default="tpu.combined", choices=("tpu.combined", "tpu.hidden"))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--backends", default=None,
                   help="comma-separated backends (default: tpu.jax,reference, plus "
                        "tpu.pallas on a TPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None,
                   help="random steps of the steady-state run after warm-up (default 200; "
                        "40 with --quick; 0 skips it)")
    p.add_argument("--baseline", type=int, default=None,
                   help="of those steps, how many also run without declared limits, to "
                        "count their compiles (default 20; 5 with --quick)")
    p.add_argument("--big-mib", type=int, default=None,
                   help="size of the large cache of the write-scaling rows in MiB "
                        "(default 256; 16 with --quick)")
    a = p.parse_args(argv)
    if a.quick:
        a.reqs, a.tokens, a.context, a.repeat = 8, 64, 128, 2
    if a.big_mib is None:
        a.big_mib = 16 if a.quick else 256
    if a.steps is None:
        a.steps = 40 if a.quick else 200
    if a.baseline is None:
        a.baseline = 5 if a.quick else 20
    for field in ("steps", "baseline"):
        if getattr(a, field) < 0:
            p.error(f"--{field}: must be >= 0, got {getattr(a, field)}")
    for field in ("reqs", "tokens", "context", "block_size", "kv_heads", "q_heads",
                  "head_dim", "repeat", "big_mib"):
        if getattr(a, field) < 1:
            p.error(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(a, field)}")
    names = a.backends.split(",") if a.backends else \
        ["tpu.jax", "reference"] + (["tpu.pallas"] if on_tpu() else [])
    spec = kvabi.KVSpec("full", block_size=a.block_size, num_kv_heads=a.kv_heads,
                        head_dim=a.head_dim, dtype=a.dtype)
    meta = mixed_batch(a.reqs, a.tokens, a.context, a.block_size, a.seed)
    layout = kvabi.Layout.preset(a.layout, spec, meta.num_blocks)
    rng = np.random.default_rng(a.seed)
    dt = numpy_dtype(a.dtype)
    t, h, d = meta.num_tokens, a.kv_heads, a.head_dim
    pool = allocate_numpy(layout, 0)
    handle = KVCache.wrap(layout, pool)
    for kv in (0, 1):
        view = handle.kv_view(0, kv)
        view[...] = rng.standard_normal(view.shape).astype(dt)
    arrays = (rng.standard_normal((t, h, d)).astype(dt), rng.standard_normal((t, h, d)).astype(dt),
              rng.standard_normal((t, a.q_heads, d)).astype(dt), pool)
    results = []
    for name in names:
        backend = kvabi.get_backend(name)
        ok, why = backend.available()
        if not ok:
            results.append({"backend": name, "mode": why, "skipped": True})
            continue
        print(f"kvabi bench tpu: {name} ...", file=sys.stderr, flush=True)
        results.append(measure(backend, spec, layout, meta, arrays, a.repeat))
    scaling = []
    if kvabi.get_backend("tpu.jax").available()[0]:
        print("kvabi bench tpu: write scaling ...", file=sys.stderr, flush=True)
        scaling = write_scaling((1, a.big_mib), repeat=a.repeat)
    steady = None
    if a.steps and kvabi.get_backend("tpu.jax").available()[0]:
        from .bench_steps import steady_state

        steady = steady_state(
            limits=kvabi.StepLimits(max_tokens=a.tokens, max_reqs=a.reqs,
                                    max_seq_len=a.context),
            spec=spec, num_q_heads=a.q_heads, steps=a.steps,
            baseline=min(a.baseline, a.steps), seed=a.seed)
    batch = {"num_reqs": meta.num_reqs, "query_tokens": meta.num_actual_tokens,
             "decodes": int((meta.query_lens == 1).sum()),
             "context_tokens": int(meta.context_lens.sum()), "max_seq_len": meta.max_seq_len,
             "block_size": a.block_size, "kv_heads": h, "q_heads": a.q_heads, "head_dim": d,
             "dtype": a.dtype, "layout": a.layout}
    if a.json:
        print(json.dumps({"suite": "tpu", "statistic": "median", "repeat": a.repeat,
                          "batch": batch, "results": results, "write_scaling": scaling,
                          "steady_state": steady}, indent=2))
        return 0
    print("batch: " + ", ".join(f"{k}={v}" for k, v in batch.items()))
    print("write: in place (reference: numpy in place; tpu.*: cache donated), "
          "write copy: functional update that copies the cache")
    print(f"{'backend':<12} {'write tok/s':>14} {'write copy tok/s':>17} "
          f"{'attention tok/s':>16} {'plan ms':>9}  mode")
    for r in results:
        if r.get("skipped"):
            print(f"{r['backend']:<12} {'-':>14} {'-':>17} {'-':>16} {'-':>9}  {r['mode']}")
            continue
        copy = r.get("write_copy_tokens_per_s")
        copy = "-" if copy is None else f"{copy:,.0f}"
        print(f"{r['backend']:<12} {r['write_tokens_per_s']:>14,.0f} {copy:>17} "
              f"{r['attention_tokens_per_s']:>16,.0f} {r['plan_ms']:>9.2f}  {r['mode']}")
    if scaling:
        print(f"\nwrite of {scaling[0]['tokens']} tokens into one tpu.combined layer "
              f"(tpu.jax; median ms):")
        print(f"{'cache MiB':>10} {'in place ms':>12} {'copy ms':>10}")
        for r in scaling:
            print(f"{r['cache_mib']:>10.0f} {r['in_place_ms']:>12.3f} {r['copy_ms']:>10.3f}")
        small, big = scaling[0], scaling[-1]
        print(f"in place: {big['in_place_ms'] / small['in_place_ms']:.2f}x the time for "
              f"{big['cache_mib'] / small['cache_mib']:.0f}x the cache (copy: "
              f"{big['copy_ms'] / small['copy_ms']:.1f}x)")
    if steady:
        from .bench_steps import report

        print()
        print("\n".join(report(steady)))
    return 0
