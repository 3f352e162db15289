"""Static shapes: pad a step's metadata to fixed token and request counts (CUDA graphs, XLA)."""
from __future__ import annotations

import numpy as np

from ..step.metadata import MAX_STEP_REQS, MAX_STEP_TOKENS, CommonAttentionMetadata
from ..util.errors import require
from ._common import assemble, check_int, check_meta, query_bounds


def pad(meta: CommonAttentionMetadata, num_tokens: int, num_reqs: int
        ) -> CommonAttentionMetadata:
    """Metadata with exactly ``num_tokens`` tokens and ``num_reqs`` requests.

    Padding tokens (after the real ones) get slot -1 and position 0; padding requests (after
    the real ones) have no query tokens, no context, and all-zero block table rows.  The
    block table keeps its width.  ``num_tokens`` may be below ``meta.num_tokens`` as long as
    it keeps every real token (existing padding may shrink).  At most
    :data:`~kvabi.step.metadata.MAX_STEP_TOKENS` tokens and ``MAX_STEP_REQS`` requests.
    """
    meta = check_meta(meta)
    total = meta.num_actual_tokens
    nt = check_int(num_tokens, "num_tokens", hi=MAX_STEP_TOKENS)
    nr = check_int(num_reqs, "num_reqs", hi=MAX_STEP_REQS)
    require(nt >= total, "num_tokens", f"must be >= the {total} real tokens", nt)
    require(nr >= meta.num_reqs, "num_reqs", f"must be >= the {meta.num_reqs} requests", nr)
    q, c, _, _ = query_bounds(meta)
    extra = nr - meta.num_reqs
    q2 = np.concatenate([q, np.zeros(extra, np.int64)])
    c2 = np.concatenate([c, np.zeros(extra, np.int64)])
    bt = meta.block_table
    bt2 = np.zeros((nr, bt.shape[1]), bt.dtype)
    bt2[:meta.num_reqs] = bt
    pos = np.zeros(nt, np.int64)
    pos[:total] = meta.positions[:total]
    slots = np.full(nt, -1, np.int64)
    slots[:total] = meta.slot_mapping[:total]
    return assemble(meta, q2, c2, bt2, pos, slots)
