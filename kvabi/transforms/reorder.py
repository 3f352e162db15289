"""Request reordering: decodes first, as FlashInfer/flash-attn/MLA backends split the batch."""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.errors import KVABIError, require
from ._common import assemble, check_int, check_meta, expand, int_array, query_bounds


def _is_decode(meta, decode_threshold) -> np.ndarray:
    t = check_int(decode_threshold, "decode_threshold", lo=0)
    return np.diff(meta.query_start_loc) <= t


def reorder_decode_first(meta: CommonAttentionMetadata, decode_threshold: int = 1
                         ) -> np.ndarray:
    """Stable permutation of requests putting those with ``query_len <= decode_threshold``
    first (requests with no query tokens count as decodes).  Apply with
    :func:`permute_requests`."""
    meta = check_meta(meta)
    return np.argsort(~_is_decode(meta, decode_threshold), kind="stable").astype(np.int64)


def split_decode_prefill(meta: CommonAttentionMetadata, decode_threshold: int = 1
                         ) -> tuple[int, int, int, int]:
    """``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` of a batch in
    decode-first order (padding tokens not counted); KVABIError if a decode follows a
    prefill."""
    meta = check_meta(meta)
    dec = _is_decode(meta, decode_threshold)
    nd = int(dec.sum())
    if not dec[:nd].all():
        r = int(np.argmin(dec[:nd]))
        raise KVABIError(f"meta: requests must be in decode-first order (see "
                         f"reorder_decode_first), but request {r} with query_len "
                         f"{int(meta.query_lens[r])} precedes a decode")
    ndt = int(meta.query_start_loc[nd])
    return nd, meta.num_reqs - nd, ndt, meta.num_actual_tokens - ndt


def permute_requests(meta: CommonAttentionMetadata, perm
                     ) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Reorder requests: new request i is old request ``perm[i]``.

    Returns ``(meta2, token_perm)`` where ``x[token_perm]`` gathers any per-token array of
    ``meta`` (hidden states, outputs) into ``meta2``'s order; padding tokens stay last.
    """
    meta = check_meta(meta)
    p = int_array(perm, "perm")
    n = meta.num_reqs
    require(p.shape == (n,), "perm", f"must have one entry per request ({n})", p.shape)
    if n:
        bad = (p < 0) | (p >= n)
        require(not bad.any(), "perm", f"entries must be in [0, {n})", p[bad][:3].tolist())
        seen = np.bincount(p, minlength=n)
        require(bool((seen == 1).all()), "perm", "must be a permutation; repeated entries",
                np.nonzero(seen > 1)[0][:3].tolist())
    q, c, _, qsl = query_bounds(meta)
    q2 = q[p]
    owner, i = expand(q2)
    token_perm = np.concatenate([qsl[p][owner] + i,
                                 np.arange(meta.num_actual_tokens, meta.num_tokens)])
    meta2 = assemble(meta, q2, c[p], meta.block_table[p], meta.positions[token_perm],
                     meta.slot_mapping[token_perm])
    return meta2, token_perm.astype(np.int64)
