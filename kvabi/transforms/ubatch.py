"""Micro-batches: split one step at token boundaries (dual-batch overlap, chunked steps)."""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.errors import require
from ._common import assemble, check_meta, int_array, query_bounds


def split_ubatches(meta: CommonAttentionMetadata, token_boundaries
                   ) -> list[CommonAttentionMetadata]:
    """Split ``meta`` at the token indices ``token_boundaries`` into micro-batches.

    ``token_boundaries`` are strictly increasing cut points in ``(0, num_tokens)``; a leading
    0 and a trailing ``num_tokens`` may be included and are implied otherwise.  Micro-batch u
    holds tokens ``[edges[u], edges[u+1])`` (padding tokens stay padding) and every request
    with query tokens there; a request cut in two continues in the next micro-batch with its
    context grown by the tokens of the earlier part and the same block table row.  A request
    with no query tokens goes to the micro-batch holding its ``query_start_loc`` (the last one
    if that is ``num_tokens``).  Running the micro-batches one after the other and
    concatenating their outputs equals running ``meta``.
    """
    meta = check_meta(meta)
    n = meta.num_tokens
    cuts = int_array(token_boundaries, "token_boundaries")
    if len(cuts) and cuts[0] == 0:
        cuts = cuts[1:]
    if len(cuts) and cuts[-1] == n:
        cuts = cuts[:-1]
    bad = (cuts <= 0) | (cuts >= n)
    require(not bad.any(), "token_boundaries", f"cut points must be in (0, {n})",
            cuts[bad][:3].tolist())
    require(bool((np.diff(cuts) > 0).all()), "token_boundaries", "must be strictly increasing",
            cuts.tolist()[:8])
    edges = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    q, c, _, qsl = query_bounds(meta)
    first, last = qsl[:-1], qsl[1:]
    out = []
    for u in range(len(edges) - 1):  # a loop over a handful of micro-batches
        a, b = int(edges[u]), int(edges[u + 1])
        final = u == len(edges) - 2
        starts_before_end = (first < b) | (final & (first <= b))
        ends_after_start = (last > a) | ((q == 0) & (first >= a))
        sel = np.nonzero(starts_before_end & ends_after_start)[0]
        lo = np.maximum(first[sel], a)
        hi = np.minimum(last[sel], b)
        out.append(assemble(meta, hi - lo, c[sel] + (lo - first[sel]), meta.block_table[sel],
                            meta.positions[a:b], meta.slot_mapping[a:b]))
    return out
