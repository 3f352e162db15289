"""Prefill skip for layers that share another layer's KV cache.

A KV-sharing layer reads a cache its target layer already wrote, so only the tokens whose
outputs are consumed need to run through it: by default the last query token of every
request (the one that samples), or the last k tokens of a request for speculative decoding.
"""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.errors import KVABIError, require
from ._common import assemble, check_meta, int_array, query_bounds


def prefill_skip(meta: CommonAttentionMetadata, keep=None
                 ) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Metadata whose queries are only the kept tokens, and their indices into ``meta``.

    ``keep`` (default: the last query token of each request with query tokens) holds sorted
    unique indices into the real tokens; per request the kept tokens must be a contiguous
    run ending at its last query token.  A request keeping k tokens becomes one with
    ``context_len = seq_len - k`` and the same ``seq_len`` and block table row, so every kept
    token keeps its position and slot.  Padding tokens are dropped (re-pad with
    :func:`pad`).  Returns ``(meta2, token_index)``: ``hidden[token_index]`` gathers the
    inputs of the kept tokens, and the outputs over ``meta2`` equal the full computation's
    outputs at ``token_index``.
    """
    meta = check_meta(meta)
    q, c, s, qsl = query_bounds(meta)
    total = int(qsl[-1])
    if keep is None:
        idx = (qsl[1:] - 1)[q > 0]
        k = (q > 0).astype(np.int64)
    else:
        idx = int_array(keep, "keep")
        if idx.size:
            bad = np.nonzero((idx < 0) | (idx >= total))[0]
            require(len(bad) == 0, "keep", f"token indices must be in [0, {total})",
                    idx[bad[:3]].tolist())
            dec = np.nonzero(np.diff(idx) <= 0)[0]
            require(len(dec) == 0, "keep", "must be sorted and unique, not at entries",
                    [int(dec[0]), int(dec[0]) + 1] if len(dec) else None)
        req = np.searchsorted(qsl, idx, side="right") - 1
        k = np.bincount(req, minlength=len(q)).astype(np.int64)
        # k distinct tokens of a request all >= end - k are exactly its last k tokens.
        bad = np.nonzero(idx < qsl[1:][req] - k[req])[0]
        if len(bad):
            t = int(idx[bad[0]])
            r = int(req[bad[0]])
            raise KVABIError(f"keep: the kept tokens of request {r} must be a contiguous run "
                             f"ending at its last query token {int(qsl[r + 1]) - 1}, but "
                             f"token {t} is kept with only {int(k[r])} kept in total")
    pos = meta.positions[idx]
    slots = meta.slot_mapping[idx]
    meta2 = assemble(meta, k, s - k, meta.block_table, pos, slots)
    return meta2, idx.astype(np.int64)
