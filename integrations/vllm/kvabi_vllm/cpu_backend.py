"""``cpu.vllm``: vLLM's compiled CPU attention kernels (CPU_ATTN) as a kvabi backend.

- ``prepare`` (once per step and KV group, from ``plan``):
  ``cpu_attn_get_scheduler_metadata`` (the kernels' work split over threads), plus the
  step's block entries in kernel order and the slots to write, all vectorized over requests
  and tokens.
- ``write`` (``write_kv``): in ``vllm.cpu`` (vLLM's own cache) the kernels' own write
  ``cpu_attn_reshape_and_cache``; elsewhere the step's K/V scattered to their slots of the
  kvabi layout (a strided torch write; any layout ``Layout`` describes).
- ``attend`` (``attention``): ``cpu_attention_with_kv_cache`` (causal, sliding window:
  the kernels take W, the keys a query sees, its own included, kvabi's convention; soft
  cap; per-head sinks as ``s_aux`` float32; scale; GQA). The kernels' keys are ``[D, N]`` tiles per block and
  head, their values ``[N, D]`` (see :mod:`kvabi_vllm.cpu_layout`). In the preferred
  layout ``vllm.cpu`` (vLLM's own cache) both are read in place: no copy per step. In
  ``vllm.cpu_kt`` the keys are read in place and the values of the step's blocks copied
  token-major into a scratch; in any other layout the step's blocks are copied whole.
  Value rows no query sees are zeroed in the copy: the kernels multiply every value row of
  a block by its probability, and 0 * NaN is NaN; rows some queries see and others do not
  are checked per call (:mod:`kvabi_vllm.cpu_masking`), so a NaN reaches only the queries
  that see it.  In place, the output is checked instead: where it is not finite, the step
  runs again on the copy.

The kernels return no log-sum-exp: with ``return_lse=True`` it is computed in torch (float64)
from the same keys (a second pass; engines decoding through vLLM never ask for it).

fp8 caches (``float8_e4m3fn``, ``float8_e5m2``) are ``per_tensor`` quantized with the
rounding of vLLM's CPU writer, ``toward_zero`` (``specs/semantics.md`` section 11): the
write stores ``kvabi.model.quant`` codes under the layer's ``k_scale``/``v_scale``, the kernels
read the codes with the same scales (``kv_cache_dtype`` ``fp8``/``fp8_e5m2``, ISA ``vec``:
head dims and block sizes multiples of 32) and compute in the query's dtype.

vLLM is imported on first use (``available``/``plan``), never by ``import kvabi_vllm``.
"""
from __future__ import annotations

import math
import platform
import threading

import attrs
import numpy as np
import torch

import kvabi
from kvabi.util.tensors import ConvertOnce

from .cpu_layout import (BLOCK_MULTIPLE, HEAD_SIZES, choose_isa, kernel_scratch, key_tiles,
                         keys_in_kernel_order, to_kernel_blocks, value_scratch,
                         value_scratch_numel, values_in_kernel_order,
                         values_to_kernel_order)
from .cpu_masking import PartialRows, merge_entries, pair_visibility, poisoned_queries

KINDS = ("full", "sliding_window")
DTYPES = ("float32", "float16", "bfloat16")
#: fp8 cache dtypes -> vLLM's ``kv_cache_dtype`` for its kernels (per-tensor scales)
FP8 = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
#: fp8 needs the ``vec`` ISA: head dims and block sizes multiples of this
FP8_MULTIPLE = 32
#: vLLM's own cache first (read in place), keys in place, vLLM's LBHNC name (copied)
PREFERRED = ("vllm.cpu", "vllm.cpu_kt", "vllm.LBHNC")


_OPS = []


def _ops():
    """vLLM's op wrappers (importing vLLM loads its compiled library; once, then held:
    this is called per layer)."""
    if not _OPS:
        from vllm import _custom_ops

        _OPS.append(_custom_ops)
    return _OPS[0]


@attrs.frozen(eq=False)
class CpuVllmSteps:
    """What ``cpu.vllm`` prepares for one step of one KV group, for any layer.

    ``native``: the layout's keys are in kernel order (read in place). Then ``entries``
    [U] are the distinct cache blocks the step reads, ``table`` the step's block table,
    ``hidden`` [U, N] the rows of those blocks no query of any request reading them sees.
    Otherwise ``entries`` [E] holds one entry per (request, block column) up to each
    request's ``seq_len``, ``table`` [R, max blocks] int32 each request's entries (the
    kernels' block table over the copied blocks), ``hidden`` [E, N] the rows no query of
    the entry's request sees. ``hidden`` holds those rows as row indices of the value
    scratch viewed ``[rows, D]`` (see :mod:`kvabi_vllm.cpu_layout`), None when none is;
    ``partial`` the rows some queries see and others do not (:mod:`kvabi_vllm.cpu_masking`).
    ``write_*``: the tokens written (slot != -1) and their block and offset.
    ``inplace``: the values are in kernel order too (``vllm.cpu``): the kernels read the
    cache itself and ``hidden`` indexes its value rows
    (:func:`~kvabi_vllm.cpu_layout.value_rows`); ``slot_mapping``: the step's slots (int64,
    -1 for padding) for the kernels' own write.  ``sched``: the kernels' scheduler
    metadata for the plan's query heads computing in ``sched_dtype`` (the cache dtype; for
    fp8 codes the query's: float32 here, others made on first use through
    ``Backend.prepared_for``).  Frozen, and read-only while the plan is used (the base
    class seals every tensor: the kernels index the cache through ``entries`` and
    ``table``).
    """

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
    slot_mapping: torch.Tensor
    inplace: bool
    partial: PartialRows | None  # value rows some queries see and others do not
    #: the plan's sinks as float32 (the kernels' ``s_aux``), or None
    s_aux: torch.Tensor | None
    sched_dtype: object = None
    sched: torch.Tensor | None = None


class CpuVllmBackend(kvabi.Backend):
    """vLLM's CPU_ATTN kernels (``vec``/``vec16`` ISAs): full and sliding-window attention,
    soft cap, sinks, GQA; float32, float16, bfloat16; vLLM's compiled head sizes; block
    sizes that are multiples of 16."""

    name = "cpu.vllm"
    framework = "torch"

    def __init__(self):
        self._available = None
        self._s_aux = ConvertOnce("torch", dtype="float32")  # per-call sinks, once each
        # Scratch memory per thread and dtype, grown as needed and reused by every layer
        # and step: a fresh buffer per step would pay its page faults again every time.
        self._scratch = threading.local()
        # Whether a layout's keys (and values) are in kernel order, per layout: a vLLM
        # engine plans every step over the same layout object (layouts are unhashable).
        self._orders: dict[int, tuple] = {}

    def _order(self, layout) -> tuple[bool, bool]:
        """(keys in kernel order, values too) of ``layout``, worked out once per layout."""
        hit = self._orders.get(id(layout))
        if hit is None or hit[0] is not layout:
            if len(self._orders) >= 64:
                self._orders.clear()
            keys = keys_in_kernel_order(layout)
            hit = self._orders[id(layout)] = (layout, keys,
                                              keys and values_in_kernel_order(layout))
        return hit[1], hit[2]

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
        fp8 = spec is not None and spec.dtype in FP8
        plain = spec is not None and not fp8
        return kvabi.Capabilities(
            kinds=KINDS, dtypes=DTYPES + tuple(FP8),
            head_dims=tuple(d for d in HEAD_SIZES if not fp8 or d % FP8_MULTIPLE == 0),
            block_size_multiple=FP8_MULTIPLE if fp8 else BLOCK_MULTIPLE,
            softcap=True, sinks=True, layouts=PREFERRED if spec is not None else (),
            quant=("per_tensor",) if fp8 else ("none",) if plain else ("none", "per_tensor"),
            roundings=("toward_zero",),
            notes="vLLM CPU_ATTN kernels; in vllm.cpu_kt keys read in place and the values "
                  "of the step's blocks copied per layer (both, in other layouts); fp8 "
                  "per-tensor with vLLM's rounding (toward_zero)")

    def preferred_layouts(self, spec):
        return PREFERRED

    def device(self):
        return torch.device("cpu")

    # -- once per step --------------------------------------------------------------------
    def prepare(self, plan) -> CpuVllmSteps:
        meta, spec, layout = plan.meta, plan.spec, plan.layout
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
        native, inplace = self._order(layout)
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

        # rows no query sees: zeroed in every copy; rows some queries see: checked per call
        rows = value_rows(*np.nonzero(~some)).reshape(-1)
        pe, pn = np.nonzero(some & ~every)
        partial = PartialRows(torch.from_numpy(value_rows(pe, pn)), pe, pn, req, col, inv) \
            if len(pe) else None
        slots = meta.slot_mapping
        written = np.nonzero(slots >= 0)[0]
        # the index arrays as views of two tensors: what the base class seals and checks
        # at every call is one version counter per tensor (specs/security.md 2.5)
        qsl32, seq32, table = _packed((qsl, meta.seq_lens, table), np.int32)
        entries, written_t, blk, off, slot64, rows_t = _packed(
            (entries, written, slots[written] // bs, slots[written] % bs, slots, rows),
            np.int64)
        isa = choose_isa(spec.head_dim, bs)
        # fp8 codes: the kernels compute in the query's dtype, float32 most likely
        dt = torch.float32 if spec.is_quantized else kvabi.tensors.torch_dtype(spec.dtype)
        return CpuVllmSteps(
            isa, native, int(qsl[-1]), qsl32, seq32, entries, table,
            rows_t if len(rows) else None, written_t, blk, off, slot64,
            inplace, partial,
            None if plan.sinks is None else torch.from_numpy(plan.sinks.astype(np.float32)),
            dt, _schedule(plan, isa, qsl32, seq32, dt))

    def _sched(self, plan, dtype):
        """The scheduler metadata computing in ``dtype``: the plan's own, or made once per
        plan and dtype (sealed with the plan: ``Backend.prepared_for``)."""
        p = plan.prepared
        if dtype == p.sched_dtype:
            return p.sched
        return self.prepared_for(plan, ("sched", dtype), lambda: _schedule(
            plan, p.isa, p.query_start_loc, p.seq_lens, dtype))

    # -- per layer ------------------------------------------------------------------------
    def write(self, plan, cache, key, value, layer, scales=None):
        spec, p = plan.spec, plan.prepared
        tok, blk, off = p.write_tokens, p.write_blocks, p.write_offsets
        kview, vview = _views(cache, layer, spec)
        if p.inplace:  # vLLM's own cache: the kernels' own write (fp8: its rounding)
            if len(tok):  # slot -1 (padding tokens) is skipped by the kernels
                dt = query_dtype(key)
                ks, vs = scales or (1.0, 1.0)
                _ops().cpu_attn_reshape_and_cache(
                    key.to(dt), value.to(dt), key_tiles(torch, kview),
                    key_tiles(torch, vview), p.slot_mapping, p.isa, k_scale=ks, v_scale=vs,
                    kv_cache_dtype=FP8.get(spec.dtype, "auto"))
            return cache
        if scales is None:
            kview[blk, off] = key[tok].to(kview.dtype)  # index_put_ writes through the view
            vview[blk, off] = value[tok].to(vview.dtype)
            return cache
        kq, vq = (_codes(x[tok], s, spec, name) for x, s, name in
                  ((key, scales[0], "key"), (value, scales[1], "value")))
        kview[blk, off] = kq  # both quantized before either lands: a refusal changes nothing
        vview[blk, off] = vq
        return cache

    def attend(self, plan, cache, query, layer, sinks, out, return_lse, scales=None):
        spec, p, hq = plan.spec, plan.prepared, plan.num_q_heads
        scales = scales or (1.0, 1.0)
        t_all, n, d = plan.meta.num_tokens, p.num_tokens, spec.head_dim
        kview, vview = _views(cache, layer, spec)
        cdt = kview.dtype  # the scratch's: fp8 codes as bytes
        # the kernels compute in the cache dtype, or for fp8 codes in the query's
        wdt = query.dtype if spec.is_quantized else cdt
        if wdt not in (torch.float32, torch.float16, torch.bfloat16):
            raise kvabi.KVABIError(f"query: dtype {query.dtype} (fp8 caches are read by "
                                   f"kernels computing in float32, float16 or bfloat16)")
        e = len(p.entries)
        direct = out is not None and out.dtype == wdt and out.is_contiguous()
        result = out if direct else torch.empty((t_all, hq, d), dtype=wdt)
        # the real tokens' rows (no slice where there is no padding: this runs per layer)
        real = result if n == t_all else result[:n]
        if n < t_all:
            result[n:].zero_()  # padding tokens: unspecified by the ABI, zero here
        s_aux = p.s_aux if sinks is plan.sinks else self._s_aux(sinks)

        def run(kc, vc, poisoned=None):
            if not (n and e):
                real.zero_()  # no request has a key: nothing to attend
                return
            q = query if n == t_all else query[:n]
            q = (q if q.dtype == wdt else q.to(wdt)).contiguous()
            _ops().cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=real,
                query_start_loc=p.query_start_loc, seq_lens=p.seq_lens,
                scale=plan.scale, causal=True, alibi_slopes=None,
                sliding_window=spec.window if spec.kind == "sliding_window" else -1,
                block_table=p.table, softcap=plan.softcap or 0.0,
                scheduler_metadata=self._sched(plan, wdt), s_aux=s_aux,
                k_scale=scales[0], v_scale=scales[1],
                kv_cache_dtype=FP8.get(spec.dtype, "auto"))
            if poisoned is not None:  # what the poison they see gives those queries
                real[torch.from_numpy(poisoned)] = float("nan")

        kc = key_tiles(torch, kview)
        again = False
        if p.inplace:
            run(kc, key_tiles(torch, vview))
            # A NaN or inf in a value row no query sees makes its zero probability NaN:
            # where the output is not finite, the step runs again on a copy of the values
            # with those rows zeroed (a NaN a query does see stays NaN there).
            # (one sum: NaN and inf reach it; a finite overflow only costs the copy)
            again = bool(n and e and p.hidden is not None) and \
                not math.isfinite(real.sum().item())
        if p.native and (not p.inplace or again):
            vc, rows = value_scratch(torch, kc, cdt,
                                     self._buffer(value_scratch_numel(kc), cdt))
            if e:
                values_to_kernel_order(vview, p.entries, vc, rows, p.hidden)
            run(kc, vc, _poisoned(plan, rows))
        elif not p.native:
            h, bs = spec.num_kv_heads, spec.block_size
            scratch, kc, vc = kernel_scratch(torch, e, h, bs, d, cdt,
                                             self._buffer(e * h * 2 * bs * d, cdt))
            if e:
                to_kernel_blocks(kview, vview, p.entries, scratch, p.hidden)
            run(kc, vc, _poisoned(plan, scratch.view(-1, d)))
        if not direct:
            result = result.to(query.dtype)  # the base class copies it into ``out``
        if not return_lse:
            return result, None
        if p.native:
            keys = kview  # [B, N, H, D], indexed by the step's block table
        else:  # [E, N, H, D] over the copied entries
            keys = kc.view(e, spec.num_kv_heads, d, spec.block_size).permute(0, 3, 1, 2)
        return result, _lse(plan, query, keys, sinks, scales[0])


def _poisoned(plan, rows):
    """The query heads that see a non-finite partial value row of the copy ``rows`` (those
    rows zeroed there), or None (:mod:`kvabi_vllm.cpu_masking`)."""
    p = plan.prepared
    if not len(p.entries) or p.partial is None:
        return None
    return poisoned_queries(plan, p.partial, rows, plan.num_q_heads)


def _packed(arrays, dtype) -> list:
    """``arrays`` as contiguous views of one torch tensor of ``dtype`` (one copy)."""
    arrays = [np.asarray(a) for a in arrays]
    flat = np.concatenate([a.astype(dtype, copy=False).reshape(-1) for a in arrays])
    # one split (a C++ call) and a reshape only where 2-D: this runs once per step
    parts = torch.from_numpy(flat).split([a.size for a in arrays])
    return [t if a.ndim == 1 else t.view(a.shape) for t, a in zip(parts, arrays)]


def _schedule(plan, isa: str, query_start_loc, seq_lens, dtype):
    """The kernels' scheduler metadata for the plan's query heads computing in ``dtype``."""
    spec = plan.spec
    return _ops().cpu_attn_get_scheduler_metadata(
        num_reqs=plan.meta.num_reqs, num_heads=plan.num_q_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start_loc, causal=True,
        sliding_window_size=spec.window if spec.kind == "sliding_window" else -1,
        isa=isa, enable_kv_split=False)


def query_dtype(x):
    """The dtype the kernels' write takes for K/V ``x``: its own (float32, float16,
    bfloat16), else float32."""
    return x.dtype if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else \
        torch.float32


def _views(cache, layer, spec):
    """The layer's strided [B, N, H, D] key and value views; an fp8 cache's as uint8 (its
    codes' bytes: the kernels take fp8 caches so, and torch indexes bytes everywhere)."""
    k, v = cache.kv_view(layer, 0), cache.kv_view(layer, 1)
    if spec.dtype in FP8:
        return k.view(torch.uint8), v.view(torch.uint8)
    return k, v


def _codes(x, scale: float, spec, field: str) -> torch.Tensor:
    """``kvabi.model.quant``'s codes of rows ``x`` under a static scale, as uint8 bytes."""
    from kvabi.model.quant import quantize_per_tensor

    c = quantize_per_tensor(x.float().numpy(), scale, spec.dtype, spec.rounding, field)
    return torch.from_numpy(c.view(np.uint8))


def _lse(plan, query, keys, sink, k_scale: float = 1.0) -> torch.Tensor:
    """Log-sum-exp [T, Hq] float32 of the step (the kernels return none), in torch:
    ``keys`` [X, N, H, D] indexed by the prepared ``table`` (fp8: code bytes, read as codes
    times ``k_scale``); per real token, its request's keys, masked by select."""
    meta, spec, p, hq = plan.meta, plan.spec, plan.prepared, plan.num_q_heads
    n, bs, h, d = p.num_tokens, spec.block_size, spec.num_kv_heads, spec.head_dim
    full = torch.full((meta.num_tokens, hq), float("-inf"), dtype=torch.float32)
    if not n or not len(p.entries):
        if sink is not None and n:
            full[:n] = torch.tensor(sink, dtype=torch.float32)[None, :]
        return full
    req = torch.from_numpy(meta.token_request[:n].astype(np.int64))
    pos = meta.positions[:n].astype(np.int64)
    width = p.table.shape[1]
    j = np.arange(width * bs)[None, :]
    lo = np.asarray(spec.first_visible_key(pos), np.int64)[:, None]
    seq = meta.seq_lens.astype(np.int64)[meta.token_request[:n]][:, None]
    vis = torch.from_numpy((j >= lo) & (j <= pos[:, None]) & (j < seq))
    # float64: the lse is compared in absolute terms, and logits of large head dims are
    # large (|logit| ~ 30 leaves float32 accumulation ~1e-5 off)
    k = keys[p.table.long()[req]].reshape(n, width * bs, h, d)
    if spec.dtype in FP8:
        k = k.view(kvabi.tensors.torch_dtype(spec.dtype)).double() * k_scale
    else:
        k = k.double()
    q = query[:n].double().reshape(n, h, hq // h, d)
    logits = torch.einsum("nhgd,nshd->nhgs", q, k) * plan.scale
    if plan.softcap is not None:
        logits = plan.softcap * torch.tanh(logits / plan.softcap)
    logits = torch.where(vis[:, None, None, :], logits, float("-inf"))
    if sink is not None:
        s = torch.tensor(sink).reshape(1, h, hq // h, 1)
        logits = torch.cat([logits, s.expand(n, h, hq // h, 1)], dim=-1)
    full[:n] = torch.logsumexp(logits, dim=-1).reshape(n, hq).float()
    return full


__all__ = ["CpuVllmBackend", "CpuVllmSteps"]
