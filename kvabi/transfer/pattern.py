"""The structure of a whole-block copy plan: the same few regions repeated per sub-block.

A plan moving whole blocks between layouts of block sizes ``bs_s`` and ``bs_t`` moves
*sub-blocks* of ``u = gcd(bs_s, bs_t)`` tokens, each inside one block of both layouts.  Both
layouts address bytes affinely (``layout.md``), so the regions of every sub-block are those of
the first one (the *template*, relative to the sub-block's base offsets) shifted by its base
offsets: ``block * stride(B) + offset_in_block * stride(N)`` on each side.  A plan is then a
broadcast (no per-region Python), its bounds follow from the template's and the bases'
extremes, and :func:`~kvabi.transfer.execute` copies each run of sub-blocks as strided views.
"""
from __future__ import annotations

import weakref

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..util.errors import KVABIError
from ..util.frozen import frozen_array, is_frozen


def plane_sizes(layout: Layout) -> np.ndarray:
    """The bytes of each plane ``layout`` addresses (what a checked cache of it holds)."""
    if layout.uniform_planes:
        return np.full(layout.num_planes, layout.plane_nbytes, np.int64)
    return np.asarray(layout.plane_sizes, np.int64)


def component_strides(layout: Layout, name: str, u: int) -> tuple[int, int]:
    """(B stride, N stride) of component ``name``, for sub-blocks of ``u`` tokens (the N
    stride matters only where sub-blocks split blocks: else 0)."""
    c = layout.component(name)
    return c.strides["B"], (0 if u == layout.size("N") else c.strides.get("N", 0))


def component_groups(src: Layout, dst: Layout, u: int) -> dict:
    """{((src B, N strides), (dst B, N strides)): component names}: the components whose
    sub-blocks shift alike on both sides (one group for every axis-form layout)."""
    groups: dict = {}
    for n in src.component_names:
        key = (component_strides(src, n, u), component_strides(dst, n, u))
        groups.setdefault(key, []).append(n)
    return {k: tuple(v) for k, v in groups.items()}


def block_strides(layout: Layout, u: int):
    """(B stride, N stride) every component of ``layout`` shares, for sub-blocks of ``u``
    tokens; None where components step differently (their sub-blocks then move as groups
    of components that step alike: :func:`component_groups`)."""
    got = {component_strides(layout, n, u) for n in layout.component_names}
    return got.pop() if len(got) == 1 else None


def base_offsets(layout: Layout, slots: np.ndarray, u: int | None = None,
                 strides=None) -> np.ndarray:
    """Byte offset of the sub-blocks starting at token ``slots`` (only the block and
    in-block token terms): with the (B, N) ``strides`` of a group of components, else those
    every component shares (:func:`block_strides`)."""
    bs = layout.size("N")
    if strides is None:
        strides = block_strides(layout, bs if u is None else u)
    if strides is None:
        raise KVABIError(f"layout: the components of {layout.name or 'this layout'} step "
                         f"differently along B or N; give the strides of one group")
    return (slots // bs) * strides[0] + (slots % bs) * strides[1]


def _int64(a) -> np.ndarray:
    """The pattern's own read-only int64 copy (a pattern is immutable: what a check proved
    about it stays true)."""
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and is_frozen(a):
        return a
    return frozen_array(a, np.int64)


#: extremes of the templates in use (keyed by the immutable template array; a template kept
#: by its caller for the next move is not scanned again)
_EXTREMES: dict = {}


def _template_extremes(t: np.ndarray) -> tuple:
    """Per side (source, destination) the extremes of template ``t`` per plane."""
    hit = _EXTREMES.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    ext = tuple(_extremes(t[:, k], t[:, k + 1], t[:, 4]) for k in (0, 2))
    key = id(t)
    _EXTREMES[key] = (weakref.ref(t), ext)
    weakref.finalize(t, _EXTREMES.pop, key, None)
    return ext


def _extremes(plane: np.ndarray, rel: np.ndarray, n: np.ndarray):
    """(distinct planes, lowest ``rel`` per plane, furthest ``rel + n`` per plane)."""
    planes, inv = np.unique(plane, return_inverse=True)
    lo = np.full(planes.size, np.iinfo(np.int64).max, np.int64)
    hi = np.full(planes.size, np.iinfo(np.int64).min, np.int64)
    np.minimum.at(lo, inv, rel)
    np.maximum.at(hi, inv, rel + n)
    return planes, lo, hi


@attrs.frozen(eq=False)
class BlockPattern:
    """Sub-block ``i`` moves tokens ``src_slots[i] + [0, u)`` to ``dst_slots[i] + [0, u)``
    for ``layers``; ``template`` rows ``(src_plane, src_rel, dst_plane, dst_rel, nbytes)`` are
    its regions relative to ``src_base[i]`` / ``dst_base[i]``."""

    u: int
    src_slots: np.ndarray = attrs.field(converter=_int64)
    dst_slots: np.ndarray = attrs.field(converter=_int64)
    layers: np.ndarray = attrs.field(converter=_int64)
    template: np.ndarray = attrs.field(converter=_int64)
    src_base: np.ndarray = attrs.field(converter=_int64)
    dst_base: np.ndarray = attrs.field(converter=_int64)
    #: the components this pattern moves (None: every one); see :class:`GroupedPattern`
    components: tuple | None = None
    # destination sub-blocks distinct: a property of the (immutable) slots, found once
    _distinct: bool = attrs.field(init=False, repr=False, default=attrs.Factory(
        lambda self: bool(np.unique(self.dst_slots).size == self.dst_slots.size),
        takes_self=True))
    # per side, the template's extremes per plane: (planes, lowest offset, furthest end),
    # so that a bounds check costs the planes, not the template's rows
    _extent: tuple = attrs.field(init=False, repr=False, default=attrs.Factory(
        lambda self: _template_extremes(self.template), takes_self=True))

    def within(self, src_sizes: np.ndarray, dst_sizes: np.ndarray) -> bool:
        """True when every region (template row + any base) lies inside its planes, from
        the extremes of the template and the bases; destinations are disjoint because the
        template's are (it is checked in full when built) and destination sub-blocks are
        distinct tokens.  False: the caller checks region by region (and names the bad
        one)."""
        for (planes, lo, hi), base, sizes in ((self._extent[0], self.src_base, src_sizes),
                                              (self._extent[1], self.dst_base, dst_sizes)):
            if planes.size and (planes.min() < 0 or planes.max() >= len(sizes)):
                return False
            if np.any((lo + base.min() < 0) | (hi + base.max() > sizes[planes])):
                return False
        return self._distinct

    def check(self, src_sizes: np.ndarray, dst_sizes: np.ndarray,
              field: str = "pattern") -> None:
        """KVABIError (naming ``field``) unless :meth:`within` proves every sub-block
        inside its planes: where a pattern is run without its regions, nothing else
        checks them."""
        if not self.within(src_sizes, dst_sizes):
            raise KVABIError(f"{field}: a sub-block reaches outside its planes")


@attrs.frozen(eq=False)
class GroupedPattern:
    """A whole-block move whose components shift differently per sub-block (vLLM's CPU
    cache: keys step one element per token, values one row): one :class:`BlockPattern`
    per group of components that step alike (:func:`component_groups`), same sub-blocks."""

    parts: tuple

    @property
    def u(self) -> int:
        return self.parts[0].u

    @property
    def src_slots(self) -> np.ndarray:
        return self.parts[0].src_slots

    @property
    def dst_slots(self) -> np.ndarray:
        return self.parts[0].dst_slots

    @property
    def layers(self) -> np.ndarray:
        return self.parts[0].layers

    @property
    def template(self) -> np.ndarray:
        """Every part's template rows (the planes they touch)."""
        return np.concatenate([p.template for p in self.parts])

    def within(self, src_sizes: np.ndarray, dst_sizes: np.ndarray) -> bool:
        """Every part within its planes (:meth:`BlockPattern.within`) and no two parts
        writing one destination byte (distinct components: disjoint by the layout's
        rules)."""
        return all(p.within(src_sizes, dst_sizes) for p in self.parts)

    def check(self, src_sizes: np.ndarray, dst_sizes: np.ndarray,
              field: str = "pattern") -> None:
        if not self.within(src_sizes, dst_sizes):
            raise KVABIError(f"{field}: a sub-block reaches outside its planes")
