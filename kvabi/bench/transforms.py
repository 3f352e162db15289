"""``kvabi bench transforms``: microseconds per metadata transform on mixed batches.

Each batch mixes decodes, chunked prefills (context > 0) and fresh prefills (seeded), with
shuffled block ids; the time of building the metadata itself (``from_lengths``) and of
checking it (``validate``) is shown beside the transforms, and so is the irreducible numpy
work of three jobs (:func:`baselines`), with the ratios.  Figures are medians of many
``time.perf_counter`` runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from .. import transforms as T
from ..step.metadata import CommonAttentionMetadata
from ..util.errors import KVABIError

DEFAULT_SIZES = ((256, 8192), (1024, 32768))
BLOCK_SIZE = 16
CHUNK = 2048            # local attention chunk (Llama 4 uses 8192; smaller splits more)
SHARED_PREFIX = 512     # tokens of a shared system prompt, for cascade_split


def mixed_lengths(num_reqs: int, num_tokens: int, seed: int = 0):
    """(query_lens, context_lens): about half decodes, a quarter chunked prefills, a quarter
    fresh prefills, query lengths summing to ``num_tokens``."""
    if num_tokens < num_reqs:
        raise KVABIError(f"sizes: need at least one token per request, got {num_reqs} "
                         f"requests and {num_tokens} tokens")
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=num_reqs, p=[0.5, 0.25, 0.25])  # 0 decode, 1 chunked, 2 fresh
    kind[0] = 2  # at least one prefill to take the remaining tokens
    pre = np.nonzero(kind > 0)[0]
    q = np.ones(num_reqs, np.int64)
    q[pre] += rng.multinomial(num_tokens - num_reqs, np.full(len(pre), 1.0 / len(pre)))
    c = np.where(kind == 2, 0, rng.integers(1, 4096, num_reqs))
    return q, c


def block_table(query_lens, context_lens, seed: int = 0, shared_blocks: int = 0):
    """A block table with shuffled distinct ids; the first ``shared_blocks`` columns are
    shared by all requests."""
    rng = np.random.default_rng(seed + 1)
    need = -(-(query_lens + context_lens) // BLOCK_SIZE)
    width = int(need.max())
    ids = rng.permutation(shared_blocks + len(need) * (width - shared_blocks))
    bt = np.empty((len(need), width), np.int32)
    bt[:, :shared_blocks] = ids[:shared_blocks]
    bt[:, shared_blocks:] = ids[shared_blocks:].reshape(len(need), width - shared_blocks)
    return bt, len(ids)


def median_us(fn, *, min_runs: int, min_seconds: float) -> float:
    """Median wall time of ``fn()`` in microseconds over at least ``min_runs`` runs."""
    fn()  # warm up
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def baselines(meta: CommonAttentionMetadata, query_lens, context_lens, chunk: int) -> dict:
    """{name: callable}: the irreducible numpy work of three jobs on the same batch, to
    read the transforms' times against (kvabi's code must do at least this much).

    - from_lengths: one ``np.cumsum`` of the query lengths and the slot-mapping gather
      (each token's block id from the table, times block size, plus the offset);
    - prefill_skip: gathering the kept tokens' positions and slots;
    - local_virtual_batches: gathering the virtual block table rows and shifting the
      positions, with every index precomputed.
    """
    bt, bs = meta.block_table, meta.block_size
    q = np.asarray(query_lens, np.int64)
    c = np.asarray(context_lens, np.int64)
    rows = np.repeat(np.arange(len(q), dtype=np.int64) * bt.shape[1], q)

    def cumsum_gather():
        qsl = np.cumsum(q)
        pos = np.arange(int(qsl[-1])) + np.repeat(c - (qsl - q), q)
        return bt.ravel()[rows + pos // bs] * bs + pos % bs

    last = meta.query_start_loc[1:].astype(np.int64) - 1

    def gather_kept():
        return meta.positions[last], meta.slot_mapping[last]

    from ..transforms import local_virtual_batches

    m2, vreq = local_virtual_batches(meta, chunk)
    width = m2.block_table.shape[1]
    first = np.asarray([0], np.int64)  # any in-range window start: the gather is the work
    starts = np.minimum(vreq * bt.shape[1], bt.size - width) if bt.size >= width else first
    windows = np.lib.stride_tricks.sliding_window_view(bt.ravel(), width)
    shift = meta.positions - m2.positions

    def gather_virtual():
        return windows[starts], meta.positions - shift

    return {"baseline: cumsum + slot gather": cumsum_gather,
            "baseline: gather kept rows": gather_kept,
            "baseline: gather virtual table": gather_virtual}


#: (transform row, baseline row) pairs whose time ratio the suite prints
RATIOS = (("from_lengths (build)", "baseline: cumsum + slot gather"),
          ("prefill_skip", "baseline: gather kept rows"),
          (f"local_virtual_batches(chunk={CHUNK})", "baseline: gather virtual table"))


def cases(num_reqs: int, num_tokens: int, seed: int) -> dict:
    """{name: zero-argument callable} for one batch size."""
    q, c = mixed_lengths(num_reqs, num_tokens, seed)
    bt, nb = block_table(q, c, seed)

    def build():
        return CommonAttentionMetadata.from_lengths(q, c, bt, BLOCK_SIZE, num_blocks=nb)

    meta = build()
    perm = T.reorder_decode_first(meta)
    sorted_meta, _ = T.permute_requests(meta, perm)
    sp_blocks = SHARED_PREFIX // BLOCK_SIZE
    cbt, cnb = block_table(q, c + SHARED_PREFIX, seed, shared_blocks=sp_blocks)
    cmeta = CommonAttentionMetadata.from_lengths(q, c + SHARED_PREFIX, cbt, BLOCK_SIZE,
                                                 num_blocks=cnb)
    pad_tokens = -(-num_tokens // 512) * 512 + 512
    return {
        "from_lengths (build)": build,
        "validate": meta.validate,
        "prefill_skip": lambda: T.prefill_skip(meta),
        f"local_virtual_batches(chunk={CHUNK})": lambda: T.local_virtual_batches(meta, CHUNK),
        "reorder_decode_first": lambda: T.reorder_decode_first(meta),
        "permute_requests": lambda: T.permute_requests(meta, perm),
        "split_decode_prefill": lambda: T.split_decode_prefill(sorted_meta),
        "split_ubatches(2)": lambda: T.split_ubatches(meta, [num_tokens // 2]),
        f"cascade_split({sp_blocks} blocks)": lambda: T.cascade_split(cmeta, sp_blocks),
        "pad": lambda: T.pad(meta, pad_tokens, num_reqs + 32),
        "kv_update_slices": lambda: T.kv_update_slices(meta, 8),
        **baselines(meta, q, c, CHUNK),
    }


def _sizes(text: str):
    try:
        return tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))
    except ValueError:
        raise KVABIError(f"--sizes: expected REQSxTOKENS[,REQSxTOKENS...], got {text!r}")


def run(argv=None) -> int:
    """Entry point of ``kvabi bench transforms [--json] [--quick] [--sizes 256x8192,...]``."""
    p = argparse.ArgumentParser(prog="kvabi bench transforms", description=__doc__.split(
        "\n")[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quick", action="store_true", help="few runs (smoke test, noisy)")
    p.add_argument("--sizes", type=_sizes, default=DEFAULT_SIZES,
                   help="comma-separated REQSxTOKENS batches (default 256x8192,1024x32768)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    runs, secs = (3, 0.0) if a.quick else (50, 0.5)
    results = []
    for nr, nt in a.sizes:
        timed = {name: median_us(fn, min_runs=runs, min_seconds=secs)
                 for name, fn in cases(nr, nt, a.seed).items()}
        ratios = {f"{a} / {b}": timed[a] / timed[b] for a, b in RATIOS}
        results.append({"num_reqs": nr, "num_tokens": nt, "us": timed, "ratios": ratios})
    if a.json:
        print(json.dumps({"suite": "transforms", "unit": "us", "statistic": "median",
                          "block_size": BLOCK_SIZE, "results": results}, indent=2))
        return 0
    names = list(results[0]["us"]) if results else []
    heads = [f"{r['num_reqs']} req / {r['num_tokens']} tok" for r in results]
    w = max(map(len, names), default=10)
    print(f"{'transform (median us)':<{w}}  " + "  ".join(f"{h:>22}" for h in heads))
    for n in names:
        print(f"{n:<{w}}  " + "  ".join(f"{r['us'][n]:>22.1f}" for r in results))
    for n in (results[0]["ratios"] if results else ()):
        print(f"ratio {n}: " + ", ".join(f"{r['ratios'][n]:.2f}x" for r in results))
    print("goal: from_lengths at most 3x the cumsum + slot gather baseline")
    return 0
