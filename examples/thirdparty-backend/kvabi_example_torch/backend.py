"""``example.torch``: paged attention over a kvabi cache in plain, vectorized torch (CPU).

The ABI 1.1 methods of a backend, in the order an engine calls them:

- ``plan(meta, spec, layout, ...)`` once per step and KV group: refuse what is not claimed
  (``check_supported``), check that metadata, spec and layout belong together
  (``kvabi.check_step``), resolve the options (``kvabi.AttentionOptions.resolve``), and
  precompute everything that does not depend on the layer.  A plan keeps no layer state:
  one plan serves every layer of its group, in any order.
- ``write_kv(cache, layout, key, value, plan, layer=)`` scatters the step's new keys and
  values to their slots, in place.
- ``attention(query, cache, layout, plan, layer=, sinks=, out=, return_lse=)`` gathers each
  request's visible blocks through the block table and computes a masked softmax.

Every method first turns ``cache`` into a checked :class:`kvabi.KVCache`
(``kvabi.as_cache``): the planes then match the layout, and ``cache.kv_view(layer, kv)``
is a cached strided [blocks, block_size, heads, head_dim] view that works for any layout.

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
from kvabi.tensors import to_torch

KINDS = ("full", "sliding_window")
DTYPES = ("float32", "float16")


@dataclasses.dataclass(frozen=True, eq=False)
class TorchPlan:
    """What ``attention`` and ``write_kv`` need for one step, for any layer.

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

    meta: kvabi.CommonAttentionMetadata
    spec: kvabi.KVSpec
    layout: object
    q_index: torch.Tensor
    q_valid: torch.Tensor
    rows: torch.Tensor
    key_blocks: torch.Tensor
    key_invalid: torch.Tensor
    mask: torch.Tensor
    write_tokens: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    scale: float
    softcap: float | None
    sinks: np.ndarray | None


class TorchSDPABackend(kvabi.Backend):
    """Full and sliding-window attention, GQA, soft cap and sinks; float32 and float16."""

    name = "example.torch"
    abi_version = (1, 1)
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

    # -- plan -------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self.check_supported(spec, softcap=softcap, sinks=sinks)  # refuse, never guess
        kvabi.check_step(meta, spec, layout)
        opts = kvabi.AttentionOptions.resolve(spec, scale, softcap, sinks,
                                              num_q_heads=num_q_heads)
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
        return TorchPlan(meta, spec, layout, t(q_index), t(q_valid), t(q_index[q_valid]),
                         t(blocks), t(np.flatnonzero(~key_valid)), t(mask), t(written),
                         t(slots[written] // bs), t(slots[written] % bs),
                         opts.scale, opts.softcap, opts.sinks)

    @staticmethod
    def _check_plan(plan, layout):
        if not isinstance(plan, TorchPlan):
            raise kvabi.KVABIError(f"plan: must come from example.torch's plan(), got "
                                   f"{type(plan).__name__}")
        if layout != plan.layout:
            raise kvabi.KVABIError("layout: differs from the layout the plan was made for")

    # -- write ------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        key, value = to_torch(key), to_torch(value)
        kvabi.check_kv(key, value, plan.meta, spec)
        tok, blk, off = plan.write_tokens, plan.write_blocks, plan.write_offsets
        kview = cache.kv_view(layer, 0)[..., :spec.head_dim]
        vview = cache.kv_view(layer, 1)[..., :spec.head_dim_v]
        kview[blk, off] = key[tok].to(kview.dtype)  # index_put_ writes through the view
        vview[blk, off] = value[tok].to(vview.dtype)
        return cache

    # -- attention --------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        query = to_torch(query)
        hq = kvabi.check_query(query, plan.meta, spec)
        h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
        g = hq // h
        # Per-call sinks (ABI 1.1) override the plan's: learned per layer in some models.
        sink = plan.sinks if sinks is None else kvabi.AttentionOptions.resolve(
            spec, plan.scale, plan.softcap, sinks, num_q_heads=hq).sinks
        if sink is not None and sink.shape != (hq,):
            raise kvabi.KVABIError(f"sinks: must have one logit per query head ({hq}), "
                                   f"got shape {sink.shape}")

        r, width = plan.key_blocks.shape
        bs = spec.block_size

        def keys(kv, dim):
            # [R, blocks, N, H, D] -> [R, K, H, D]: one gather per request's blocks
            x = cache.kv_view(layer, kv).index_select(0, plan.key_blocks.reshape(-1))
            x = x[..., :dim].reshape(r * width * bs, h, dim).float()
            # Zero, never multiply: rows outside the request can hold anything, NaN too.
            return x.index_fill_(0, plan.key_invalid, 0.0).reshape(r, width * bs, h, dim)

        k, v = keys(0, d), keys(1, dv)
        # A value row some queries of the request see and others do not stays in v, and
        # a masked probability (0) times NaN is NaN: non-finite value rows are zeroed,
        # and the queries that do see one get NaN afterwards (what the poison gives them).
        bad = ~torch.isfinite(v).all(dim=-1)  # [R, K, H]
        poisoned = None
        if bool(bad.any()):
            v = v.masked_fill(bad[..., None], 0.0)
            poisoned = torch.einsum("rqk,rkh->rqh", plan.mask.float(), bad.float()) > 0
        q = query[plan.q_index].float()  # [R, Qmax, Hq, D]
        qmax = q.shape[1]
        if plan.rows.numel() == 0:  # no real query token (every row is padding)
            o = q.new_zeros((r, qmax, hq, dv))
            lse = q.new_zeros((r, qmax, hq))
        elif plan.softcap is None and sink is None and not return_lse:
            # torch's fused kernel; GQA by head groups as kvabi's semantics state
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=plan.mask[:, None], scale=plan.scale,
                enable_gqa=g > 1).transpose(1, 2)  # [R, Qmax, Hq, Dv]
        else:
            qg = q.reshape(r, qmax, h, g, d)
            logits = torch.einsum("rqhgd,rkhd->rhgqk", qg, k) * plan.scale
            if plan.softcap is not None:
                logits = plan.softcap * torch.tanh(logits / plan.softcap)
            logits = torch.where(plan.mask[:, None, None], logits, float("-inf"))
            if sink is not None:  # one extra logit per head in the denominator only
                s = torch.as_tensor(sink, dtype=torch.float32).reshape(1, h, g, 1, 1)
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
        o = o[plan.q_valid]

        result = torch.zeros((plan.meta.num_tokens, hq, dv), dtype=query.dtype)
        result[plan.rows] = o.reshape(-1, hq, dv).to(query.dtype)  # the query's dtype
        if out is not None:
            if tuple(out.shape) != tuple(result.shape) or out.dtype != result.dtype:
                raise kvabi.KVABIError(f"out: must be {list(result.shape)} {query.dtype}, "
                                       f"got {list(out.shape)} {out.dtype}")
            result = out.copy_(result)
        if not return_lse:
            return result
        full = torch.zeros((plan.meta.num_tokens, hq), dtype=torch.float32)
        full[plan.rows] = lse[plan.q_valid].float()
        return result, full

