"""The ``reference`` backend: the numpy float64 oracle of ``specs/semantics.md`` (ABI 1.1).

Caches are held in the layout's own dtype (numpy, or ``ml_dtypes`` for bfloat16 and
float8), written and read through the strided per-layer views of a :class:`kvabi.KVCache`
(computed once per cache), so the oracle works on every preset layout byte for byte.
Attention upcasts to float64 and is computed densely with a written-out masked softmax
(``reference_attention``): slow by design, obvious by design, memory bounded.

Per-step work (which rows each write and each query touches, the masks) is done once in
:meth:`ReferenceBackend.plan`; a layer's ``write_kv`` or ``attention`` checks its own
arguments (shapes, the cache against the plan's layout) and does the arithmetic.
"""
from __future__ import annotations

import threading

import attrs
import numpy as np

from .abi import Backend, Capabilities, UnsupportedError
from .cache import as_cache
from .coerce import as_int, real_array
from .dtypes import DTYPES, numpy_dtype
from .errors import KVABIError
from .layout import Layout
from .metadata import CommonAttentionMetadata
from .presets import preset_names
from .presets_components import QUANTIZED
from .quant import (ROUNDINGS, check_quant_layout, check_scales, quantize_per_tensor,
                    quantize_per_token_head)
from .reference_attention import Pieces, attend, step_work
from .spec import KINDS, KVSpec
from .step_checks import (AttentionOptions, check_kv, check_layer, check_query, check_sinks,
                          check_step)

#: the quantization granularities the oracle computes (semantics section 11): per_token_head
#: over any layout with scale components (its presets: vllm.*_per_token_head, flashinfer.*)
QUANT = ("none", "per_tensor", "per_token_head")


@attrs.frozen(eq=False)
class ReferencePlan:
    """The reference backend's per-step plan: the metadata, the attention options and the
    step's precomputed work.

    ``scale`` multiplies q.k (default ``1/sqrt(spec.head_dim)``); ``softcap`` (or None)
    caps the scaled logits as ``cap * tanh(x / cap)``; ``sinks`` (or None) holds one
    float64 logit per query head, the default of every layer; ``num_q_heads`` (or None:
    taken from each query).  ``pieces`` is the batched work list; ``write_rows`` the
    (token, block, row) of every real token.  Nothing in a plan depends on the layer.
    """

    meta: CommonAttentionMetadata
    spec: KVSpec
    layout: object
    scale: float
    softcap: float | None = None
    sinks: np.ndarray | None = None
    pieces: Pieces | None = None
    num_q_heads: int | None = None
    query_piece: int = 64
    chunk_elements: int = 1 << 23
    write_rows: tuple | None = None
    # {num_q_heads: [ChunkWork]}: built on first use per head count (layer-independent)
    _work: dict = attrs.field(init=False, factory=dict, repr=False)
    _lock: object = attrs.field(init=False, factory=threading.Lock, repr=False)

    def __attrs_post_init__(self):
        if self.pieces is None:
            object.__setattr__(self, "pieces",
                               Pieces.from_meta(self.meta, self.spec, self.query_piece))
        if self.write_rows is None:
            slots = self.meta.slot_mapping
            real = np.nonzero(slots >= 0)[0]
            tokens = None if len(real) == len(slots) else real  # None: every token
            s = slots[real]
            bs = self.spec.block_size
            object.__setattr__(self, "write_rows", (tokens, s // bs, s % bs))

    def work(self, num_q_heads: int):
        """The step's chunks for ``num_q_heads`` query heads (built once, then shared)."""
        w = self._work.get(num_q_heads)
        if w is None:
            with self._lock:
                w = self._work.get(num_q_heads)
                if w is None:
                    w = step_work(self.meta, self.spec, self.pieces, num_q_heads,
                                  self.chunk_elements)
                    self._work[num_q_heads] = w
        return w


class ReferenceBackend(Backend):
    """numpy float64 attention over caches in their native dtype; every spec, every layout."""

    name = "reference"
    framework = "numpy"

    def __init__(self, *, query_piece: int = 64, chunk_elements: int = 1 << 23):
        """``query_piece``: most query tokens of one request batched together;
        ``chunk_elements``: float64 elements one batch of pieces may hold (about 64 MiB)."""
        self.query_piece = as_int(query_piece, "query_piece", lo=1)
        self.chunk_elements = as_int(chunk_elements, "chunk_elements", lo=1)

    def available(self) -> tuple[bool, str]:
        return True, "numpy float64"

    def capabilities(self, spec=None) -> Capabilities:
        return Capabilities(kinds=KINDS, dtypes=DTYPES, head_dims=None, block_sizes=None,
                            softcap=True, sinks=True,
                            layouts=self.preferred_layouts(spec) if spec is not None else (),
                            notes="numpy float64 oracle; any head dim, block size, layout",
                            quant=self._claimed(spec), roundings=ROUNDINGS)

    def _claimed(self, spec) -> tuple[str, ...]:
        """Every granularity it computes; for a per_token_head spec only where a preset
        holds it (the kit tests what it claims on the presets it prefers)."""
        if spec is None or spec.quant != "per_token_head" or self.preferred_layouts(spec):
            return QUANT
        return tuple(q for q in QUANT if q != "per_token_head")

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        """Every preset layout that can hold ``spec`` (MLA: those without a KV axis; a
        quantized preset where its dtype and scales are the spec's)."""
        names = preset_names(spec) + (QUANTIZED if spec.quant == "per_token_head" else ())
        out = []
        for name in names:
            try:  # a preset may still refuse the spec (packing, page alignment, Dv != D)
                lay = Layout.preset(name, spec, num_blocks=1)
                check_quant_layout(spec, lay)
            except KVABIError:
                continue
            if lay.dtype == spec.dtype:
                out.append(name)
        return tuple(out)

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        check_step(meta, spec, layout)
        if spec.quant not in QUANT:
            raise UnsupportedError(f"{self.name}: unsupported: quant {spec.quant!r} not in "
                                   f"{QUANT}")
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks, num_q_heads=num_q_heads)
        hq = None if num_q_heads is None else int(num_q_heads)
        plan = ReferencePlan(meta, spec, layout, opts.scale, opts.softcap, opts.sinks,
                             Pieces.from_meta(meta, spec, self.query_piece), hq,
                             self.query_piece, self.chunk_elements)
        if hq is not None:
            plan.work(hq)  # the per-step work belongs to plan time when the heads are known
        return plan

    # -- cache views -------------------------------------------------------------------
    @staticmethod
    def _views(cache, layout, plan, layer):
        """(handle, key view, value view) of ``layer``: [B, N, H, D] and [B, N, H, Dv].

        ``check_step`` at plan time checked the plan's layout against the step; a call
        with another layout object is checked again.  The cache is checked against the
        call's layout (a lookup for a KVCache of it)."""
        if layout is not plan.layout:
            check_step(plan.meta, plan.spec, layout)
        handle = as_cache(cache, layout, "numpy")
        spec = plan.spec
        if spec.is_mla:
            lat = handle.kv_view(layer, 0)
            return handle, lat[..., :spec.head_dim], lat[..., :spec.head_dim_v]
        k = handle.kv_view(layer, 0)
        v = handle.kv_view(layer, 1)
        if k.shape[3] != spec.head_dim:
            k = k[..., :spec.head_dim]
        if v.shape[3] != spec.head_dim_v:
            v = v[..., :spec.head_dim_v]
        return handle, k, v

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0, k_scale=None,
                 v_scale=None):
        """Write new K/V at the plan's slots, in place; returns ``cache`` as given.

        A ``per_tensor`` cache stores codes under the layer's static ``k_scale`` and
        ``v_scale`` (float32 values, 1.0 when not given); a ``per_token_head`` cache codes
        and one float32 scale per token and head in the layout's ``key_scale`` and
        ``value_scale`` components (semantics section 11)."""
        spec = plan.spec
        scales = check_scales(spec, k_scale, v_scale)
        key = real_array(key, "key")
        value = None if value is None else real_array(value, "value")
        check_kv(key, value, plan.meta, spec)
        _, kview, vview = self._views(cache, layout, plan, check_layer(layer, layout))
        if not (kview.flags.writeable and vview.flags.writeable):
            raise KVABIError(f"cache: the planes of layer {layer} are read-only")
        tokens, blk, off = plan.write_rows
        k = key if tokens is None else key[tokens]
        v = None if spec.is_mla else value if tokens is None else value[tokens]
        if spec.quant == "per_token_head":
            kq, ks = quantize_per_token_head(k, spec.dtype, spec.rounding, "key")
            vq, vs = quantize_per_token_head(v, spec.dtype, spec.rounding, "value")
            handle = as_cache(cache, layout, "numpy")
            kview[blk, off], vview[blk, off] = kq, vq
            handle.component_view("key_scale", layer)[blk, off, :, 0] = ks
            handle.component_view("value_scale", layer)[blk, off, :, 0] = vs
            return cache
        if scales is None:
            dt = numpy_dtype(spec.dtype)
            kview[blk, off] = to_cache_dtype(k, dt)
            if v is not None:
                vview[blk, off] = to_cache_dtype(v, dt)
            return cache
        kq = quantize_per_tensor(k, scales[0], spec.dtype, spec.rounding, "key")
        vq = None if v is None else \
            quantize_per_tensor(v, scales[1], spec.dtype, spec.rounding, "value")
        kview[blk, off] = kq  # both quantized before either lands: a refusal changes nothing
        if vq is not None:
            vview[blk, off] = vq
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, sinks=None,
                  out=None, return_lse=False, k_scale=None, v_scale=None):
        """Attention in float64: returns float64 ``out`` [T, Hq, Dv] (and lse [T, Hq]),
        the oracle's precision; with ``out=`` the result is written there (in its dtype)
        and ``out`` is returned.  ``sinks`` overrides the plan's for this call; a
        ``per_tensor`` cache is read as codes times the layer's ``k_scale``/``v_scale``."""
        spec, meta = plan.spec, plan.meta
        scales = check_scales(spec, k_scale, v_scale) or (1.0, 1.0)
        if spec.quant == "per_token_head":  # [B, N, H, 1] float32 views
            handle = as_cache(cache, layout, "numpy")
            scales = tuple(handle.component_view(n, check_layer(layer, layout))
                           for n in ("key_scale", "value_scale"))
        query = real_array(query, "query")
        hq = check_query(query, meta, spec)
        if plan.num_q_heads is not None and hq != plan.num_q_heads:
            raise KVABIError(f"query: the plan was made for num_q_heads={plan.num_q_heads}, "
                             f"got {hq} query heads")
        h = spec.num_kv_heads
        s = check_sinks(sinks, hq) if sinks is not None else plan.sinks
        if s is None:
            sink = np.full((h, hq // h), -np.inf)
        else:
            if s.shape != (hq,):
                AttentionOptions(plan.scale, plan.softcap, s).check_heads(hq)
            sink = s.reshape(h, hq // h)
        t = meta.num_tokens
        dst = None if out is None else _check_out(out, (t, hq, spec.head_dim_v))
        _, kview, vview = self._views(cache, layout, plan, check_layer(layer, layout))
        res = np.zeros((t, hq, spec.head_dim_v), np.float64)
        lse = np.full((t, hq), -np.inf, np.float64)
        attend(query, kview, vview, spec, plan.work(hq), plan.scale, plan.softcap, sink,
               res, lse, scales)
        if dst is not None:
            dst[...] = res
            res = out
        return (res, lse) if return_lse else res


def _check_out(out, shape) -> np.ndarray:
    """``out=``: a writable numpy array of the output's shape and a real float dtype."""
    if not isinstance(out, np.ndarray):
        raise KVABIError(f"out: must be a numpy array for the reference backend, got "
                         f"{type(out).__name__}")
    if out.shape != shape:
        raise KVABIError(f"out: must have shape {list(shape)}, got {list(out.shape)}")
    if not (out.dtype.kind == "f" or (out.dtype.kind == "V" and out.dtype.itemsize in (1, 2))):
        raise KVABIError(f"out: must have a floating dtype, got {out.dtype}")
    if not out.flags.writeable:
        raise KVABIError("out: must be writable")
    return out


def to_cache_dtype(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``x`` converted to cache dtype ``dt``: floats round to nearest even; int8 rounds to
    nearest even and saturates to [-128, 127]."""
    if dt == np.int8 and not np.issubdtype(np.asarray(x).dtype, np.integer):
        return np.clip(np.rint(np.asarray(x, np.float64)), -128, 127).astype(np.int8)
    if dt == np.int8:
        return np.clip(x, -128, 127).astype(np.int8)
    return np.asarray(x).astype(dt, copy=False)
