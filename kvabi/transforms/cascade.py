"""Cascade attention: a prefix shared by every request is attended once, then merged.

The shared prefix keys precede every query, so attention splits exactly into (a) every
query over the prefix keys, non-causally, and (b) every request over its own keys after the
prefix, causally; :func:`kvabi.merge_attention` combines the two by log-sum-exp.  Valid for
full attention only: a sliding window or attention chunk depends on the true query
position, which the prefix part does not keep; backends must refuse cascade otherwise.
"""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.errors import KVABIError
from ._common import assemble, check_int, check_meta, query_bounds


def cascade_split(meta: CommonAttentionMetadata, common_prefix_blocks: int
                  ) -> tuple[int, CommonAttentionMetadata | None, CommonAttentionMetadata]:
    """Split attention over ``meta`` into a shared-prefix part and a per-request suffix part.

    Every request with query tokens must have the same first ``common_prefix_blocks`` block
    ids.  ``prefix_len`` is ``common_prefix_blocks * block_size`` capped to the smallest
    context length of those requests (every query must follow all prefix keys) and rounded
    down to whole blocks.  Returns ``(prefix_len, prefix_meta, suffix_meta)``:

    - ``prefix_meta``: each real token of ``meta`` (in order; padding stays padding) as its
      own request with one query at position ``prefix_len - 1`` over the shared prefix blocks,
      so causal attention sees exactly the ``prefix_len`` prefix keys.  For attention only:
      its slot mapping points at the last prefix key; never write K/V with it.  ``None``
      when ``prefix_len`` is 0 (no cascade; use ``suffix_meta`` alone).
    - ``suffix_meta``: the requests of ``meta`` with ``prefix_len`` fewer context tokens,
      block tables shifted left by the prefix blocks and positions by ``prefix_len``; slots
      are unchanged, so K/V may be written with it.  Requests with no query tokens become
      empty (no context).

    ``merge_attention`` of the two parts' outputs equals full causal attention over ``meta``.
    """
    meta = check_meta(meta)
    bs = meta.block_size
    bt = meta.block_table
    cpb = check_int(common_prefix_blocks, "common_prefix_blocks", lo=0)
    if cpb > bt.shape[1]:
        raise KVABIError(f"common_prefix_blocks: exceeds the {bt.shape[1]} block table "
                         f"columns, got {cpb}")
    q, c, _, _ = query_bounds(meta)
    active = np.nonzero(q > 0)[0]
    if len(active) == 0:
        cpb = 0
    head = bt[active, :cpb]
    diff = np.nonzero((head != head[:1]).any(axis=1))[0]
    if len(diff):
        r = int(active[diff[0]])
        col = int(np.argmax(head[diff[0]] != head[0]))
        raise KVABIError(f"block_table: common_prefix_blocks={cpb} but request {r} has "
                         f"block {int(bt[r, col])} in column {col} where request "
                         f"{int(active[0])} has {int(head[0, col])}")
    prefix_len = 0 if cpb == 0 else min(cpb * bs, int(c[active].min())) // bs * bs
    pb = prefix_len // bs
    n, total = meta.num_tokens, meta.num_actual_tokens
    ctx2 = np.where(q > 0, c - prefix_len, 0)
    pos2 = meta.positions.copy()
    pos2[:total] -= prefix_len
    suffix = assemble(meta, q, ctx2, bt[:, pb:], pos2, meta.slot_mapping)
    if prefix_len == 0:
        return 0, None, suffix
    row = bt[active[0], :pb]
    last = int(row[-1]) * bs + bs - 1  # slot of the last prefix key
    real = np.arange(n) < total
    prefix = assemble(meta, np.ones(total, np.int64), np.full(total, prefix_len - 1),
                      np.repeat(row[None, :], total, axis=0),
                      np.where(real, prefix_len - 1, 0), np.where(real, last, -1))
    return prefix_len, prefix, suffix
