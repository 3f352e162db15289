"""The steady-state part of ``kvabi bench tpu``: compiles and step times over random steps.

An engine declares its limits, warms the backend up, then runs steps of every mix of
decodes, chunked prefills and fresh prefills.  This runs ``steps`` such random steps (within
the limits) through ``tpu.jax`` after ``warmup`` and reports the XLA compiles during them
(goal: none) and the spread of step times (goal: every step within 3x of the median; since
random steps differ in work, also each step against a linear fit of time on its work).  A
step is ``plan`` + ``write_kv`` + ``attention`` of one layer, waited for.  For comparison the
first ``baseline`` of the same steps run on a backend without declared limits, where every
new power of two of any count compiles.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import kvabi
from kvabi.util.dtypes import numpy_dtype

from .compile_count import compiles


def random_steps(rng, n: int, limits, block_size: int, num_blocks: int):
    """``n`` metadata within ``limits``: each request a decode (half of them), a chunk of a
    prefill with context, or a fresh prefill; shuffled block ids."""
    width = -(-limits.max_seq_len // block_size)
    out = []
    for _ in range(n):
        r = int(rng.integers(1, limits.max_reqs + 1))
        share = max(1, limits.max_tokens // r)
        q = np.where(rng.random(r) < 0.5, 1, rng.integers(1, share + 1, r))
        q = np.minimum(q, limits.max_seq_len)
        c = np.where(rng.random(r) < 0.3, 0, rng.integers(0, limits.max_seq_len - q + 1))
        table = rng.permutation(num_blocks)[:r * width].reshape(r, width)
        out.append(kvabi.CommonAttentionMetadata.from_lengths(q, c, table, block_size,
                                                              num_blocks=num_blocks))
    return out


def _run(backend, spec, layout, steps, arrays, num_q_heads):
    """(seconds of each step, compiles during them)."""
    key, query = arrays
    cache = backend.allocate(layout)
    times = []
    before = compiles()[0]
    for meta in steps:
        t = meta.num_tokens
        t0 = time.perf_counter()
        plan = backend.plan(meta, spec, layout, num_q_heads=num_q_heads)
        cache = backend.write_kv(plan, cache, key=key[:t], value=key[:t])
        backend.attention(plan, cache, query=query[:t]).block_until_ready()
        times.append(time.perf_counter() - t0)
    return times, compiles()[0] - before


def steady_state(*, limits, spec, num_q_heads: int, steps: int, baseline: int, seed: int,
                 backend_name: str = "tpu.jax") -> dict:
    """Warm-up, then ``steps`` random steps; and ``baseline`` of them without limits."""
    proto = kvabi.get_backend(backend_name)
    width = -(-limits.max_seq_len // spec.block_size)
    num_blocks = limits.max_reqs * width
    layout = kvabi.Layout.preset("tpu.combined", spec, num_blocks)
    rng = np.random.default_rng(seed)
    todo = random_steps(rng, steps, limits, spec.block_size, num_blocks)
    dt = numpy_dtype(spec.dtype)
    arrays = (rng.standard_normal((limits.max_tokens, spec.num_kv_heads, spec.head_dim))
              .astype(dt),
              rng.standard_normal((limits.max_tokens, num_q_heads, spec.head_dim)).astype(dt))
    backend = type(proto)()
    c0, t0 = compiles()[0], time.perf_counter()

    def progress(done, total, what):
        print(f"\rkvabi bench tpu: warm-up {done}/{total} ({what})   ", end="",
              file=sys.stderr, flush=True)

    backend.warmup(spec, layout, limits, num_q_heads=num_q_heads, progress=progress)
    print(file=sys.stderr)
    warm_s, warm_n = time.perf_counter() - t0, compiles()[0] - c0
    times, n = _run(backend, spec, layout, todo, arrays, num_q_heads)
    med = statistics.median(times)
    fit = work_fit(todo, times)
    out = {"backend": backend_name, "limits": {"max_tokens": limits.max_tokens,
                                               "max_reqs": limits.max_reqs,
                                               "max_seq_len": limits.max_seq_len},
           "token_buckets": list(backend.step_buckets(spec, limits).token_buckets),
           "warmup_s": warm_s, "warmup_compiles": warm_n, "steps": len(times),
           "compiles_after_warmup": n, "median_ms": med * 1e3,
           "p90_ms": float(np.percentile(times, 90)) * 1e3, "max_ms": max(times) * 1e3,
           "max_over_median": max(times) / med,
           "steps_over_3x_median": sum(t > 3 * med for t in times),
           "max_over_work_fit": fit, "total_s": sum(times),
           "step_ms": [t * 1e3 for t in times]}
    if baseline:
        print("kvabi bench tpu: baseline without limits ...", file=sys.stderr, flush=True)
        base, bn = _run(type(proto)(), spec, layout, todo[:baseline], arrays, num_q_heads)
        out["baseline"] = {"steps": len(base), "compiles": bn, "total_s": sum(base),
                           "warm_total_s": sum(times[:len(base)])}
    return out


def work_fit(steps, times) -> float:
    """The largest ratio of a step's time to what its work predicts: a least-squares fit
    ``time = a + b * tokens + c * query-key pairs`` over the run.  Steps differ in work (a
    lone decode against 512 prefill tokens over long contexts), so their times differ
    without any cliff; a step far above its fit is a cliff (a compile, a slow path)."""
    pairs = np.array([float((m.query_lens.astype(np.float64) * m.seq_lens).sum())
                      for m in steps])
    tokens = np.array([float(m.num_tokens) for m in steps])
    x = np.stack([np.ones_like(pairs), tokens, pairs], axis=1)
    y = np.asarray(times)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = np.maximum(x @ coef, 1e-3 * y.min())
    return float((y / pred).max())


def report(r: dict) -> list[str]:
    """The text lines of :func:`steady_state`'s result."""
    lim = r["limits"]
    lines = [f"steady state ({r['backend']}; limits max_tokens={lim['max_tokens']}, "
             f"max_reqs={lim['max_reqs']}, max_seq_len={lim['max_seq_len']}; token buckets "
             f"{r['token_buckets']}):",
             f"  warm-up: {r['warmup_compiles']} compiles in {r['warmup_s']:.1f} s",
             f"  {r['steps']} random steps: median {r['median_ms']:.2f} ms, p90 "
             f"{r['p90_ms']:.2f} ms, slowest {r['max_ms']:.2f} ms",
             f"  goal: 0 compiles after warm-up; measured: {r['compiles_after_warmup']}",
             f"  goal: every step within 3x of the median; measured: slowest "
             f"{r['max_over_median']:.2f}x the median ({r['steps_over_3x_median']} steps "
             f"over 3x)",
             f"  steps differ in work: the slowest against what its work predicts (a linear "
             f"fit of time on tokens and query-key pairs over the run): "
             f"{r['max_over_work_fit']:.2f}x"]
    b = r.get("baseline")
    if b:
        lines.append(f"  without declared limits, the first {b['steps']} of these steps: "
                     f"{b['compiles']} compiles, {b['total_s']:.1f} s (after warm-up: "
                     f"{b['warm_total_s']:.2f} s)")
    return lines
