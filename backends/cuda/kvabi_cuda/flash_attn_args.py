"""kvabi metadata -> flash-attn's varlen paged interface arguments.  Pure: numpy in, dict out.

flash-attn's conventions, converted here and nowhere else:

- ``block_table`` [R, pages] (int32) with K/V as [num_blocks, page_block_size, H, D];
- ``cu_seqlens_q`` (the query offsets) and the key lengths, both as ``cu_seqlens_k``
  (cumulative; flash-attn 2 with a block table) and ``seqused_k`` (per request; the
  interfaces that take it), ``max_seqlen_q`` / ``max_seqlen_k``;
- ``causal=True`` (flash-attn defaults to False; its mask is bottom-right aligned);
- ``window_size=(W - 1, 0)``: flash-attn's left window counts keys left of the query,
  kvabi's W includes the query; (-1, -1) when there is no window;
- ``softcap`` 0.0 when off; ``softmax_scale`` resolved;
- lse comes back [Hq, total_q], natural log.

Chunked local attention has no flash-attn 2 mask: it runs as causal attention over kvabi's
local virtual batches.
"""
from __future__ import annotations

import numpy as np

from .chunked_local import attention_meta
from .index_width import library_int32


def flash_attn_args(meta, spec, *, scale: float, softcap: float | None = None) -> dict:
    """Arguments for ``flash_attn_varlen_func`` over the step's real tokens."""
    am = attention_meta(meta, spec, "cuda.flash_attn")
    seq = am.seq_lens.astype(np.int64)
    cu_k = np.zeros(len(seq) + 1, np.int64)
    np.cumsum(seq, out=cu_k[1:])
    need = max(1, -(-am.max_seq_len // spec.block_size))
    bt = np.zeros((am.num_reqs, need), np.int64)
    cols = min(need, am.block_table.shape[1])
    bt[:, :cols] = am.block_table[:, :cols]
    used = np.arange(need)[None, :] < -(-seq[:, None] // spec.block_size)
    bt = np.where(used, bt, 0)  # entries past a request's pages are never read
    window = (spec.window - 1, 0) if spec.kind == "sliding_window" else (-1, -1)
    return {
        "cu_seqlens_q": am.query_start_loc.astype(np.int32),
        "cu_seqlens_k": library_int32(cu_k, "cu_seqlens_k", "cuda.flash_attn"),
        "seqused_k": seq.astype(np.int32),
        "max_seqlen_q": int(am.max_query_len),
        "max_seqlen_k": int(am.max_seq_len),
        "block_table": library_int32(bt, "block_table", "cuda.flash_attn", ndim=2),
        "softmax_scale": float(scale),
        "causal": True,
        "window_size": window,
        "softcap": 0.0 if softcap is None else float(softcap),
        "num_actual_tokens": meta.num_actual_tokens,
    }
