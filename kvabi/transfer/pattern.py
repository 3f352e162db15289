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

import attrs
import numpy as np

from ..frozen import frozen_array, is_frozen
from ..layout import Layout


def base_offsets(layout: Layout, slots: np.ndarray) -> np.ndarray:
    """Byte offset of token ``slots`` (layer 0, kv 0, head 0, dim 0 excluded: only the block
    and in-block token terms)."""
    bs = layout.size("N")
    return (slots // bs) * layout.stride("B") + (slots % bs) * layout.stride("N")


def _int64(a) -> np.ndarray:
    """The pattern's own read-only int64 copy (a pattern is immutable: what a check proved
    about it stays true)."""
    if isinstance(a, np.ndarray) and a.dtype == np.int64 and is_frozen(a):
        return a
    return frozen_array(a, np.int64)


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
    # destination sub-blocks distinct: a property of the (immutable) slots, found once
    _distinct: bool = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        object.__setattr__(self, "_distinct",
                           bool(np.unique(self.dst_slots).size == self.dst_slots.size))

    def within(self, src_sizes: np.ndarray, dst_sizes: np.ndarray) -> bool:
        """True when every region (template row + any base) lies inside its planes, from
        the extremes of the template and the bases; destinations are disjoint because the
        template's are (it is checked in full when built) and destination sub-blocks are
        distinct tokens.  False: the caller checks region by region (and names the bad
        one)."""
        t = self.template
        for p, rel, base, sizes in ((t[:, 0], t[:, 1], self.src_base, src_sizes),
                                    (t[:, 2], t[:, 3], self.dst_base, dst_sizes)):
            if p.min() < 0 or p.max() >= len(sizes):
                return False
            if np.any((rel + base.min() < 0) | (rel + t[:, 4] + base.max() > sizes[p])):
                return False
        return self._distinct
