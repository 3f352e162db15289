"""Dense masked softmax attention in float64: the arithmetic both emulators share."""
from __future__ import annotations

import torch


def masked_attention(q, k, v, visible, scale, softcap=None, sink=None):
    """q [M, Hq, D], k/v [S, Hkv, D*], visible [M, S] bool -> (out [M, Hq, Dv], lse [M, Hq]).

    Query head h reads KV head h // (Hq / Hkv).  Soft cap: cap * tanh(scaled / cap).
    ``sink`` [Hq] adds exp(sink) to each row's denominator only.  Empty rows: out 0,
    lse -inf.
    """
    hq, hk = q.shape[1], k.shape[1]
    assert hq % hk == 0, f"num_qo_heads {hq} is not a multiple of num_kv_heads {hk}"
    rep = hq // hk
    k = k.double().repeat_interleave(rep, dim=1)  # [S, Hq, D]
    v = v.double().repeat_interleave(rep, dim=1)
    s = torch.einsum("mhd,shd->hms", q.double(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible[None], float("-inf"))
    if sink is not None:
        col = sink.double()[:, None, None].expand(hq, s.shape[1], 1)
        s = torch.cat([s, col], dim=2)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
    lse = torch.logsumexp(s, dim=2)  # [Hq, M]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, 0.0)
    out = torch.einsum("hms,shd->mhd", p, v)
    return out, lse.transpose(0, 1)
