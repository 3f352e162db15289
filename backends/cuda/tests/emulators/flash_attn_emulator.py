"""An emulator of flash-attn 2's ``flash_attn_varlen_func`` with a paged KV cache, from its
documentation.

Documented semantics emulated here:

- q [total_q, Hq, D]; request b owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
- With ``block_table`` [batch, max_blocks], k/v are [num_blocks, page_block_size, Hk, D];
  request b's key j lives in block ``block_table[b, j // page_block_size]`` at row
  ``j % page_block_size``; its kv length is ``cu_seqlens_k[b+1] - cu_seqlens_k[b]``.
- ``max_seqlen_q`` / ``max_seqlen_k`` bound what the kernel visits: rows past
  max_seqlen_q are not computed (left zero here) and keys past max_seqlen_k not read.
- ``causal`` (default False) is bottom-right aligned: query i sees key j when
  ``j <= i + seqlen_k - seqlen_q``.  ``window_size=(left, right)``, -1 = unbounded:
  keys in ``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``.
- ``softcap`` > 0: cap * tanh(x / cap) on the scaled logits; ``softmax_scale`` defaults
  to 1/sqrt(headdim).  A row with no visible key outputs zero.
- ``return_attn_probs=True`` returns (out, softmax_lse [Hq, total_q] natural log, S_dmask).
"""
from __future__ import annotations

import math

import torch

from .attention_math import masked_attention

#: the emulator computes in float64 and has no page-size constraint of its own
kvabi_capabilities = {"dtypes": ("float32", "float16", "bfloat16"), "head_dims": None,
                      "block_size_multiple": 1}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert dropout_p == 0.0 and alibi_slopes is None
    assert block_table is not None, "this emulator covers the paged (block_table) form"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "last dimension must be contiguous"
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert block_table.dtype == torch.int32
    cq = cu_seqlens_q.cpu().to(torch.int64)
    ck = cu_seqlens_k.cpu().to(torch.int64)
    bt = block_table.cpu().to(torch.int64)
    assert len(cq) == len(ck) == bt.shape[0] + 1, "batch sizes disagree"
    assert q.shape[0] == int(cq[-1]), "q rows must equal cu_seqlens_q[-1]"
    pbs = k.shape[1]
    left, right = window_size
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
    for b in range(bt.shape[0]):
        lo, hi = int(cq[b]), int(cq[b + 1])
        sq, sk = hi - lo, int(ck[b + 1] - ck[b])
        rows = min(sq, int(max_seqlen_q))
        keys = min(sk, int(max_seqlen_k))
        assert -(-sk // pbs) <= bt.shape[1], f"block_table row {b} too short for seqlen_k {sk}"
        j = torch.arange(keys)
        blk = bt[b, j // pbs].to(k.device)
        kk, vv = k[blk, (j % pbs).to(k.device)], v[blk, (j % pbs).to(k.device)]
        i = torch.arange(rows)[:, None]
        jj = j[None, :]
        vis = torch.ones(rows, keys, dtype=torch.bool)
        diag = i + sk - sq
        if causal:
            vis &= jj <= diag
        if left >= 0:
            vis &= jj >= diag - left
        if right >= 0:
            vis &= jj <= diag + right
        o, l = masked_attention(q[lo:lo + rows].cpu(), kk.cpu(), vv.cpu(), vis, scale,
                                softcap if softcap > 0 else None)
        out[lo:lo + rows], lse[lo:lo + rows] = o, l
    out = out.to(q.dtype).to(q.device)
    if return_attn_probs:
        return out, lse.transpose(0, 1).float().to(q.device), None
    return out
