"""A pool of KV blocks in host memory: offload a request's blocks from a device cache,
onload them back later (the CPU-cache-hit path).

The pool has its own layout, by default ``kvbm.fully_contiguous`` (cross-layer blocks: a
run of blocks is one region for all layers).  Moving blocks between a device layout and the
pool is the move :func:`~kvabi.transfer.plan_block_transfer` plans, but the pool keeps the
regions of one sub-block per device layout (:func:`~kvabi.transfer.plan.block_template`)
and copies each call's blocks from it as strided views, without building the regions (a
per-layer device layout has about a million of them per request).
"""
from __future__ import annotations

import os

import numpy as np

from ..layout.component import Component
from ..layout.descriptor import Layout, check_layout
from ..memory.cache import KVCache
from ..model.spec import KVSpec
from ..util.coerce import as_int, int_array
from ..util.errors import KVABIError
from .execute import execute_pattern
from .plan import _layers, block_pattern, block_template, check_compatible

DEFAULT_PRESET = "kvbm.fully_contiguous"
#: templates kept (one per direction and device layout: a few layouts share a pool)
TEMPLATES = 8
#: a host layout built from the device layout: cross-layer blocks (B outermost) holding
#: each layer's block in the device's own byte order, so offload is no relayout
CROSS_LAYER = "cross_layer"


def cross_layer_twin(layout: Layout, num_blocks: int, num_layers: int | None = None) -> Layout:
    """A compact cross-layer layout: ``B`` outermost, then ``layout``'s plane axes, then its
    other axes in its order (one plane, no padding).  A device block of one layer is one
    contiguous range of it in the same byte order, so copies between the two move whole
    blocks.  A component layout's twin: ``B``, then ``L``, then each component's bytes of
    that (block, layer), dense, in the device's order of its axes."""
    if not layout.is_axis_form:
        return _component_twin(layout, num_blocks, num_layers)
    order = ("B",) + tuple(layout.planes) + tuple(a for a in layout.order if a != "B")
    sizes = {a: layout.size(a) for a in order}
    sizes["B"] = num_blocks
    if num_layers is not None and "L" in sizes:
        sizes["L"] = num_layers
    elif num_layers not in (None, 1):
        raise KVABIError(f"num_layers: the device layout has no layer axis, got {num_layers}")
    return Layout(order=order, sizes=sizes, dtype=layout.dtype, name=CROSS_LAYER)


def _component_twin(layout: Layout, num_blocks: int, num_layers: int | None) -> Layout:
    nl = layout.num_layers if num_layers is None else num_layers
    sizes = {"L": nl, "B": num_blocks, "N": layout.size("N"), "H": layout.size("H")}
    parts, at, align = [], 0, 1
    for c in layout.components:
        counts = {"N": sizes["N"], "H": sizes["H"], "E": c.units}
        inner = sorted((a for a in ("N", "H", "E") if a in c.strides),
                       key=lambda a: -c.strides[a])
        strides, step = {}, c.unit
        for a in reversed(inner):
            strides[a], step = step, step * counts[a]
        at = -(-at // c.unit) * c.unit
        parts.append((c, at, strides))
        at += step
        align = max(align, c.unit)
    cell = -(-at // align) * align  # one (block, layer)
    comps = [Component(name=c.name, dtype=c.dtype, count=c.count, offset=off,
                       strides={"B": cell * nl, "L": cell, **strides})
             for c, off, strides in parts]
    return Layout(sizes=sizes, components=comps, name=CROSS_LAYER)


def spec_of(layout: Layout) -> KVSpec:
    """The KVSpec whose per-token data ``layout`` holds (full attention, or MLA)."""
    if layout.has_kv:
        return KVSpec("full", block_size=layout.size("N"), num_kv_heads=layout.size("H"),
                      head_dim=layout.size("D"), dtype=layout.dtype)
    return KVSpec("mla", block_size=layout.size("N"), num_kv_heads=1,
                  head_dim=layout.size("D"), dtype=layout.dtype)


class HostPool:
    """``num_blocks`` host blocks for caches of ``source`` (a device Layout, or a KVSpec
    with ``num_layers``), in the layout of ``preset`` (default ``kvbm.fully_contiguous``;
    ``"cross_layer"``: :func:`cross_layer_twin` of the device layout, no relayout).

    ``offload(cache, blocks) -> host_ids`` copies the blocks into free host blocks;
    ``onload(cache, host_ids, blocks)`` copies them back (into any device blocks);
    ``free(host_ids)`` returns host blocks to the pool.  ``layout`` overrides the preset.
    """

    def __init__(self, source, num_blocks: int, *, num_layers: int | None = None,
                 preset: str = DEFAULT_PRESET, layout: Layout | None = None,
                 framework: str = "numpy"):
        num_blocks = as_int(num_blocks, "num_blocks", lo=1)
        if isinstance(source, Layout):
            spec = spec_of(source)
            layers = source.num_layers if num_layers is None else as_int(
                num_layers, "num_layers", lo=1)
        elif isinstance(source, KVSpec):
            spec = source
            layers = as_int(1 if num_layers is None else num_layers, "num_layers", lo=1)
        else:
            raise KVABIError(f"source: must be a Layout or a KVSpec, got "
                             f"{type(source).__name__}")
        if layout is None and preset == CROSS_LAYER:
            if not isinstance(source, Layout):
                raise KVABIError(f"preset: {CROSS_LAYER!r} is built from a device Layout, "
                                 "not a KVSpec")
            layout = cross_layer_twin(source, num_blocks, layers)
        elif layout is None:
            layout = Layout.preset(preset, spec, num_blocks, layers)
        else:
            check_layout(layout)
        if isinstance(source, Layout):
            check_compatible(source, layout)
        need, have = layout.total_nbytes, host_memory()
        if need > have:
            field = "num_blocks" if layout.num_blocks == num_blocks else "layout.sizes.B"
            raise KVABIError(f"{field}: {layout.num_blocks} host blocks need {need} bytes, "
                             f"more than this machine's {have} bytes of memory")
        self.layout = layout
        self.cache = KVCache.allocate(layout, framework)
        self._free = np.ones(layout.num_blocks, bool)
        # (src layout, dst layout, layers, template) of the last few device layouts seen
        self._templates: list = []

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    def offload(self, cache, blocks) -> np.ndarray:
        """Copy ``blocks`` of ``cache`` (a KVCache) into free host blocks; returns their
        ids (int64, in the order of ``blocks``)."""
        layout = _layout_of(cache)
        blocks = int_array(blocks, "blocks", lo=0, hi=layout.num_blocks - 1)
        free = np.flatnonzero(self._free)
        if blocks.size > free.size:
            raise KVABIError(f"blocks: {blocks.size} blocks to offload, the host pool has "
                             f"{free.size} free")
        ids = free[:blocks.size * layout.size("N") // self.layout.size("N")]
        self._move(layout, self.layout, blocks, ids, cache, self.cache)
        self._free[ids] = False
        return ids

    def onload(self, cache, host_ids, blocks):
        """Copy host blocks ``host_ids`` into ``blocks`` of ``cache``; returns the cache
        (a new handle for jax)."""
        layout = _layout_of(cache)
        ids = self._held(host_ids)
        blocks = int_array(blocks, "blocks", lo=0, hi=layout.num_blocks - 1)
        if np.unique(blocks).size != blocks.size:
            u, c = np.unique(blocks, return_counts=True)
            raise KVABIError(f"blocks: block {int(u[c > 1][0])} appears twice")
        return self._move(self.layout, layout, ids, blocks, self.cache, cache)

    def _move(self, src: Layout, dst: Layout, sb, db, src_cache, dst_cache):
        check_compatible(src, dst)
        if sb.size * src.size("N") != db.size * dst.size("N"):
            raise KVABIError(f"blocks: {db.size} blocks of {dst.size('N')} tokens do not hold "
                             f"{sb.size} blocks of {src.size('N')} tokens")
        if not sb.size:
            return dst_cache
        hit = next((h for h in self._templates if h[0] is src and h[1] is dst), None) or \
            next((h for h in self._templates if h[0] == src and h[1] == dst), None)
        if hit is None:
            lay = _layers(None, src, dst)
            hit = (src, dst, lay, block_template(src, dst, lay))
            self._templates = [hit] + self._templates[:TEMPLATES - 1]
        pattern = block_pattern(src, dst, sb, db, hit[3], hit[2])
        return execute_pattern(pattern, src, dst, src_cache, dst_cache)

    def free(self, host_ids) -> None:
        """Return host blocks to the pool."""
        self._free[self._held(host_ids)] = True

    def _held(self, host_ids) -> np.ndarray:
        ids = int_array(host_ids, "host_ids", lo=0, hi=self.layout.num_blocks - 1)
        if ids.size and self._free[ids].any():
            raise KVABIError(f"host_ids: block {int(ids[self._free[ids]][0])} holds no "
                             "offloaded data")
        return ids


def host_memory() -> int:
    """Bytes of physical memory of this machine (a bound no host pool can exceed)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound known
        return 2**62


def _layout_of(cache) -> Layout:
    if not isinstance(cache, KVCache):
        raise KVABIError(f"cache: must be a KVCache (it carries its layout), got "
                         f"{type(cache).__name__}")
    return cache.layout
