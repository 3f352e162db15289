"""Copy plans: the byte regions that move given tokens of given layers from one layout to
another (``specs/transfer.md``).

A plan is data: an int64 array of regions ``(src_plane, src_offset, dst_plane, dst_offset,
nbytes)``, each a contiguous byte range in both layouts holding the same logical elements in
the same order.  It is computed from the two layouts alone, so the same plan serves a local
copy, a host offload and a NIXL READ from another process.

How the regions are found, without a Python loop per token, block or layer:

1. The *atom*: walking both memory orders from the innermost axis, take every axis that is
   the same in both, contiguous with what was taken so far in both, and wholly selected.
   Padding (an extent beyond the size) ends the walk, so a region never spans padding.
   Tokens enter the atom as *runs*: consecutive source slots going to consecutive
   destination slots inside one block of each layout.
2. Enumerate the atoms (runs x the axes not taken) with numpy broadcasting and compute their
   byte offsets in both layouts.
3. Sort by source address and merge neighbours that are contiguous in both layouts: runs of
   adjacent blocks, and for cross-layer layouts (B outermost) all layers of a run of blocks,
   become one region.

Whole blocks (:func:`plan_block_transfer`) take a shortcut: the regions of one sub-block
(``gcd`` of the block sizes), shifted by every sub-block's base offsets, then merged where
sub-blocks meet (:mod:`kvabi.transfer.pattern`).
"""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..layout.descriptor import Layout, check_layout
from ..util.coerce import int_array
from ..util.errors import KVABIError
from ..util.frozen import frozen_array, is_frozen
from .pattern import BlockPattern, GroupedPattern, base_offsets, component_groups, plane_sizes


def _own_regions(r) -> np.ndarray:
    """The plan's own read-only copy of ``r``, after checking what it holds alone (shape,
    type, signs); bounds against planes are checked at each use (:meth:`TransferPlan.check`)."""
    if not (isinstance(r, np.ndarray) and r.dtype == np.int64 and r.ndim == 2
            and r.shape[1] == 5):
        raise KVABIError(f"regions: must be an int64 array [n, 5], got "
                         f"{getattr(r, 'dtype', type(r).__name__)} {getattr(r, 'shape', '')}")
    if is_frozen(r):
        return r  # already immutable (a slice or copy of another plan's regions)
    return frozen_array(r)


@attrs.frozen(eq=False)
class TransferPlan:
    """Byte regions moving tokens from ``src_layout`` to ``dst_layout``.

    ``regions`` is an int64 array [n, 5] of ``(src_plane, src_offset, dst_plane,
    dst_offset, nbytes)``, sorted by source plane and offset; destination ranges never
    overlap.  ``pattern``: for plans of whole blocks, the
    :class:`~kvabi.transfer.pattern.BlockPattern` the regions were broadcast from (their
    bounds proven from it, executed as strided views); ``None`` otherwise, and after
    ``attrs.evolve``.

    A plan is immutable: its attributes cannot be rebound and ``regions`` is a read-only
    copy the plan owns (``specs/security.md``), so what :meth:`check` proves about it
    stays true; the bounds are still checked against the planes at every use.
    """

    regions: np.ndarray = attrs.field(converter=_own_regions)
    src_layout: Layout = attrs.field()
    dst_layout: Layout = attrs.field()
    # whole-block plans: the sub-blocks they move (see BlockPattern); dropped by evolve
    pattern: "BlockPattern | None" = attrs.field(default=None, init=False, repr=False)
    # whether destination ranges are disjoint: a property of the (immutable) regions alone,
    # found once (None: not yet)
    _dst_disjoint: "bool | None" = attrs.field(default=None, init=False, repr=False)

    @src_layout.validator
    @dst_layout.validator
    def _is_layout(self, attribute, value):
        check_layout(value, attribute.name)

    @property
    def nbytes(self) -> int:
        """Bytes the plan moves."""
        return int(self.regions[:, 4].sum())

    def __len__(self) -> int:
        return int(self.regions.shape[0])

    def __repr__(self) -> str:
        return (f"TransferPlan({self.src_layout.name or 'custom'} -> "
                f"{self.dst_layout.name or 'custom'}: {len(self)} regions, {self.nbytes} bytes)")

    def check(self, src_nbytes=None, dst_nbytes=None) -> "TransferPlan":
        """Prove every region lies inside its planes; returns the plan.

        ``src_nbytes``/``dst_nbytes``: the bytes of each plane actually there (one int for
        all planes, or one per plane; default: the layouts' ``plane_nbytes`` and plane
        counts).  Also refuses empty or negative regions and overlapping destination ranges.
        KVABIError names the first bad region.  Nothing is cached by plane sizes: every
        call checks (cost proportional to the regions, or to a whole-block plan's template
        and sub-blocks).
        """
        ss = _sizes(src_nbytes, self.src_layout, "src")
        ds = _sizes(dst_nbytes, self.dst_layout, "dst")
        if self.pattern is not None and self.pattern.within(ss, ds):
            return self  # proven from the template and bases' extremes
        r = self.regions
        _check_side(r[:, 0], r[:, 1], r[:, 4], ss, "src")
        _check_side(r[:, 2], r[:, 3], r[:, 4], ds, "dst")
        if self._dst_disjoint is None:
            _check_disjoint(r)
            object.__setattr__(self, "_dst_disjoint", True)
        return self


def _check_disjoint(r: np.ndarray) -> None:
    if len(r) > 1:
        o = np.lexsort((r[:, 3], r[:, 2]))
        p, off, n = r[o, 2], r[o, 3], r[o, 4]
        bad = np.flatnonzero((p[1:] == p[:-1]) & (off[1:] < off[:-1] + n[:-1]))
        if bad.size:
            i = int(o[bad[0] + 1])
            raise KVABIError(f"regions[{i}]: destination bytes overlap another region "
                             f"(plane {int(r[i, 2])}, offset {int(r[i, 3])})")


def _made(regions, src, dst, pattern=None) -> TransferPlan:
    """A plan built here: its destination ranges are disjoint by construction (distinct
    destination slots)."""
    plan = TransferPlan(regions, src, dst)
    object.__setattr__(plan, "_dst_disjoint", True)
    if pattern is not None:
        object.__setattr__(plan, "pattern", pattern)
    return plan


def _sizes(nbytes, layout: Layout, side: str) -> np.ndarray:
    if nbytes is None:
        return plane_sizes(layout)
    if isinstance(nbytes, (list, tuple, np.ndarray)):
        return int_array(nbytes, f"{side}_nbytes", lo=0)
    return np.full(layout.num_planes, int_array([nbytes], f"{side}_nbytes", lo=0)[0],
                   np.int64)


def _check_side(plane, off, n, sizes, side):
    if not len(plane):
        return
    bad = np.flatnonzero((plane < 0) | (plane >= len(sizes)))
    if bad.size:
        i = int(bad[0])
        raise KVABIError(f"regions[{i}]: {side} plane {int(plane[i])} out of range "
                         f"[0, {len(sizes)})")
    bad = np.flatnonzero(n <= 0)
    if bad.size:
        i = int(bad[0])
        raise KVABIError(f"regions[{i}]: nbytes must be > 0, got {int(n[i])}")
    # off + n cannot overflow: off <= size and n <= size, both below 2**62 in practice;
    # compare without adding to stay exact anyway.  Planes of one size (the common case):
    # a scalar, no gather per region.
    size = sizes[0] if (sizes == sizes[0]).all() else sizes[plane]
    bad = np.flatnonzero((off < 0) | (off > size) | (n > size - off))
    if bad.size:
        i = int(bad[0])
        raise KVABIError(f"regions[{i}]: {side} bytes [{int(off[i])}, {int(off[i]) + int(n[i])})"
                         f" lie outside plane {int(plane[i])} of {int(sizes[plane[i]])} bytes")


def granularity(c, num_heads: int) -> str:
    """How finely component ``c`` of a layout (or head window) of ``num_heads`` heads
    varies, in words: ``per (token, head)``, ``per token``, ``per block``...  In a layout
    of one head a component is per head whether or not it states an ``H`` stride: a scale
    per token of one head is that head's."""
    per_head = c.varies("H") or num_heads == 1
    axes = [a for a, v in (("N", c.varies("N")), ("H", per_head)) if v]
    return "per (" + ", ".join(["token" if a == "N" else "head" for a in axes]) + ")" \
        if len(axes) > 1 else "per token" if axes == ["N"] else \
        "per head of a block" if axes == ["H"] else "per block"


def check_compatible(src: Layout, dst: Layout) -> None:
    """KVABIError naming the difference unless the layouts hold the same per-token data:
    KV heads, and the same components (key/value or an MLA latent, and the same scales),
    each of the same dtype, element count and granularity (a scale per (token, head) is
    not one per (block, head)); block size, block count, layer count and the physical
    arrangement may differ (not the block size where a component is per block)."""
    check_layout(src, "src_layout")
    check_layout(dst, "dst_layout")
    check_token_data(src, dst)


def check_token_data(src: Layout, dst: Layout, side: str = "the source", *,
                     heads: bool = True) -> None:
    """KVABIError naming the difference unless one token of one head holds the same data
    on both sides (dtype, K/V or MLA latent, head dim) and, with ``heads``, the layouts
    hold as many heads; ``side`` names the source in the message.  Without ``heads`` the
    granularity along ``H`` is left to the caller (plans between shardings compare it per
    run of heads: :func:`kvabi.transfer.shards.check_runs`)."""
    if src.dtype != dst.dtype:
        raise KVABIError(f"dst_layout.dtype: {dst.dtype} differs from {side}'s {src.dtype} "
                         "(a plan copies bytes; convert dtypes separately)")
    if src.has_kv != dst.has_kv:
        kind = lambda x: "K/V" if x.has_kv else "MLA latent"  # noqa: E731
        raise KVABIError(f"dst_layout.sizes.KV: the destination holds {kind(dst)}, {side} "
                         f"{kind(src)}")
    for a, what in (("H", "KV heads"), ("D", "head dim"))[0 if heads else 1:]:
        if src.size(a) != dst.size(a):
            raise KVABIError(f"dst_layout.sizes.{a}: {dst.size(a)} {what}, {side} has "
                             f"{src.size(a)}")
    names_s, names_d = set(src.component_names), set(dst.component_names)
    for n in sorted(names_s ^ names_d):
        has, lacks = ("source", "destination") if n in names_s else ("destination", "source")
        raise KVABIError(f"dst_layout.components.{n}: the {has} holds {n}, the {lacks} does "
                         f"not (a plan moves every component; scales are not optional)")
    for n in src.component_names:
        cs, cd = src.component(n), dst.component(n)
        for f in ("dtype", "count"):
            if getattr(cs, f) != getattr(cd, f):
                raise KVABIError(f"dst_layout.components.{n}.{f}: {getattr(cd, f)}, the "
                                 f"source's is {getattr(cs, f)}")
        gs, gd = granularity(cs, src.size("H")), granularity(cd, dst.size("H"))
        if gs != gd and (heads or cs.varies("N") != cd.varies("N")):
            raise KVABIError(f"dst_layout.components.{n}: {gd}, the source's is {gs} "
                             f"(scale granularity differs)")
        if not cs.varies("N") and src.size("N") != dst.size("N"):
            raise KVABIError(f"dst_layout.sizes.N: {n} is {gs}; it moves "
                             f"between equal block sizes only, got {src.size('N')} and "
                             f"{dst.size('N')}")


def _layers(layers, src: Layout, dst: Layout) -> np.ndarray:
    if layers is None:
        if src.num_layers != dst.num_layers:
            raise KVABIError(f"layers: the source has {src.num_layers} layers, the destination "
                             f"{dst.num_layers}; name the layers to move")
        return np.arange(src.num_layers, dtype=np.int64)
    lay = np.unique(int_array(layers, "layers", lo=0))
    for name, x in (("source", src), ("destination", dst)):
        if lay.size and lay[-1] >= x.num_layers:
            raise KVABIError(f"layers: layer {int(lay[-1])} is not in the {name} layout "
                             f"({x.num_layers} layers)")
    return lay


def _slots(x, field, layout: Layout) -> np.ndarray:
    n = layout.num_blocks * layout.size("N")
    return int_array(x, field, lo=0, hi=n - 1)


def _runs(s, t, bs_s, bs_t):
    """Maximal runs of consecutive source slots going to consecutive destination slots,
    inside one block of each layout: (src start, dst start, length), sorted by source."""
    o = np.lexsort((t, s))
    s, t = s[o], t[o]
    brk = np.ones(len(s), bool)
    brk[1:] = ((s[1:] != s[:-1] + 1) | (t[1:] != t[:-1] + 1)
               | (s[1:] % bs_s == 0) | (t[1:] % bs_t == 0))
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.r_[starts, len(s)])
    return s[starts], t[starts], lengths


def _inner_first(c, counts):
    """The in-plane axes of ``c`` with more than one index, innermost first:
    [(axis, stride)]."""
    return sorted(((a, s) for a, s in c.strides.items() if counts[a] > 1),
                  key=lambda x: x[1])


def _atom(cs, cd, counts, lay: np.ndarray, full_blocks: bool):
    """The axes (innermost first) both components hold contiguously in the same order,
    and the bytes of one atom without its tokens."""
    taken, nbytes = [], cs.unit
    for (a, sa), (b, sb) in zip(_inner_first(cs, counts), _inner_first(cd, counts)):
        if a != b or a == "B" or sa != nbytes or sb != nbytes:
            break
        if a == "L" and lay[-1] - lay[0] + 1 != len(lay):  # layers not one range
            break
        taken.append(a)
        if a == "N" and not full_blocks:
            break  # runs of varying length: nothing outside N can join the atom
        nbytes *= counts[a]
    unit = cs.unit * int(np.prod([counts[a] for a in taken if a != "N"], dtype=np.int64))
    return tuple(taken), unit


def _component_regions(src, dst, cs, cd, lay, runs, full):
    """(src plane, src offset, dst plane, dst offset, nbytes) of every atom of one
    component, broadcast over (run, layer, head, element) with numpy."""
    r_s, r_t, r_n = runs
    bs_s, bs_t = src.size("N"), dst.size("N")
    if not cs.varies("N"):  # per-block data: whole blocks only, one record per block
        if not full or bs_s != bs_t:
            raise KVABIError(f"src_slots: {cs.name} is per block; only whole blocks move "
                             f"(between equal block sizes)")
        r_s, r_t, r_n = r_s, r_t, np.ones_like(r_n)
    counts = {"L": len(lay), "N": 1 if not cs.varies("N") else (bs_s if full else 2),
              "H": src.size("H") if cs.varies("H") else 1, "E": cs.units, "B": 2}
    atom, unit = _atom(cs, cd, counts, lay, full)
    if cs.varies("N") and "N" not in atom:  # tokens one at a time
        o = np.argsort(r_s, kind="stable")
        starts_s = np.repeat(r_s[o], r_n[o]) + _ramp(r_n[o])
        starts_t = np.repeat(r_t[o], r_n[o]) + _ramp(r_n[o])
        r_s, r_t, r_n = starts_s, starts_t, np.ones(starts_s.size, np.int64)
    axes = {"L": lay, "H": np.arange(counts["H"]), "E": np.arange(cs.units)}
    names = ("L", "H", "E")
    coords = {}
    for i, a in enumerate(names):
        v = axes[a][:1] if (a in atom or (a == "L" and not cs.varies("L"))) else axes[a]
        shape = [1] * 4
        shape[i + 1] = v.size
        coords[a] = v.reshape(shape)
    run = lambda x: x.reshape(-1, 1, 1, 1)  # noqa: E731
    shape = (r_n.size,) + tuple(coords[a].shape[i + 1] for i, a in enumerate(names))
    nb = np.broadcast_to(run(r_n) * unit if "N" in atom else run(r_n) * 0 + unit,
                         shape).ravel()

    def address(layout, c, slots):
        bsz = layout.size("N")
        idx = dict(coords, B=run(slots // bsz), N=run(slots % bsz))
        off = c.offset + sum((idx[a] * s for a, s in c.strides.items()), np.int64(0))
        ps = c.plane_strides.get("L", 0)
        plane = c.plane + coords["L"] * ps
        return (np.broadcast_to(plane, shape).ravel().astype(np.int64),
                np.broadcast_to(off, shape).ravel().astype(np.int64))

    sp, so = address(src, cs, r_s)
    dp, do = address(dst, cd, r_t)
    return sp, so, dp, do, nb


def _ramp(n: np.ndarray) -> np.ndarray:
    """0..n[i]-1 for each i, concatenated."""
    return np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)


def plan_transfer(src_layout: Layout, dst_layout: Layout, src_slots, dst_slots, *,
                  layers=None, _components=None) -> TransferPlan:
    """The fewest byte regions moving token ``src_slots[i]`` of ``src_layout`` to
    ``dst_slots[i]`` of ``dst_layout`` for every layer of ``layers`` (default: all; they
    must exist in both), every component (values and scales) bit-exact.

    Slots are ``block * block_size + offset`` (equal-length integer arrays; destination
    slots distinct).  Padding bytes are never read into real data nor written.  KVABIError
    for layouts that hold different data, slots out of range, or bad types.
    """
    src, dst = src_layout, dst_layout
    check_compatible(src, dst)
    s = _slots(src_slots, "src_slots", src)
    t = _slots(dst_slots, "dst_slots", dst)
    if s.shape != t.shape:
        raise KVABIError(f"dst_slots: {t.size} slots, but src_slots has {s.size}")
    if t.size and np.unique(t).size != t.size:
        u, c = np.unique(t, return_counts=True)
        raise KVABIError(f"dst_slots: slot {int(u[c > 1][0])} appears twice (a destination "
                         "byte would be written twice)")
    lay = _layers(layers, src, dst)
    empty = np.zeros((0, 5), np.int64)
    if not s.size or not lay.size:
        return _made(empty, src, dst)
    bs_s, bs_t = src.size("N"), dst.size("N")
    runs = _runs(s, t, bs_s, bs_t)
    full = bs_s == bs_t and bool(np.all(runs[2] == bs_s))
    names = src.component_names if _components is None else _components
    parts = [_component_regions(src, dst, src.component(n), dst.component(n), lay, runs, full)
             for n in names]
    cols = [np.concatenate([p[i] for p in parts]) for i in range(5)]
    return _made(merge_regions(*cols, src.plane_nbytes), src, dst)


def merge_regions(sp, so, dp, do, nb, src_plane_nbytes: int) -> np.ndarray:
    """Sort atoms by source address and merge neighbours contiguous in both layouts."""
    key = sp * np.int64(src_plane_nbytes) + so
    if key.size > 1 and np.any(key[1:] < key[:-1]):
        o = np.argsort(key, kind="stable")
        sp, so, dp, do, nb = sp[o], so[o], dp[o], do[o], nb[o]
    new = np.ones(sp.size, bool)
    new[1:] = ((sp[1:] != sp[:-1]) | (dp[1:] != dp[:-1])
               | (so[1:] != so[:-1] + nb[:-1]) | (do[1:] != do[:-1] + nb[:-1]))
    if new.all():  # nothing merges (relayouts): no reduction
        return np.stack([sp, so, dp, do, nb], axis=1).astype(np.int64, copy=False)
    starts = np.flatnonzero(new)
    return np.stack([sp[starts], so[starts], dp[starts], do[starts],
                     np.add.reduceat(nb, starts)], axis=1).astype(np.int64)


def plan_block_transfer(src_layout: Layout, dst_layout: Layout, src_blocks, dst_blocks, *,
                        layers=None) -> TransferPlan:
    """The plan moving the tokens of ``src_blocks`` (in order) to those of ``dst_blocks``:
    block ``src_blocks[i]`` to ``dst_blocks[i]`` when block sizes match; with different
    block sizes the token sequences must have the same length.

    The same plan as :func:`plan_transfer` of those tokens, built from the regions of one
    sub-block (``gcd`` of the block sizes) broadcast over the others (see
    :mod:`kvabi.transfer.pattern`): planning the bench's relayout (a million regions)
    takes ~45 ms instead of ~240 ms, and the plan carries that structure for :func:`execute`."""
    sb = int_array(src_blocks, "src_blocks", lo=0, hi=src_layout.num_blocks - 1) \
        if isinstance(src_layout, Layout) else src_blocks
    db = int_array(dst_blocks, "dst_blocks", lo=0, hi=dst_layout.num_blocks - 1) \
        if isinstance(dst_layout, Layout) else dst_blocks
    check_compatible(src_layout, dst_layout)
    bs_s, bs_t = src_layout.size("N"), dst_layout.size("N")
    if sb.ndim != 1 or db.ndim != 1:
        raise KVABIError(f"src_blocks/dst_blocks: must be 1-D, got {sb.ndim}-D and {db.ndim}-D")
    if sb.size * bs_s != db.size * bs_t:
        raise KVABIError(f"dst_blocks: {db.size} blocks of {bs_t} tokens do not hold the "
                         f"{sb.size} source blocks of {bs_s} tokens")
    ud, cd = np.unique(db, return_counts=True)
    if ud.size != db.size:
        raise KVABIError(f"dst_blocks: block {int(ud[cd > 1][0])} appears twice (a "
                         "destination byte would be written twice)")
    if not sb.size or np.unique(sb).size != sb.size:
        # nothing to move, or repeated sources (merging and order depend on the repeats):
        # the general path
        s = (sb[:, None] * bs_s + np.arange(bs_s)).ravel()
        t = (db[:, None] * bs_t + np.arange(bs_t)).ravel()
        return plan_transfer(src_layout, dst_layout, s, t, layers=layers)
    lay = _layers(layers, src_layout, dst_layout)
    if not lay.size:
        return _made(np.zeros((0, 5), np.int64), src_layout, dst_layout)
    return plan_from_template(src_layout, dst_layout, sb, db,
                              block_template(src_layout, dst_layout, lay), lay)


def plan_from_template(src: Layout, dst: Layout, src_blocks: np.ndarray,
                       dst_blocks: np.ndarray, template, layers: np.ndarray) -> TransferPlan:
    """:func:`plan_block_transfer` of validated blocks given the ``template`` of
    :func:`block_template` for ``layers`` (callers moving blocks between the same two
    layouts again keep it)."""
    pattern = block_pattern(src, dst, src_blocks, dst_blocks, template, layers)
    parts = pattern.parts if isinstance(pattern, GroupedPattern) else (pattern,)
    got = [_broadcast(p.template, p.src_base, p.dst_base, src.plane_nbytes) for p in parts]
    regions = got[0] if len(got) == 1 else merge_regions(*np.concatenate(got).T,
                                                         src.plane_nbytes)
    return _made(regions, src, dst, pattern)


def block_template(src: Layout, dst: Layout, layers: np.ndarray) -> tuple:
    """The regions of one sub-block (``gcd`` of the block sizes) of ``layers``, relative to
    its bases: those of the sub-block at slot 0 of both layouts (bases 0), checked in full;
    one ``(component names, regions)`` per group of components that shift alike per
    sub-block (one group for every axis-form layout).  The same for every sub-block (both
    layouts address bytes affinely), so callers that move blocks between the same two
    layouts again may keep it."""
    u = math.gcd(src.size("N"), dst.size("N"))
    out = []
    for names in component_groups(src, dst, u).values():
        one = plan_transfer(src, dst, np.arange(u), np.arange(u), layers=layers,
                            _components=names).check()
        out.append((names, one.regions))
    return tuple(out)


def block_pattern(src: Layout, dst: Layout, src_blocks: np.ndarray, dst_blocks: np.ndarray,
                  template, layers: np.ndarray):
    """The pattern of moving ``src_blocks`` to ``dst_blocks`` (validated int64 arrays
    holding the same number of tokens, destinations distinct) with ``template`` from
    :func:`block_template` for ``layers``: a :class:`BlockPattern`, or a
    :class:`GroupedPattern` where components shift differently."""
    bs_s, bs_t = src.size("N"), dst.size("N")
    u = math.gcd(bs_s, bs_t)
    ss = (src_blocks[:, None] * bs_s + np.arange(0, bs_s, u)).ravel()  # sub-block starts
    ts = (dst_blocks[:, None] * bs_t + np.arange(0, bs_t, u)).ravel()
    groups = {names: key for key, names in component_groups(src, dst, u).items()}
    parts = []
    for names, t in template:
        k_s, k_t = groups[names]
        parts.append(BlockPattern(u, ss, ts, layers, t, base_offsets(src, ss, u, k_s),
                                  base_offsets(dst, ts, u, k_t),
                                  None if len(template) == 1 else names))
    return parts[0] if len(parts) == 1 else GroupedPattern(tuple(parts))


def _broadcast(t, base_s, base_t, src_plane_nbytes: int) -> np.ndarray:
    """Every sub-block's regions, merged and sorted: the template ``t`` (rows sorted by
    source plane, then offset) shifted by each sub-block's bases.

    Rows are laid out source plane by source plane, sub-blocks in source order, as chunks
    of template rows.  Inside a chunk rows are sorted and maximal (the template is a plan),
    so only the rows where a chunk starts can be out of order or merge with the row
    before: those few are checked, and the general sort-and-merge runs only when needed."""
    o = np.argsort(base_s, kind="stable")
    bs, bt = base_s[o], base_t[o]
    m, n = bs.size, len(t)
    first = np.r_[0, np.flatnonzero(t[1:, 0] != t[:-1, 0]) + 1]  # first row of each plane
    size = np.diff(np.r_[first, n])
    if not np.all(size == size[0]):  # planes with different row counts: the general path
        pos = (m * first[np.repeat(np.arange(first.size), size)]
               + np.arange(n) - np.repeat(first, size))[None, :] \
            + np.arange(m)[:, None] * np.repeat(size, size)
        cols = [np.empty(m * n, np.int64) for _ in range(5)]
        for k, base in ((0, None), (1, bs), (2, None), (3, bt), (4, None)):
            v = t[:, k][None, :] if base is None else t[:, k][None, :] + base[:, None]
            cols[k][pos.ravel()] = np.broadcast_to(v, (m, n)).ravel()
        return merge_regions(*cols, src_plane_nbytes)
    g, c = first.size, int(size[0])
    out = np.empty((g, m, c, 5), np.int64)
    tt = t.reshape(g, 1, c, 5)
    for k in (0, 2, 4):
        out[..., k] = tt[..., k]
    np.add(tt[..., 1], bs.reshape(1, m, 1), out=out[..., 1])
    np.add(tt[..., 3], bt.reshape(1, m, 1), out=out[..., 3])
    r = out.reshape(-1, 5)
    # Rows starting a chunk (but the first) and the rows before them.
    head = (np.arange(g)[:, None] * m + np.arange(m)[None, :]).ravel()[1:] * c
    a, b = r[head - 1], r[head]
    if np.any((b[:, 0] < a[:, 0]) | ((b[:, 0] == a[:, 0]) & (b[:, 1] < a[:, 1]))):
        return merge_regions(*r.T, src_plane_nbytes)  # sub-blocks interleave: sort
    join = ((b[:, 0] == a[:, 0]) & (b[:, 2] == a[:, 2]) & (b[:, 1] == a[:, 1] + a[:, 4])
            & (b[:, 3] == a[:, 3] + a[:, 4]))
    if not join.any():
        return r
    new = np.ones(len(r), bool)
    new[head[join]] = False
    if c > 1:  # a chunk head joins the previous chunk's last row, itself never a head
        r[head[join] - 1, 4] += r[head[join], 4]
        return r[new]
    starts = np.flatnonzero(new)  # chains of one-row chunks
    out = r[starts]
    out[:, 4] = np.add.reduceat(r[:, 4], starts)
    return out
