"""``example.torch``: paged attention over a kvabi cache in plain, vectorized torch (CPU).

A backend writes three methods; :class:`kvabi.Backend` calls them after it has checked
every argument (the step against the layout, the capabilities, the options, the plan, the
cache handle, the shapes and dtypes), so none of them checks anything:

- ``prepare(plan)`` once per step and KV group: everything that does not depend on the
  layer (returned, it becomes ``plan.prepared``);
- ``write(plan, cache, key, value, layer, scales=None)`` scatters the step's new keys and
  values to their slots, in place;
- ``attend(plan, cache, query, layer, sinks, out, return_lse, scales=None)`` gathers each
  request's visible blocks through the block table (``rows``: what a quantized subclass
  dequantizes) and computes a masked softmax.

``scales`` is a per_tensor cache's ``(k_scale, v_scale)``: kvabi passes it only to a
backend that claims ``per_tensor`` (this one does not; ``quantized.py`` does).

``cache.kv_view(layer, kv)`` is a cached strided [blocks, block_size, heads, head_dim] view
of the checked :class:`kvabi.KVCache` that works for any layout.

Attention gathers, per request, the blocks its queries see (a sliding window: only the
last few) and runs torch's fused ``scaled_dot_product_attention`` over the padded batch
[requests, longest query, keys]; soft cap, sinks and ``return_lse`` take a plain einsum path
over the same gather.  No Python loop per token or request.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

import kvabi

KINDS = ("full", "sliding_window")
DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True, eq=False)
class TorchPlan:
    """What ``attend`` and ``write`` need for one step, for any layer.

    Attention runs on a request-major padded batch: request r's query tokens are
    ``q_index[r, :q_r]`` (``q_valid`` marks them) and its keys are the blocks
    ``key_blocks[r]`` of the table: only the blocks some query of r sees are gathered (a
    sliding window needs the last few).  ``key_invalid``: the flat indices into the gathered [R * K] keys
    that are not r's (past its end, or before any of its queries' windows), zeroed after
    the gather (a few per request, not a pass over all keys);
    ``mask`` [R, Qmax, K]: which keys each query sees (padding query rows see every key, so
    no softmax row is empty).  ``write_blocks`` / ``write_offsets`` / ``write_tokens``: the
    slots of the step's tokens that are written (padding tokens, slot -1, are not).
    """

    q_index: torch.Tensor
    q_valid: torch.Tensor
    rows: torch.Tensor
    key_blocks: torch.Tensor
    key_invalid: torch.Tensor
    mask: torch.Tensor
    write_tokens: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor


class TorchSDPABackend(kvabi.Backend):
    """Full and sliding-window attention, GQA, soft cap and sinks; float32 and float16."""

    name = "example.torch"
    framework = "torch"

    def available(self):
        return True, f"torch {torch.__version__} on cpu"

    def capabilities(self, spec=None):
        # ``layouts``: the presets this backend can address for ``spec`` (informational);
        # ``preferred_layouts`` is what an engine should allocate and the kit draws.
        return kvabi.Capabilities(kinds=KINDS, dtypes=DTYPES, softcap=True, sinks=True,
                                  layouts=self.preferred_layouts(spec) if spec else (),
                                  notes="plain torch on CPU; any layout via strided views")

    def preferred_layouts(self, spec):
        return ("flash_attn", "flashinfer.HND")

    def device(self):
        return torch.device("cpu")

    # -- once per step --------------------------------------------------------------
    def prepare(self, plan):
        meta, spec = plan.meta, plan.spec
        bs = spec.block_size
        qsl = meta.query_start_loc.astype(np.int64)
        n = int(qsl[-1])  # tokens past this are padding
        r = meta.num_reqs
        qlen = np.diff(qsl)
        seq = meta.seq_lens.astype(np.int64)[:r]
        qmax = int(qlen.max(initial=0))
        # Query tokens of each request, padded to the longest query: [R, Qmax].
        i = np.arange(qmax, dtype=np.int64)[None, :]
        q_valid = i < qlen[:, None]
        q_index = np.where(q_valid, qsl[:-1, None] + i, 0)
        pos = np.where(q_valid, meta.positions[np.minimum(q_index, max(n - 1, 0))]
                       .astype(np.int64), 0) if n else np.zeros_like(q_index)
        # Keys: from the block of the lowest key any of r's queries sees to r's end.
        first = spec.first_visible_key(seq - qlen)  # the earliest query sees the most
        b0 = first // bs
        nblk = -(-seq // bs) - b0
        width = int(nblk.max(initial=0))
        col = b0[:, None] + np.arange(width, dtype=np.int64)[None, :]
        table = meta.block_table.astype(np.int64)
        used = col < -(-seq // bs)[:, None]
        col = np.minimum(col, max(table.shape[1] - 1, 0))
        blocks = np.where(used, np.take_along_axis(table, col, 1), 0) if table.size \
            else np.zeros(col.shape, np.int64)
        j = b0[:, None] * bs + np.arange(width * bs, dtype=np.int64)[None, :]  # [R, K]
        key_valid = (j >= first[:, None]) & (j < seq[:, None])
        lo = spec.first_visible_key(pos)
        mask = key_valid[:, None, :] & (j[:, None, :] <= pos[:, :, None]) & \
            (j[:, None, :] >= lo[:, :, None])
        mask |= ~q_valid[:, :, None]
        slots = meta.slot_mapping
        written = np.nonzero(slots >= 0)[0]
        t = torch.from_numpy
        return TorchPlan(t(q_index), t(q_valid), t(q_index[q_valid]), t(blocks),
                         t(np.flatnonzero(~key_valid)), t(mask), t(written),
                         t(slots[written] // bs), t(slots[written] % bs))

    # -- per layer --------------------------------------------------------------------
    def write(self, plan, cache, key, value, layer, scales=None):
        # ``scales``: a per_tensor cache's (k_scale, v_scale); kvabi passes them only to a
        # backend that claims per_tensor (this one does not, ``quantized.py`` does)
        spec, p = plan.spec, plan.prepared
        tok, blk, off = p.write_tokens, p.write_blocks, p.write_offsets
        kview = cache.kv_view(layer, 0)[..., :spec.head_dim]
        vview = cache.kv_view(layer, 1)[..., :spec.head_dim_v]
        kview[blk, off] = key[tok].to(kview.dtype)  # index_put_ writes through the view
        vview[blk, off] = value[tok].to(vview.dtype)
        return cache

    def rows(self, plan, cache, layer, kv, blocks, dim, scales):
        """float32 [blocks, N, H, dim] of the keys (``kv`` 0) or values of ``blocks``: the
        values the cache stands for (a quantized backend dequantizes here)."""
        return cache.kv_view(layer, kv).index_select(0, blocks)[..., :dim].float()

    def attend(self, plan, cache, query, layer, sinks, out, return_lse, scales=None):
        spec, w, hq = plan.spec, plan.prepared, plan.num_q_heads
        h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        g = hq // h
        sink = sinks  # this call's (learned per layer in some models), else the plan's

        r, width = w.key_blocks.shape
        bs = spec.block_size

        def keys(kv, dim):
            # [R, blocks, N, H, D] -> [R, K, H, D]: one gather per request's blocks
            x = self.rows(plan, cache, layer, kv, w.key_blocks.reshape(-1), dim, scales)
            x = x.reshape(r * width * bs, h, dim)
            # Zero, never multiply: rows outside the request can hold anything, NaN too.
            return x.index_fill_(0, w.key_invalid, 0.0).reshape(r, width * bs, h, dim)

        k, v = keys(0, d), keys(1, dv)
        # A value row some queries of the request see and others do not stays in v, and
        # a masked probability (0) times NaN is NaN: non-finite value rows are zeroed,
        # and the queries that do see one get NaN afterwards (what the poison gives them).
        bad = ~torch.isfinite(v).all(dim=-1)  # [R, K, H]
        poisoned = None
        if bool(bad.any()):
            v = v.masked_fill(bad[..., None], 0.0)
            poisoned = torch.einsum("rqk,rkh->rqh", w.mask.float(), bad.float()) > 0
        q = query[w.q_index].float()  # [R, Qmax, Hq, D]
        qmax = q.shape[1]
        if w.rows.numel() == 0:  # no real query token (every row is padding)
            o = q.new_zeros((r, qmax, hq, dv))
            lse = q.new_zeros((r, qmax, hq))
        elif plan.softcap is None and sink is None and not return_lse:
            # torch's fused kernel; GQA by head groups as kvabi's semantics state
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=w.mask[:, None], scale=plan.scale,
                enable_gqa=g > 1).transpose(1, 2)  # [R, Qmax, Hq, Dv]
        else:
            qg = q.reshape(r, qmax, h, g, d)
            logits = torch.einsum("rqhgd,rkhd->rhgqk", qg, k) * plan.scale
            if plan.softcap is not None:
                logits = plan.softcap * torch.tanh(logits / plan.softcap)
            logits = torch.where(w.mask[:, None, None], logits, float("-inf"))
            if sink is not None:  # one extra logit per head in the denominator only
                s = torch.tensor(sink, dtype=torch.float32).reshape(1, h, g, 1, 1)
                logits = torch.cat([logits, s.expand(*logits.shape[:-1], 1)], dim=-1)
            top = logits.amax(dim=-1, keepdim=True)
            p = torch.exp(logits - top)
            denom = p.sum(dim=-1)
            o = torch.einsum("rhgqk,rkhd->rqhgd", p[..., :k.shape[1]], v) / \
                denom.permute(0, 3, 1, 2)[..., None]
            lse = (top[..., 0] + torch.log(denom)).permute(0, 3, 1, 2).reshape(r, qmax, hq)
        o = o.reshape(r, qmax, hq, dv)
        if poisoned is not None:  # [R, Qmax, H] -> the query heads of each KV head
            o = o.masked_fill(poisoned.repeat_interleave(g, dim=2)[..., None], float("nan"))
        o = o[w.q_valid]

        result = out if out is not None else \
            torch.zeros((plan.num_tokens, hq, dv), dtype=query.dtype)
        result[w.rows] = o.reshape(-1, hq, dv).to(query.dtype)  # the query's dtype
        if not return_lse:
            return result, None
        full = torch.zeros((plan.num_tokens, hq), dtype=torch.float32)
        full[w.rows] = lse[w.q_valid].float()
        return result, full

