"""Staged pulls: a relayout over a transfer engine at the engine's speed.

A relayout plan has many small regions (down to one head of one token), and a transfer
engine pays per descriptor: posting them as they are moves a few percent of what one large
READ moves.  A staged pull instead READs the source bytes *in the source's own byte order*
into a registered staging buffer, as a few large *spans* (the plan's source regions, sorted,
joined where they touch or lie less than :data:`GAP` bytes apart), then relayouts locally
from the staging buffer into the destination (:func:`~kvabi.transfer.execute` machinery:
strided boxes and vectorized gathers).

Every span is the union of plan regions and the gaps between two of them on one plane, so
it lies inside the source planes whenever the regions do (checked before anything is
posted); the staging offsets are laid out here and lie inside the buffer by construction.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..util.errors import KVABIError
from .pattern import BlockPattern, GroupedPattern, base_offsets, component_strides
from .plan import TransferPlan, block_template, plan_from_template

#: regions of one source plane less than this many bytes apart are read as one span (the
#: bytes between are read and never used): below a descriptor's cost at loopback speed
GAP = 4 << 10
#: staging offsets of spans are aligned to this many bytes (copies from aligned rows)
ALIGN = 64
#: templates an agent keeps for staged whole-block pulls (one per layout pair)
TEMPLATES = 8
#: a plan whose regions average fewer bytes than this is pulled staged by default
STAGE_BELOW = 64 << 10


@attrs.frozen(eq=False)
class Staging:
    """How a plan is pulled staged (transient, never handed out): ``spans`` [k, 3] of
    (source plane, source offset, nbytes) READ to staging offsets ``at`` [k]; then
    ``local`` [n, 5] regions copy from the staging buffer (plane 0) to the destination;
    ``nbytes``: staging bytes needed."""

    spans: np.ndarray
    at: np.ndarray
    local: np.ndarray
    nbytes: int


@attrs.frozen(eq=False)
class BlockStaging:
    """A whole-block plan pulled staged: the source blocks it touches READ, in the source
    layout's byte order, into ``layout`` (the source layout holding just those blocks, planes
    one after another in the staging buffer) by the regions of ``pull``; then ``local``,
    the plan's pattern re-based on the staging blocks, copies them as strided views."""

    layout: Layout
    pull: TransferPlan
    local: "BlockPattern | GroupedPattern"

    @property
    def nbytes(self) -> int:
        return self.layout.num_planes * self.layout.plane_nbytes


def _template(templates: list, src: Layout, dst: Layout, layers: np.ndarray) -> tuple:
    """The block template of ``src`` -> ``dst`` for ``layers``, kept in ``templates`` (a
    list, newest first; layouts compare by identity first, then by value)."""
    key = layers.tobytes()
    for same in (lambda x, y: x is y, lambda x, y: x == y):
        for s_, d_, k_, t in templates:
            if same(s_, src) and same(d_, dst) and k_ == key:
                return t
    t = block_template(src, dst, layers)
    templates.insert(0, (src, dst, key, t))
    del templates[TEMPLATES:]
    return t


def cut_layout(src: Layout, n: int):
    """``src`` holding ``n`` blocks, in its own byte order, or None where that cannot be
    stated.  Axis form: its sizes with ``B`` = n.  Component form: each component keeps its
    strides inside a block; the axes outside ``B`` are nested anew, densely, over ``n``
    blocks (refused, None, where the result is not a valid layout)."""
    try:
        if src.is_axis_form:
            return attrs.evolve(src, sizes={**src.sizes, "B": n}, name=None)
        sizes = {**src.sizes, "B": n}
        comps = []
        for c in src.components:
            outer = sorted((a for a, st in c.strides.items()
                            if a != "E" and st > c.strides["B"]), key=lambda a: c.strides[a])
            strides, step = dict(c.strides), c.strides["B"] * n
            for a in outer:
                strides[a] = step
                step *= sizes.get(a, 1)
            comps.append(attrs.evolve(c, strides=strides))
        return Layout(sizes=sizes, components=comps)
    except KVABIError:
        return None


def stage_blocks(pat, src: Layout, dst: Layout, templates: list) -> BlockStaging | None:
    """The staged pull of the whole-block move ``pat`` (a BlockPattern or GroupedPattern)
    from ``src`` to ``dst``; None when the source layout cannot be cut down to the blocks
    touched (then stage its regions).  ``templates``: the caller's list of templates kept
    (see :func:`_template`)."""
    bs = src.size("N")
    blocks, inv = np.unique(pat.src_slots // bs, return_inverse=True)
    lay = cut_layout(src, int(blocks.size))
    if lay is None or lay.num_planes != src.num_planes:
        return None
    slots = inv.reshape(-1) * bs + pat.src_slots % bs
    pull = plan_from_template(src, lay, blocks, np.arange(blocks.size),
                              _template(templates, src, lay, pat.layers), pat.layers)
    parts = getattr(pat, "parts", (pat,))
    same = src.is_axis_form and all(lay.stride(a) == src.stride(a) for a in lay.order
                                    if a != "B")
    tmpl = {p.components: p.template for p in parts} if same else \
        {names if len(parts) > 1 else None: t
         for names, t in _template(templates, lay, dst, pat.layers)}
    local = []
    for p in parts:
        k = component_strides(lay, p.components[0], p.u) if p.components else None
        local.append(BlockPattern(p.u, slots, p.dst_slots, p.layers, tmpl[p.components],
                                  base_offsets(lay, slots, p.u, k), p.dst_base,
                                  p.components))
    return BlockStaging(lay, pull, local[0] if len(local) == 1 else GroupedPattern(tuple(local)))


def worth_staging(regions: np.ndarray) -> bool:
    """Whether a staged pull may pay: many regions of a few KiB or less each (a plan
    whose regions average :data:`STAGE_BELOW` bytes or more is pulled direct)."""
    n = len(regions)
    return n > 1 and int(regions[:, 4].sum()) < STAGE_BELOW * n


def staging_pays(regions: int, descriptors: int, read_bytes: int) -> bool:
    """Whether a staged pull of a plan of ``regions`` regions, READ as ``descriptors``
    descriptors of ``read_bytes`` bytes in all, costs less than its direct pull.  A
    descriptor costs about as much as moving :data:`STAGE_BELOW` bytes, and the staged
    pull moves its bytes once more (the local relayout): it pays when the descriptors it
    saves cost more than the bytes it reads.  Not where every region is a span of its own
    (a head slice of every block of a larger source shard: the same descriptors and a
    relayout more)."""
    return (regions - descriptors) * STAGE_BELOW > read_bytes


def stage(regions: np.ndarray) -> Staging:
    """The spans and local regions of a staged pull of ``regions`` (a checked plan's)."""
    r = regions
    if len(r) > 1 and np.any((r[1:, 0] < r[:-1, 0])
                             | ((r[1:, 0] == r[:-1, 0]) & (r[1:, 1] < r[:-1, 1]))):
        r = r[np.lexsort((r[:, 1], r[:, 0]))]
    sp, so, n = r[:, 0], r[:, 1], r[:, 4]
    end = so + n
    new = np.ones(len(r), bool)
    if len(r) > 1:
        # the furthest byte reached so far on this plane (repeated source slots overlap)
        plane_start = np.r_[True, sp[1:] != sp[:-1]]
        reach = end.copy()
        starts = np.flatnonzero(plane_start)
        for a, b in zip(starts.tolist(), np.r_[starts[1:], len(r)].tolist()):
            np.maximum.accumulate(reach[a:b], out=reach[a:b])
        new[1:] = plane_start[1:] | (so[1:] - reach[:-1] > GAP)
    else:
        reach = end
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(r)] - 1
    s_off, s_len = so[first], reach[last] - so[first]
    padded = (s_len + ALIGN - 1) // ALIGN * ALIGN
    at = np.cumsum(padded) - padded
    sid = np.cumsum(new) - 1
    local = np.stack([np.zeros(len(r), np.int64), at[sid] + so - s_off[sid], r[:, 2],
                      r[:, 3], n], axis=1)
    spans = np.stack([sp[first], s_off, s_len], axis=1)
    return Staging(spans, at, local, int(padded.sum()))
