"""Which value rows each query of a ``cpu.vllm`` step may see, and keeping the others out of
its output (``specs/semantics.md`` section 2: masking is per query, not per step).

vLLM's CPU kernels mask keys by select but multiply every value row of a block by its
probability, and ``0 * NaN`` is NaN: a NaN value row one query may not see would reach
it.  Rows no query of the step sees are zeroed in the value scratch (``hidden``).  Rows
some queries see and others do not (past one query's causal bound, before its window, in
a block two requests share) are *partial*: they must keep their value for the queries
that see them.  At each call their finiteness is checked (a few rows: the step's new
tokens and the window edges); a non-finite partial row is zeroed in the scratch, and the
outputs of the queries (and KV head groups) that do see it are set to NaN afterwards,
which is what the poison gives them.

Everything at plan time is vectorized over requests and block columns; the per-call
check is one ``isfinite`` over the partial rows; the rest runs only when one is not
finite.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch


def pair_visibility(meta, spec, req: np.ndarray, col: np.ndarray):
    """(some, every) bool [pairs, block_size]: per (request, block column) pair, the rows
    at least one query of the request sees, and those all its queries see (a request
    without queries sees none).  The visible keys of the query at p are
    ``first_visible_key(p) <= j <= p`` with both bounds growing with p, so the union over
    a request's queries is ``[lo(first), last]`` and the intersection ``[lo(last),
    first]``."""
    bs = spec.block_size
    ctx = meta.context_lens.astype(np.int64)
    last = meta.seq_lens.astype(np.int64) - 1
    has_q = np.diff(meta.query_start_loc.astype(np.int64)) > 0
    j = col[:, None] * bs + np.arange(bs)[None, :]
    lo_first = np.asarray(spec.first_visible_key(ctx), np.int64)[req][:, None]
    lo_last = np.asarray(spec.first_visible_key(np.maximum(last, 0)), np.int64)[req][:, None]
    q = has_q[req][:, None]
    some = q & (j >= lo_first) & (j <= last[req][:, None])
    every = q & (j >= lo_last) & (j <= ctx[req][:, None])
    return some, every


def merge_entries(some, every, inv: np.ndarray, num_entries: int):
    """Per distinct entry (pairs ``inv`` maps onto): seen by some query of any request
    reading it; seen by every query of every request reading it."""
    bs = some.shape[1]
    if len(inv) == num_entries:  # no entry read twice: a permutation (np.add.at is slow)
        s, e = np.empty_like(some), np.empty_like(every)
        s[inv], e[inv] = some, every
        return s, e
    # counts per (entry, row) in one flat bincount each
    cell = (inv[:, None] * bs + np.arange(bs)).reshape(-1)
    size = num_entries * bs
    n_some = np.bincount(cell, weights=some.reshape(-1), minlength=size).reshape(-1, bs)
    n_every = np.bincount(cell, weights=every.reshape(-1), minlength=size).reshape(-1, bs)
    readers = np.bincount(inv, minlength=num_entries)[:, None]
    return n_some > 0, n_every == readers


@dataclasses.dataclass(eq=False, frozen=True)
class PartialRows:
    """The value rows some queries of a step see and others do not: ``rows`` int64 [P, H]
    (rows of the value scratch viewed ``[rows, D]``), at (``entry``, ``token``) [P] of the
    scratch; ``pair_*`` [pairs] say which request reads which entry at which column."""

    rows: torch.Tensor
    entry: np.ndarray
    token: np.ndarray
    pair_req: np.ndarray
    pair_col: np.ndarray
    pair_entry: np.ndarray


def poisoned_queries(plan, partial: PartialRows, scratch_rows, hq: int):
    """None when every partial row is finite (the common case: one ``isfinite``).
    Otherwise the non-finite partial rows are zeroed in the scratch and the result is a
    bool [real tokens, hq] mask of the queries' heads that see one of them."""
    bad = ~torch.isfinite(scratch_rows[partial.rows.reshape(-1)]).all(dim=1)
    if not bool(bad.any()):
        return None
    scratch_rows.index_fill_(0, partial.rows.reshape(-1)[bad], 0)
    spec, meta = plan.spec, plan.meta
    h, bs = spec.num_kv_heads, spec.block_size
    bad = bad.reshape(-1, h).numpy()
    # bad[entry, token, head] over the scratch, then per (pair, token, head)
    grid = np.zeros((int(partial.entry.max()) + 1, bs, h), bool)
    p, kh = np.nonzero(bad)
    grid[partial.entry[p], partial.token[p], kh] = True
    take = partial.pair_entry < grid.shape[0]
    pr, tok, kh = np.nonzero(grid[partial.pair_entry[take]])
    r = partial.pair_req[take][pr]
    j = partial.pair_col[take][pr] * bs + tok
    # the queries of r at p = ctx + i that see j: j <= p, and (window W) p <= j + W - 1
    qsl = meta.query_start_loc.astype(np.int64)
    ctx = meta.context_lens.astype(np.int64)
    qn = qsl[r + 1] - qsl[r]
    i_lo = np.maximum(j - ctx[r], 0)
    i_hi = qn - 1
    if spec.kind == "sliding_window":
        i_hi = np.minimum(i_hi, j + spec.window - 1 - ctx[r])
    keep = i_lo <= i_hi
    n = plan.prepared.num_tokens  # real tokens
    diff = np.zeros((n + 1, h), np.int64)
    np.add.at(diff, (qsl[r][keep] + i_lo[keep], kh[keep]), 1)
    np.add.at(diff, (qsl[r][keep] + i_hi[keep] + 1, kh[keep]), -1)
    sees = np.cumsum(diff[:n], axis=0) > 0  # [tokens, kv heads]
    return np.repeat(sees, hq // h, axis=1)


__all__ = ["PartialRows", "merge_entries", "pair_visibility", "poisoned_queries"]
