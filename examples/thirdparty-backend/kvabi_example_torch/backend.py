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
  query token's visible keys through the block table and computes a masked softmax.

Every method first turns ``cache`` into a checked :class:`kvabi.KVCache`
(``kvabi.as_cache``): the planes then match the layout, and ``cache.kv_view(layer, kv)``
is a cached strided [blocks, block_size, heads, head_dim] view that works for any layout.

This is a teaching backend: it materializes a [tokens, max_seq_len] gather per step, so it
is simple rather than fast.
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

    ``rows``: the real (non-padding) query tokens; ``blocks``/``offsets`` [rows, S]: where
    key position j of each row's request lives; ``mask`` [rows, S]: which of them the row
    may see (causal, inside the window, inside the request).  ``write_blocks`` /
    ``write_offsets`` / ``write_tokens``: the slots of the step's tokens that are written
    (padding tokens, slot -1, are not).
    """

    meta: kvabi.CommonAttentionMetadata
    spec: kvabi.KVSpec
    layout: object
    rows: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
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
        req = np.repeat(np.arange(meta.num_reqs), np.diff(qsl))
        pos = meta.positions[:n].astype(np.int64)
        seq = meta.seq_lens.astype(np.int64)[req]
        width = int(meta.seq_lens.max()) if meta.num_reqs else 0
        j = np.arange(width, dtype=np.int64)[None, :]
        mask = (j >= spec.first_visible_key(pos)[:, None]) & (j <= pos[:, None]) & \
            (j < seq[:, None])
        table = meta.block_table.astype(np.int64)
        col = np.minimum(j // bs, max(table.shape[1] - 1, 0))
        blocks = np.where(mask, table[req][:, col[0]] if table.size else 0, 0)
        slots = meta.slot_mapping
        written = np.nonzero(slots >= 0)[0]
        t = torch.from_numpy
        return TorchPlan(meta, spec, layout, t(np.arange(n)), t(blocks),
                         t(np.broadcast_to(j % bs, mask.shape).copy()), t(mask),
                         t(written), t(slots[written] // bs), t(slots[written] % bs),
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

        mask = plan.mask  # [n, S]
        k = cache.kv_view(layer, 0)[plan.blocks, plan.offsets][..., :d].float()
        v = cache.kv_view(layer, 1)[plan.blocks, plan.offsets][..., :dv].float()
        # Select, never multiply: rows a query may not see can hold anything, NaN included.
        v = torch.where(mask[:, :, None, None], v, 0.0)
        q = query[plan.rows].float().reshape(-1, h, g, d)
        logits = torch.einsum("nhgd,nshd->nhgs", q, k) * plan.scale
        if plan.softcap is not None:
            logits = plan.softcap * torch.tanh(logits / plan.softcap)
        logits = torch.where(mask[:, None, None, :], logits, float("-inf"))
        if sink is not None:  # one extra logit per head in the denominator only
            s = torch.as_tensor(sink, dtype=torch.float32).reshape(1, h, g, 1)
            logits = torch.cat([logits, s.expand(logits.shape[0], h, g, 1)], dim=-1)
        top = logits.amax(dim=-1, keepdim=True)
        p = torch.exp(logits - top)
        denom = p.sum(dim=-1)
        o = torch.einsum("nhgs,nshd->nhgd", p[..., :mask.shape[1]], v) / denom[..., None]
        lse = (top[..., 0] + torch.log(denom)).reshape(-1, hq)

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
        full[plan.rows] = lse.float()
        return result, full

