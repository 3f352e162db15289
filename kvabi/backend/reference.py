"""The ``reference`` backend: the numpy float64 oracle of ``specs/semantics.md``.

Caches are held in the layout's own dtype (numpy, or ``ml_dtypes`` for bfloat16 and
float8), written and read through the strided per-layer views of a :class:`kvabi.KVCache`
(computed once per cache), so the oracle works on every preset layout byte for byte.
Attention upcasts to float64 and is computed densely with a written-out masked softmax
(``reference_attention``): slow by design, obvious by design, memory bounded.

Per-step work (which rows each write and each query touches, the masks) is prepared once
per plan; a layer's ``write`` or ``attend`` does the arithmetic.  Every argument check is
:class:`kvabi.Backend`'s.
"""
from __future__ import annotations

import threading

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..layout.presets import preset_names
from ..layout.presets_components import QUANTIZED
from ..model.quant import (ROUNDINGS, check_quant_layout, quantize_per_tensor,
                           quantize_per_token_head)
from ..model.spec import KINDS
from ..util.coerce import as_int
from ..util.dtypes import DTYPES, numpy_dtype
from ..util.errors import KVABIError
from .base import Backend
from .capabilities import Capabilities
from .reference_attention import Pieces, attend, step_work

#: the quantization granularities the oracle computes (semantics section 11): per_token_head
#: over any layout with scale components (its presets: vllm.*_per_token_head, flashinfer.*)
QUANT = ("none", "per_tensor", "per_token_head")


@attrs.frozen(eq=False)
class ReferenceWork:
    """What the reference prepares for a step: ``pieces``, the batched work list;
    ``write_rows``, the (token, block, row) of every real token (tokens None: every token
    is real); and the chunks of the step's query heads (built on first use)."""

    pieces: Pieces
    write_rows: tuple
    chunk_elements: int
    _work: dict = attrs.field(init=False, factory=dict, repr=False)
    _lock: object = attrs.field(init=False, factory=threading.Lock, repr=False)

    def work(self, plan):
        """The step's chunks for the plan's query heads (built once, then shared)."""
        w = self._work.get(None)
        if w is None:
            with self._lock:
                w = self._work.get(None)
                if w is None:
                    w = self._work[None] = step_work(plan.meta, plan.spec, self.pieces,
                                                     plan.num_q_heads, self.chunk_elements)
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

    def prepare(self, plan) -> ReferenceWork:
        slots = plan.meta.slot_mapping
        real = np.nonzero(slots >= 0)[0]
        tokens = None if len(real) == len(slots) else real
        s = slots[real]
        bs = plan.spec.block_size
        work = ReferenceWork(Pieces.from_meta(plan.meta, plan.spec, self.query_piece),
                             (tokens, s // bs, s % bs), self.chunk_elements)
        work.work(plan)  # the per-step work belongs to plan time
        return work

    @staticmethod
    def _views(cache, plan, layer):
        """(key view, value view) of ``layer``: [B, N, H, D] and [B, N, H, Dv]."""
        spec = plan.spec
        k = cache.kv_view(layer, 0)
        if spec.is_mla:
            return k, k[..., :spec.head_dim_v]
        v = cache.kv_view(layer, 1)
        return k, v if v.shape[3] == spec.head_dim_v else v[..., :spec.head_dim_v]

    def write(self, plan, cache, key, value, layer, scales=None):
        """New K/V at the plan's slots, in place; returns ``cache``.

        A ``per_tensor`` cache stores codes under the layer's static ``scales`` (``(k_scale,
        v_scale)`` float32 values, checked by the base class); a ``per_token_head`` cache
        codes and one float32 scale per token and head in the layout's ``key_scale`` and
        ``value_scale`` components (semantics section 11)."""
        spec = plan.spec
        kview, vview = self._views(cache, plan, layer)
        if not (kview.flags.writeable and vview.flags.writeable):
            raise KVABIError(f"cache: the planes of layer {layer} are read-only")
        tokens, blk, off = plan.prepared.write_rows
        k = key if tokens is None else key[tokens]
        v = None if spec.is_mla else value if tokens is None else value[tokens]
        if spec.quant == "per_token_head":
            kq, ks = quantize_per_token_head(k, spec.dtype, spec.rounding, "key")
            vq, vs = quantize_per_token_head(v, spec.dtype, spec.rounding, "value")
            kview[blk, off], vview[blk, off] = kq, vq
            cache.component_view("key_scale", layer)[blk, off, :, 0] = ks
            cache.component_view("value_scale", layer)[blk, off, :, 0] = vs
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

    def attend(self, plan, cache, query, layer, sinks, out, return_lse, scales=None):
        """float64 output [T, Hq, Dv] and lse [T, Hq], the oracle's precision (the base
        class copies the output into ``out`` when one is given); a ``per_tensor`` cache is
        read as codes times the layer's ``scales``, a ``per_token_head`` one as codes times
        their row's stored scale."""
        spec, hq = plan.spec, plan.num_q_heads
        if spec.quant == "per_token_head":  # [B, N, H, 1] float32 views
            scales = tuple(cache.component_view(n, layer)
                           for n in ("key_scale", "value_scale"))
        elif scales is None:
            scales = (1.0, 1.0)
        h = spec.num_kv_heads
        sink = np.full((h, hq // h), -np.inf) if sinks is None else sinks.reshape(h, hq // h)
        kview, vview = self._views(cache, plan, layer)
        t = plan.meta.num_tokens
        res = np.zeros((t, hq, spec.head_dim_v), np.float64)
        lse = np.full((t, hq), -np.inf, np.float64)
        attend(query, kview, vview, spec, plan.prepared.work(plan), plan.scale, plan.softcap,
               sink, res, lse, scales)
        return res, lse


def to_cache_dtype(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``x`` converted to cache dtype ``dt``: floats round to nearest even; int8 rounds to
    nearest even and saturates to [-128, 127]."""
    if dt == np.int8 and not np.issubdtype(np.asarray(x).dtype, np.integer):
        return np.clip(np.rint(np.asarray(x, np.float64)), -128, 127).astype(np.int8)
    if dt == np.int8:
        return np.clip(x, -128, 127).astype(np.int8)
    return np.asarray(x).astype(dt, copy=False)
