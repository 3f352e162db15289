"""The ``reference`` backend: the numpy float64 oracle of ``specs/semantics.md``.

Caches are held in the layout's own dtype (numpy, or ``ml_dtypes`` for bfloat16 and
float8), written and read through :meth:`kvabi.Layout.kv_view` strided views, so the
oracle works on every preset layout byte for byte.  Attention upcasts to float64 and is
computed densely with a written-out masked softmax (``reference_attention``): slow by
design, obvious by design, memory bounded.
"""
from __future__ import annotations


import attrs
import numpy as np

from .abi import Backend, Capabilities
from .dtypes import DTYPES, numpy_dtype
from .errors import KVABIError, require
from .metadata import CommonAttentionMetadata
from .reference_attention import Pieces, attend
from .spec import KINDS, KVSpec
from .step_checks import AttentionOptions, check_kv, check_query, check_step


@attrs.frozen(eq=False)
class ReferencePlan:
    """The reference backend's per-step plan: the metadata plus the attention options.

    ``scale`` multiplies q.k (default ``1/sqrt(spec.head_dim)``); ``softcap`` (or None)
    caps the scaled logits as ``cap * tanh(x / cap)``; ``sinks`` (or None) holds one
    float64 logit per query head.  ``pieces`` is the batched work list, built once per step.
    """

    meta: CommonAttentionMetadata
    spec: KVSpec
    layout: object
    scale: float
    softcap: float | None = None
    sinks: np.ndarray | None = None
    pieces: Pieces | None = None

    def __attrs_post_init__(self):
        if self.pieces is None:
            object.__setattr__(self, "pieces", Pieces.from_meta(self.meta, self.spec, 64))


class ReferenceBackend(Backend):
    """numpy float64 attention over caches in their native dtype; every spec, every layout."""

    name = "reference"

    def __init__(self, *, query_piece: int = 64, chunk_elements: int = 1 << 23):
        """``query_piece``: most query tokens of one request batched together;
        ``chunk_elements``: float64 elements one batch of pieces may hold (about 64 MiB)."""
        require(isinstance(query_piece, int) and query_piece > 0, "query_piece",
                "must be a positive int", query_piece)
        require(isinstance(chunk_elements, int) and chunk_elements > 0, "chunk_elements",
                "must be a positive int", chunk_elements)
        self.query_piece = query_piece
        self.chunk_elements = chunk_elements

    def available(self) -> tuple[bool, str]:
        return True, "numpy float64"

    def capabilities(self, spec=None) -> Capabilities:
        return Capabilities(kinds=KINDS, dtypes=DTYPES, head_dims=None, block_sizes=None,
                            softcap=True, sinks=True,
                            layouts=self.preferred_layouts(spec) if spec is not None else (),
                            notes="numpy float64 oracle; any head dim, block size, layout")

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        """Every preset layout that can hold ``spec`` (MLA: those without a KV axis)."""
        from .layout import Layout
        from .presets import PRESETS

        out = []
        for name in PRESETS:
            try:  # a preset may still refuse the spec (packing, page alignment, Dv != D)
                Layout.preset(name, spec, num_blocks=1)
            except KVABIError:
                continue
            out.append(name)
        return tuple(out)

    # -- arrays ----------------------------------------------------------------------
    def asarray(self, x):
        return np.asarray(x)

    def to_numpy(self, x):
        return np.asarray(x)

    def allocate(self, layout) -> list:
        return layout.allocate_numpy(0)

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        check_step(meta, spec, layout)
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks)
        return ReferencePlan(meta, spec, layout, opts.scale, opts.softcap, opts.sinks,
                             Pieces.from_meta(meta, spec, self.query_piece))

    # -- cache views -------------------------------------------------------------------
    def _views(self, cache, layout, spec, layer):
        """(key view, value view) of ``layer``: [B, N, H, D] and [B, N, H, Dv] numpy views."""
        if spec.is_mla:
            lat = layout.kv_view(cache, layer, 0)
            self._check_view(lat, spec, spec.head_dim, "latent")
            return lat[..., :spec.head_dim], lat[..., :spec.head_dim_v]
        k = layout.kv_view(cache, layer, 0)
        v = layout.kv_view(cache, layer, 1)
        self._check_view(k, spec, spec.head_dim, "key")
        self._check_view(v, spec, spec.head_dim_v, "value")
        return k[..., :spec.head_dim], v[..., :spec.head_dim_v]

    @staticmethod
    def _check_view(view, spec, d, what):
        want = (spec.block_size, spec.num_kv_heads)
        if view.ndim != 4 or tuple(view.shape[1:3]) != want or view.shape[3] < d:
            raise KVABIError(f"layout: {what} view has shape {tuple(view.shape)}, expected "
                             f"[B, {want[0]}, {want[1]}, >= {d}] for this spec")

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        spec, meta = plan.spec, plan.meta
        key = np.asarray(key)
        value = None if value is None else np.asarray(value)
        check_kv(key, value, meta, spec)
        kview, vview = self._views(cache, layout, spec, layer)
        slots = meta.slot_mapping
        real = np.nonzero(slots >= 0)[0]
        blk = slots[real] // spec.block_size
        off = slots[real] % spec.block_size
        dt = numpy_dtype(spec.dtype)
        kview[blk, off] = to_cache_dtype(key[real], dt)
        if not spec.is_mla:
            vview[blk, off] = to_cache_dtype(value[real], dt)
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        spec, meta = plan.spec, plan.meta
        query = np.asarray(query)
        t, h = meta.num_tokens, spec.num_kv_heads
        hq = check_query(query, meta, spec)
        AttentionOptions(plan.scale, plan.softcap, plan.sinks).check_heads(hq)
        g = hq // h
        if plan.sinks is not None:
            sink = plan.sinks.reshape(h, g)
        else:
            sink = np.full((h, g), -np.inf)
        kview, vview = self._views(cache, layout, spec, layer)
        out = np.zeros((t, hq, spec.head_dim_v), np.float64)
        lse = np.full((t, hq), -np.inf, np.float64)
        attend(query, kview, vview, plan, sink, out, lse, budget=self.chunk_elements)
        return (out, lse) if return_lse else out


def to_cache_dtype(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``x`` converted to cache dtype ``dt``: floats round to nearest even; int8 rounds to
    nearest even and saturates to [-128, 127]."""
    if dt == np.int8 and not np.issubdtype(np.asarray(x).dtype, np.integer):
        return np.clip(np.rint(np.asarray(x, np.float64)), -128, 127).astype(np.int8)
    if dt == np.int8:
        return np.clip(x, -128, 127).astype(np.int8)
    return np.asarray(x).astype(dt)
