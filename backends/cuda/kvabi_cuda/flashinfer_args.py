"""kvabi metadata -> FlashInfer's paged API arguments.  Pure: numpy in, dict out.

FlashInfer's conventions differ from kvabi's in ways that are easy to get silently wrong,
so each is converted here and nowhere else:

- pages as CSR: ``paged_kv_indptr`` / ``paged_kv_indices`` / ``paged_kv_last_page_len``
  (1..page_size entries in the last page; kv length = (pages - 1) * page_size + last);
- ``causal`` defaults to False in FlashInfer: we always pass True (bottom-right aligned);
- ``window_left`` counts the keys left of the query: W - 1 (kvabi's W includes the query);
- ``logits_soft_cap`` (None when off), ``sm_scale`` (resolved, never left to a default);
- ``sinks`` (float32, one logit per query head) go to ``run``;
- returned lse is base 2: multiply by ln 2 for kvabi's natural log.

Chunked local attention has no FlashInfer mask: it runs as causal attention over kvabi's
local virtual batches.  Cache writes use ``append_paged_kv_cache`` with the original
(absolute) positions.
"""
from __future__ import annotations

import math

import numpy as np

from .chunked_local import attention_meta
from .paged_csr import pages_csr

#: FlashInfer returns log2-sum-exp2; kvabi's lse is natural
LSE_TO_NATURAL = math.log(2.0)


def flashinfer_args(meta, spec, kv_layout: str, *, num_qo_heads: int, scale: float,
                    softcap: float | None = None, sinks=None) -> dict:
    """Arguments for one step: which wrapper, its ``plan`` and ``run`` keyword arguments,
    and ``append_paged_kv_cache``'s.

    ``scale`` is already resolved (kvabi's default 1/sqrt(head_dim) applied by the caller).
    The decode wrapper serves steps where every request has exactly one query token and no
    sinks; everything else goes to the prefill wrapper.
    """
    am = attention_meta(meta, spec, "cuda.flashinfer")
    indptr, indices, last = pages_csr(am.seq_lens, am.block_table, spec.block_size)
    window_left = spec.window - 1 if spec.kind == "sliding_window" else -1
    cap = None if softcap is None else float(softcap)
    qlen = am.query_lens
    decode = am.num_reqs > 0 and bool((qlen == 1).all()) and sinks is None
    common = dict(num_qo_heads=int(num_qo_heads), num_kv_heads=spec.num_kv_heads,
                  page_size=spec.block_size, sm_scale=float(scale),
                  window_left=int(window_left), logits_soft_cap=cap)
    if decode:
        plan = dict(indptr=indptr, indices=indices, last_page_len=last,
                    head_dim=spec.head_dim, **common)
    else:
        plan = dict(qo_indptr=am.query_start_loc.astype(np.int32), paged_kv_indptr=indptr,
                    paged_kv_indices=indices, paged_kv_last_page_len=last,
                    head_dim_qk=spec.head_dim, head_dim_vo=spec.head_dim_v, causal=True,
                    **common)
    run = {"return_lse": True}
    if sinks is not None:
        run["sinks"] = np.asarray(sinks, dtype=np.float32)
    return {
        "wrapper": "decode" if decode else "prefill",
        "kv_layout": kv_layout,
        "plan": plan,
        "run": run,
        "append": append_args(meta, spec, kv_layout),
        "num_actual_tokens": meta.num_actual_tokens,
        "lse_scale": LSE_TO_NATURAL,
    }


def append_args(meta, spec, kv_layout: str) -> dict:
    """``append_paged_kv_cache`` arguments for the step's real tokens (padding excluded):
    each token's request and absolute position, and the pages after the append."""
    indptr, indices, last = pages_csr(meta.seq_lens, meta.block_table, spec.block_size)
    a = meta.num_actual_tokens
    return dict(batch_indices=meta.token_request.astype(np.int32),
                positions=meta.positions[:a].astype(np.int32),
                kv_indices=indices, kv_indptr=indptr, kv_last_page_len=last,
                kv_layout=kv_layout)


def paged_kv_tensors(k_view, v_view, kv_layout: str):
    """The (k_cache, v_cache) pair FlashInfer reads, from kvabi's [B, N, H, D] views:
    unchanged for NHD, heads before tokens for HND (a view either way, numpy or torch)."""
    if kv_layout == "NHD":
        return k_view, v_view

    def hnd(x):
        return x.permute(0, 2, 1, 3) if hasattr(x, "permute") else x.transpose(0, 2, 1, 3)

    return hnd(k_view), hnd(v_view)
