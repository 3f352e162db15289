"""``cpu.vllm``: vLLM's compiled CPU attention kernels (CPU_ATTN) as a kvabi backend.

- ``plan`` (once per step and KV group): ``cpu_attn_get_scheduler_metadata`` (the kernels'
  work split over threads), plus the step's block entries in kernel order and the slots to
  write, all vectorized over requests and tokens.
- ``write_kv``: in ``vllm.cpu`` (vLLM's own cache) the kernels' own write
  ``cpu_attn_reshape_and_cache``; elsewhere the step's K/V scattered to their slots of the
  kvabi layout (a strided torch write; any layout ``Layout`` describes).
- ``attention``: ``cpu_attention_with_kv_cache`` (causal, sliding window: the kernels take
  W, the keys a query sees, its own included, kvabi's convention; soft cap; per-head sinks
  as ``s_aux`` float32; scale; GQA). The kernels' keys are ``[D, N]`` tiles per block and
  head, their values ``[N, D]`` (see :mod:`kvabi_vllm.cpu_layout`). In the preferred
  layout ``vllm.cpu`` (vLLM's own cache) both are read in place: no copy per step. In
  ``vllm.cpu_kt`` the keys are read in place and the values of the step's blocks copied
  token-major into a scratch; in any other layout the step's blocks are copied whole.
  Value rows no query sees are zeroed in the copy: the kernels multiply every value row of
  a block by its probability, and 0 * NaN is NaN.  In place, the output is checked
  instead: where it is not finite, the step runs again on the copy.

The kernels return no log-sum-exp: with ``return_lse=True`` it is computed in torch (float64)
from the same keys (a second pass; engines decoding through vLLM never ask for it).

fp8 caches (``float8_e4m3fn``, ``float8_e5m2``) are ``per_tensor`` quantized with the
rounding of vLLM's CPU writer, ``toward_zero`` (``specs/semantics.md`` section 11): the
write stores ``kvabi.quant`` codes under the layer's ``k_scale``/``v_scale``, the kernels
read the codes with the same scales (``kv_cache_dtype`` ``fp8``/``fp8_e5m2``, ISA ``vec``:
head dims and block sizes multiples of 32) and compute in the query's dtype.

vLLM is imported on first use (``available``/``plan``), never by ``import kvabi_vllm``.
"""
from __future__ import annotations

import dataclasses
import math
import platform
import threading

import numpy as np
import torch

import kvabi
from kvabi.tensors import to_torch

from .cpu_layout import (BLOCK_MULTIPLE, HEAD_SIZES, choose_isa, kernel_scratch, key_tiles,
                         keys_in_kernel_order, to_kernel_blocks, value_scratch,
                         value_scratch_numel, values_in_kernel_order,
                         values_to_kernel_order)

KINDS = ("full", "sliding_window")
DTYPES = ("float32", "float16", "bfloat16")
#: fp8 cache dtypes -> vLLM's ``kv_cache_dtype`` for its kernels (per-tensor scales)
FP8 = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8_e5m2"}
#: fp8 needs the ``vec`` ISA: head dims and block sizes multiples of this
FP8_MULTIPLE = 32
#: vLLM's own cache first (read in place), keys in place, vLLM's LBHNC name (copied)
PREFERRED = ("vllm.cpu", "vllm.cpu_kt", "vllm.LBHNC")


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
    scratch viewed ``[rows, D]`` (see :mod:`kvabi_vllm.cpu_layout`), None when none is.
    ``write_*``: the tokens written (slot != -1) and their block and offset. ``sched``:
    scheduler metadata per number of query heads (filled in ``plan`` when it is given,
    else on first use).  ``inplace``: the values are in kernel order too (``vllm.cpu``):
    the kernels read the cache itself and ``hidden`` indexes its value rows
    (:func:`~kvabi_vllm.cpu_layout.value_rows`); ``slot_mapping``: the step's slots (int64,
    -1 for padding) for the kernels' own write.
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
    slot_mapping: torch.Tensor
    inplace: bool
    scale: float
    softcap: float | None
    sinks: np.ndarray | None
    num_q_heads: int | None
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
        ctx = meta.context_lens.astype(np.int64)
        nblk = -(-seq // bs)  # block columns each request reads
        total = int(nblk.sum())
        start = np.cumsum(nblk) - nblk
        req = np.repeat(np.arange(meta.num_reqs), nblk)
        col = np.arange(total) - np.repeat(start, nblk)
        entries = meta.block_table[req, col].astype(np.int64) if total else np.zeros(0, np.int64)
        # Rows no query of the request sees: past seq_len, or before the window of its
        # first query (a request without queries sees nothing).
        j = col[:, None] * bs + np.arange(bs)[None, :]
        lo = np.asarray(spec.first_visible_key(ctx), np.int64)[req][:, None]
        hidden = (j >= seq[req][:, None]) | (j < lo) | (np.diff(qsl) == 0)[req][:, None]
        native = keys_in_kernel_order(layout)
        if native:  # distinct blocks; a row is hidden when every request reading it hides it
            entries, inv = np.unique(entries, return_inverse=True)
            seen = np.zeros((len(entries), bs), bool)
            e, n = np.nonzero(~hidden)
            seen[inv.reshape(-1)[e], n] = True  # repeated (block, row) pairs: same value
            hidden = ~seen
            table = np.array(meta.block_table, np.int32)  # metadata arrays are read-only
            if table.shape[1] == 0:
                table = np.zeros((meta.num_reqs, 1), np.int32)
        else:
            width = int(nblk.max()) if meta.num_reqs else 0
            table = np.zeros((meta.num_reqs, max(width, 1)), np.int32)
            table[req, col] = np.arange(total, dtype=np.int32)
        # Hidden value rows as row indices of the value scratch viewed [rows, D].
        he, hn = np.nonzero(hidden)
        h = np.arange(spec.num_kv_heads, dtype=np.int64)[None, :]
        if native:  # the scratch has the layout's block and head strides
            row = (layout.stride("B") * entries[he][:, None] + layout.stride("H") * h) \
                // (layout.itemsize * spec.head_dim)
        else:
            row = (he[:, None] * spec.num_kv_heads + h) * 2 * bs + bs
        rows = (row + hn[:, None]).reshape(-1)
        slots = meta.slot_mapping
        written = np.nonzero(slots >= 0)[0]
        t = torch.from_numpy
        plan = CpuVllmPlan(
            meta, spec, layout, choose_isa(spec.head_dim, bs), native, int(qsl[-1]),
            t(meta.query_start_loc.astype(np.int32)), t(meta.seq_lens.astype(np.int32)),
            t(entries), t(table), t(rows) if len(rows) else None,
            t(written), t(slots[written] // bs), t(slots[written] % bs),
            t(slots.astype(np.int64)), native and values_in_kernel_order(layout),
            opts.scale, opts.softcap, opts.sinks, num_q_heads)
        if num_q_heads is not None:  # fp8 codes: the query's dtype, float32 most likely
            self._schedule(plan, num_q_heads, torch.float32 if spec.is_quantized else
                           kvabi.tensors.torch_dtype(spec.dtype))
        return plan

    @staticmethod
    def _schedule(plan: CpuVllmPlan, hq: int, dtype):
        """The kernels' scheduler metadata for ``hq`` query heads computing in ``dtype``
        (once per plan)."""
        md = plan.sched.get((hq, dtype))
        if md is None:
            spec = plan.spec
            md = plan.sched[(hq, dtype)] = _ops().cpu_attn_get_scheduler_metadata(
                num_reqs=plan.meta.num_reqs, num_heads=hq, num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim, seq_lens=plan.seq_lens, dtype=dtype,
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
    def write_kv(self, cache, layout, key, value, plan, *, layer=0, k_scale=None,
                 v_scale=None):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        scales = kvabi.check_scales(spec, k_scale, v_scale)
        key, value = to_torch(key), to_torch(value)
        kvabi.check_kv(key, value, plan.meta, spec)
        tok, blk, off = plan.write_tokens, plan.write_blocks, plan.write_offsets
        kview, vview = _views(cache, layer, spec)
        if plan.inplace:  # vLLM's own cache: the kernels' own write (fp8: its rounding)
            if len(tok):  # slot -1 (padding tokens) is skipped by the kernels
                dt = query_dtype(key)
                _ops().cpu_attn_reshape_and_cache(
                    key.to(dt), value.to(dt), key_tiles(torch, kview),
                    key_tiles(torch, vview), plan.slot_mapping, plan.isa,
                    k_scale=(scales or (1.0, 1.0))[0], v_scale=(scales or (1.0, 1.0))[1],
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

    # -- attention ------------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False, k_scale=None, v_scale=None):
        cache = kvabi.as_cache(cache, layout, self.framework)
        self._check_plan(plan, layout)
        spec = plan.spec
        scales = kvabi.check_scales(spec, k_scale, v_scale) or (1.0, 1.0)
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
        kview, vview = _views(cache, layer, spec)
        cdt = kview.dtype  # the scratch's: fp8 codes as bytes
        # the kernels compute in the cache dtype, or for fp8 codes in the query's
        wdt = query.dtype if spec.is_quantized else cdt
        if wdt not in (torch.float32, torch.float16, torch.bfloat16):
            raise kvabi.KVABIError(f"query: dtype {query.dtype} (fp8 caches are read by "
                                   f"kernels computing in float32, float16 or bfloat16)")
        e = len(plan.entries)
        direct = out is not None and out.dtype == wdt and out.is_contiguous()
        result = out if direct else torch.empty((t_all, hq, d), dtype=wdt)
        result[n:].zero_()  # padding tokens: unspecified by the ABI, zero here

        def run(kc, vc):
            if not (n and e):
                result[:n].zero_()  # no request has a key: nothing to attend
                return
            q = query[:n].to(wdt).contiguous()
            s_aux = None if sink is None else torch.from_numpy(sink.astype(np.float32))
            _ops().cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=result[:n],
                query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
                scale=plan.scale, causal=True, alibi_slopes=None,
                sliding_window=spec.window if spec.kind == "sliding_window" else -1,
                block_table=plan.table, softcap=plan.softcap or 0.0,
                scheduler_metadata=self._schedule(plan, hq, wdt), s_aux=s_aux,
                k_scale=scales[0], v_scale=scales[1],
                kv_cache_dtype=FP8.get(spec.dtype, "auto"))

        kc = key_tiles(torch, kview)
        if plan.inplace:
            run(kc, key_tiles(torch, vview))
            # A NaN or inf in a value row no query sees makes its zero probability NaN:
            # where the output is not finite, the step runs again on a copy of the values
            # with those rows zeroed (a NaN a query does see stays NaN there).
            # (one sum: NaN and inf reach it; a finite overflow only costs the copy)
            again = n and e and plan.hidden is not None and \
                not math.isfinite(result[:n].sum().item())
        if plan.native and (not plan.inplace or again):
            vc, rows = value_scratch(torch, kc, cdt,
                                     self._buffer(value_scratch_numel(kc), cdt))
            if e:
                values_to_kernel_order(vview, plan.entries, vc, rows, plan.hidden)
            run(kc, vc)
        elif not plan.native:
            h, bs = spec.num_kv_heads, spec.block_size
            scratch, kc, vc = kernel_scratch(torch, e, h, bs, d, cdt,
                                             self._buffer(e * h * 2 * bs * d, cdt))
            if e:
                to_kernel_blocks(kview, vview, plan.entries, scratch, plan.hidden)
            run(kc, vc)
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
        return result, _lse(plan, query, keys, hq, sink, scales[0])


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
    """``kvabi.quant``'s codes of rows ``x`` under a static scale, as uint8 bytes."""
    from kvabi.quant import quantize_per_tensor

    c = quantize_per_tensor(x.float().numpy(), scale, spec.dtype, spec.rounding, field)
    return torch.from_numpy(c.view(np.uint8))


def _lse(plan: CpuVllmPlan, query, keys, hq: int, sink, k_scale: float = 1.0) -> torch.Tensor:
    """Log-sum-exp [T, Hq] float32 of the step (the kernels return none), in torch:
    ``keys`` [X, N, H, D] indexed by ``plan.table`` (fp8: code bytes, read as codes times
    ``k_scale``); per real token, its request's keys, masked by select."""
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
    k = keys[plan.table.long()[req]].reshape(n, width * bs, h, d)
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
        s = torch.from_numpy(sink).reshape(1, h, hq // h, 1)
        logits = torch.cat([logits, s.expand(n, h, hq // h, 1)], dim=-1)
    full[:n] = torch.logsumexp(logits, dim=-1).reshape(n, hq).float()
    return full


__all__ = ["CpuVllmBackend", "CpuVllmPlan"]
