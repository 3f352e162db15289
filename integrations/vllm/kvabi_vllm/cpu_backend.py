"""``cpu.vllm``: vLLM's compiled CPU attention kernels (CPU_ATTN) as a kvabi backend.

- ``plan`` (once per step and KV group): ``cpu_attn_get_scheduler_metadata`` (the kernels'
  work split over threads), plus the step's block entries in kernel order and the slots to
  write, all vectorized over requests and tokens.
- ``write_kv``: the step's K/V scattered to their slots of the kvabi layout (a strided
  torch write; any layout ``Layout`` describes).
- ``attention``: ``cpu_attention_with_kv_cache`` (causal, sliding window: the kernels take
  W, the keys a query sees, its own included, kvabi's convention; soft cap; per-head sinks
  as ``s_aux`` float32; scale; GQA). The kernels' keys are ``[D, N]`` tiles per block and
  head, their values ``[N, D]`` (see :mod:`kvabi_vllm.cpu_layout`). In the preferred
  layout ``vllm.cpu_kt`` the keys are read in place and the values of the step's blocks
  copied token-major into a scratch; in any other layout the step's blocks are copied
  whole. Value rows no query sees are zeroed in the copy (the kernels would turn NaN there
  into NaN output); rows some queries see and others do not are checked per call
  (:mod:`kvabi_vllm.cpu_masking`), so a NaN reaches only the queries that see it.

The kernels' own write (``cpu_attn_reshape_and_cache``) is not used for the kvabi cache: its
tile order (keys transposed, values not) is not expressible as one kvabi ``Layout``. The
kernels return no log-sum-exp: with ``return_lse=True`` it is computed in torch (float64)
from the same keys (a second pass; engines decoding through vLLM never ask for it).

vLLM is imported on first use (``available``/``plan``), never by ``import kvabi_vllm``.
"""
from __future__ import annotations

import dataclasses
import platform
import threading

import numpy as np
import torch

import kvabi
from kvabi.tensors import to_torch

from .cpu_layout import (BLOCK_MULTIPLE, HEAD_SIZES, choose_isa, kernel_scratch, key_tiles,
                         keys_in_kernel_order, to_kernel_blocks, value_scratch,
                         value_scratch_numel, values_to_kernel_order)
from .cpu_masking import PartialRows, merge_entries, pair_visibility, poisoned_queries

KINDS = ("full", "sliding_window")
DTYPES = ("float32", "float16", "bfloat16")
#: keys read in place first; vLLM's own name for the cache it allocates next (copied)
PREFERRED = ("vllm.cpu_kt", "vllm.LBHNC")


def _ops():
    """vLLM's op wrappers (importing vLLM loads its compiled library)."""
    from vllm import _custom_ops

    return _custom_ops


@dataclasses.dataclass(eq=False)
class CpuVllmPlan:
    """One step of one KV group, for any layer.

    ``native``: the layout's keys are in kernel order (read in place). Then ``entries``
    [U] are the distinct cache blocks the step reads, ``table`` the step's block table,
    ``hidden`` [U, N] the rows of those blocks no query of any request reading them sees.
    Otherwise ``entries`` [E] holds one entry per (request, block column) up to each
    request's ``seq_len``, ``table`` [R, max blocks] int32 each request's entries (the
    kernels' block table over the copied blocks), ``hidden`` [E, N] the rows no query of
    the entry's request sees. ``hidden`` holds those rows as row indices of the value
    scratch viewed ``[rows, D]`` (see :mod:`kvabi_vllm.cpu_layout`), None when none is;
    ``partial`` the rows some queries see and others do not (:mod:`kvabi_vllm.cpu_masking`).
    ``write_*``: the tokens written (slot != -1) and their block and offset. ``sched``:
    scheduler metadata per number of query heads (filled in ``plan`` when it is given,
    else on first use).
    """

    meta: kvabi.CommonAttentionMetadata
    spec: kvabi.KVSpec
    layout: object
    isa: str
    native: bool
    num_tokens: int  # real tokens (the rest is padding)
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    entries: torch.Tensor
    table: torch.Tensor
    hidden: torch.Tensor | None
    write_tokens: torch.Tensor
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    scale: float
    softcap: float | None
    sinks: np.ndarray | None
    num_q_heads: int | None
    partial: PartialRows | None  # value rows some queries see and others do not
    sched: dict = dataclasses.field(default_factory=dict)


class CpuVllmBackend(kvabi.Backend):
    """vLLM's CPU_ATTN kernels (``vec``/``vec16`` ISAs): full and sliding-window attention,
    soft cap, sinks, GQA; float32, float16, bfloat16; vLLM's compiled head sizes; block
    sizes that are multiples of 16."""

    name = "cpu.vllm"
    abi_version = (1, 1)
    framework = "torch"

    def __init__(self):
        self._available = None
        # Scratch memory per thread and dtype, grown as needed and reused by every layer
        # and step: a fresh buffer per step would pay its page faults again every time.
        self._scratch = threading.local()

    def _buffer(self, numel: int, dtype):
        """A 1-D scratch tensor of at least ``numel`` elements of ``dtype`` (this thread's;
        its contents are overwritten by the next attention call of the thread)."""
        bufs = self._scratch.__dict__.setdefault("bufs", {})
        buf = bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
        return buf

    def available(self):
        if self._available is None:
            self._available = self._probe()
        return self._available

    @staticmethod
    def _probe():
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return False, (f"{platform.machine()}: only the x86 vec/vec16 kernels' cache "
                           f"order is verified")
        try:
            import vllm

            _ops()
            ok = hasattr(torch.ops._C, "cpu_attention_with_kv_cache")
        except Exception as e:  # any import failure makes the backend unavailable
            return False, f"vLLM's CPU kernels are not importable: {type(e).__name__}: {e}"
        if not ok:
            return False, f"vLLM {vllm.__version__} has no CPU attention kernels (not a CPU build)"
        return True, (f"vLLM {vllm.__version__} CPU_ATTN kernels (vec/vec16), "
                      f"torch {torch.__version__}")

    def capabilities(self, spec=None):
        return kvabi.Capabilities(
            kinds=KINDS, dtypes=DTYPES, head_dims=HEAD_SIZES, block_size_multiple=BLOCK_MULTIPLE,
            softcap=True, sinks=True, layouts=PREFERRED if spec is not None else (),
            notes="vLLM CPU_ATTN kernels; in vllm.cpu_kt keys read in place and the values "
                  "of the step's blocks copied per layer (both, in other layouts)")

    def preferred_layouts(self, spec):
        return PREFERRED

    def device(self):
        return torch.device("cpu")

    # -- plan -----------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        kvabi.check_step(meta, spec, layout)
        opts = kvabi.AttentionOptions.resolve(spec, scale, softcap, sinks,
                                              num_q_heads=num_q_heads)
        ok, why = self.available()
        if not ok:
            raise kvabi.UnsupportedError(f"{self.name}: unavailable: {why}")
        bs = spec.block_size
        qsl = meta.query_start_loc.astype(np.int64)
        seq = meta.seq_lens.astype(np.int64)
        nblk = -(-seq // bs)  # block columns each request reads
        total = int(nblk.sum())
        start = np.cumsum(nblk) - nblk
        req = np.repeat(np.arange(meta.num_reqs), nblk)
        col = np.arange(total) - np.repeat(start, nblk)
        entries = meta.block_table[req, col].astype(np.int64) if total else np.zeros(0, np.int64)
        # Rows some query of the request sees, and rows all its queries see.
        some, every = pair_visibility(meta, spec, req, col)
        native = keys_in_kernel_order(layout)
        if native:  # distinct blocks, each read by one or more (request, column) pairs
            entries, inv = np.unique(entries, return_inverse=True)
            inv = inv.reshape(-1)
            some, every = merge_entries(some, every, inv, len(entries))
            table = np.array(meta.block_table, np.int32)  # metadata arrays are read-only
            if table.shape[1] == 0:
                table = np.zeros((meta.num_reqs, 1), np.int32)
        else:
            inv = np.arange(total)
            width = int(nblk.max()) if meta.num_reqs else 0
            table = np.zeros((meta.num_reqs, max(width, 1)), np.int32)
            table[req, col] = np.arange(total, dtype=np.int32)
        h = np.arange(spec.num_kv_heads, dtype=np.int64)[None, :]

        def value_rows(e, n):  # rows [k, H] of the value scratch viewed [rows, D]
            if native:  # the scratch has the layout's block and head strides
                row = (layout.stride("B") * entries[e][:, None] + layout.stride("H") * h) \
                    // (layout.itemsize * spec.head_dim)
            else:
                row = (e[:, None] * spec.num_kv_heads + h) * 2 * bs + bs
            return row + n[:, None]

        # rows no query sees: zeroed in every call; rows some queries see: checked per call
        rows = value_rows(*np.nonzero(~some)).reshape(-1)
        pe, pn = np.nonzero(some & ~every)
        partial = PartialRows(torch.from_numpy(value_rows(pe, pn)), pe, pn, req, col, inv) \
            if len(pe) else None
        slots = meta.slot_mapping
        written = np.nonzero(slots >= 0)[0]
        t = torch.from_numpy
        plan = CpuVllmPlan(
            meta, spec, layout, choose_isa(spec.head_dim, bs), native, int(qsl[-1]),
            t(meta.query_start_loc.astype(np.int32)), t(meta.seq_lens.astype(np.int32)),
            t(entries), t(table), t(rows) if len(rows) else None,
            t(written),
            t(slots[written] // bs), t(slots[written] % bs), opts.scale, opts.softcap,
            opts.sinks, num_q_heads, partial)
        if num_q_heads is not None:
            self._schedule(plan, num_q_heads)
        return plan

    @staticmethod
    def _schedule(plan: CpuVllmPlan, hq: int):
        """The kernels' scheduler metadata for ``hq`` query heads (once per plan)."""
        md = plan.sched.get(hq)
        if md is None:
            spec = plan.spec
            md = plan.sched[hq] = _ops().cpu_attn_get_scheduler_metadata(
                num_reqs=plan.meta.num_reqs, num_heads=hq, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, seq_lens=plan.seq_lens,
                dtype=kvabi.tensors.torch_dtype(spec.dtype),
                query_start_loc=plan.query_start_loc, causal=True,
                sliding_window_size=spec.window if spec.kind == "sliding_window" else -1,
                isa=plan.isa, enable_kv_split=False)
        return md

    def _check_plan(self, plan, layout):
        if not isinstance(plan, CpuVllmPlan):
            raise kvabi.KVABIError(f"plan: must come from {self.name}'s plan(), got "
                                   f"{type(plan).__name__}")
        if layout != plan.layout:
            raise kvabi.KVABIError("layout: differs from the layout the plan was made for")

    # -- write ----------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        key, value = to_torch(key), to_torch(value)
        kvabi.check_kv(key, value, plan.meta, spec)
        tok, blk, off = plan.write_tokens, plan.write_blocks, plan.write_offsets
        kview, vview = cache.kv_view(layer, 0), cache.kv_view(layer, 1)
        kview[blk, off] = key[tok].to(kview.dtype)  # index_put_ writes through the view
        vview[blk, off] = value[tok].to(vview.dtype)
        return cache

    # -- attention ------------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        query = to_torch(query)
        hq = kvabi.check_query(query, plan.meta, spec)
        if plan.num_q_heads is not None and hq != plan.num_q_heads:
            raise kvabi.KVABIError(f"query: {hq} query heads, the plan was made for "
                                   f"{plan.num_q_heads}")
        sink = plan.sinks if sinks is None else kvabi.AttentionOptions.resolve(
            spec, plan.scale, plan.softcap, sinks, num_q_heads=hq).sinks
        if sink is not None and sink.shape != (hq,):
            raise kvabi.KVABIError(f"sinks: must have one logit per query head ({hq}), "
                                   f"got shape {sink.shape}")
        t_all, n, d = plan.meta.num_tokens, plan.num_tokens, spec.head_dim
        if out is not None and (tuple(out.shape) != (t_all, hq, d) or out.dtype != query.dtype):
            raise kvabi.KVABIError(f"out: must be {[t_all, hq, d]} {query.dtype}, got "
                                   f"{list(out.shape)} {out.dtype}")
        cdt = kvabi.tensors.torch_dtype(spec.dtype)
        kview, vview = cache.kv_view(layer, 0), cache.kv_view(layer, 1)
        e = len(plan.entries)
        if plan.native:
            kc = key_tiles(torch, kview)
            vc, rows = value_scratch(torch, kc, cdt,
                                     self._buffer(value_scratch_numel(kc), cdt))
            if e:
                values_to_kernel_order(vview, plan.entries, vc, rows, plan.hidden)
        else:
            h, bs = spec.num_kv_heads, spec.block_size
            scratch, kc, vc = kernel_scratch(torch, e, h, bs, d, cdt,
                                             self._buffer(e * h * 2 * bs * d, cdt))
            rows = scratch.view(-1, d)
            if e:
                to_kernel_blocks(kview, vview, plan.entries, scratch, plan.hidden)
        poisoned = poisoned_queries(plan, plan.partial, rows, hq) \
            if e and plan.partial is not None else None
        direct = out is not None and out.dtype == cdt and out.is_contiguous()
        result = out if direct else torch.empty((t_all, hq, d), dtype=cdt)
        result[n:].zero_()  # padding tokens: unspecified by the ABI, zero here
        if n and e:
            q = query[:n].to(cdt).contiguous()
            s_aux = None if sink is None else torch.from_numpy(sink.astype(np.float32))
            _ops().cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=result[:n],
                query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
                scale=plan.scale, causal=True, alibi_slopes=None,
                sliding_window=spec.window if spec.kind == "sliding_window" else -1,
                block_table=plan.table, softcap=plan.softcap or 0.0,
                scheduler_metadata=self._schedule(plan, hq), s_aux=s_aux)
            if poisoned is not None:  # what the poison they see gives those queries
                result[:n][torch.from_numpy(poisoned)] = float("nan")
        elif n:
            result[:n].zero_()  # no request has a key: nothing to attend
        if not direct:
            result = result.to(query.dtype)
            if out is not None:
                result = out.copy_(result)
        if not return_lse:
            return result
        if plan.native:
            keys = kview  # [B, N, H, D], indexed by the step's block table
        else:  # [E, N, H, D] over the copied entries
            keys = kc.view(e, spec.num_kv_heads, d, spec.block_size).permute(0, 3, 1, 2)
        return result, _lse(plan, query, keys, hq, sink)


def _lse(plan: CpuVllmPlan, query, keys, hq: int, sink) -> torch.Tensor:
    """Log-sum-exp [T, Hq] float32 of the step (the kernels return none), in torch:
    ``keys`` [X, N, H, D] indexed by ``plan.table``; per real token, its request's keys,
    masked by select."""
    meta, spec = plan.meta, plan.spec
    n, bs, h, d = plan.num_tokens, spec.block_size, spec.num_kv_heads, spec.head_dim
    full = torch.full((meta.num_tokens, hq), float("-inf"), dtype=torch.float32)
    if not n or not len(plan.entries):
        if sink is not None and n:
            full[:n] = torch.from_numpy(sink.astype(np.float32))[None, :]
        return full
    req = torch.from_numpy(meta.token_request[:n].astype(np.int64))
    pos = meta.positions[:n].astype(np.int64)
    width = plan.table.shape[1]
    j = np.arange(width * bs)[None, :]
    lo = np.asarray(spec.first_visible_key(pos), np.int64)[:, None]
    seq = meta.seq_lens.astype(np.int64)[meta.token_request[:n]][:, None]
    vis = torch.from_numpy((j >= lo) & (j <= pos[:, None]) & (j < seq))
    # float64: the lse is compared in absolute terms, and logits of large head dims are
    # large (|logit| ~ 30 leaves float32 accumulation ~1e-5 off)
    k = keys[plan.table.long()[req]].reshape(n, width * bs, h, d).double()
    q = query[:n].double().reshape(n, h, hq // h, d)
    logits = torch.einsum("nhgd,nshd->nhgs", q, k) * plan.scale
    if plan.softcap is not None:
        logits = plan.softcap * torch.tanh(logits / plan.softcap)
    logits = torch.where(vis[:, None, None, :], logits, float("-inf"))
    if sink is not None:
        s = torch.from_numpy(sink).reshape(1, h, hq // h, 1)
        logits = torch.cat([logits, s.expand(n, h, hq // h, 1)], dim=-1)
    full[:n] = torch.logsumexp(logits, dim=-1).reshape(n, hq).float()
    return full


__all__ = ["CpuVllmBackend", "CpuVllmPlan"]
