"""Plans between shardings: a request's KV from the M ranks of one tensor-parallel engine to
the ranks of another, of any TP size the heads allow (``specs/transfer.md``, *Between
shardings*).

Each destination rank needs its shard's global heads.  For each it picks one source rank
that holds the head (:func:`assign`): a destination reads from one source wherever one holds
all its heads (replicated heads, MLA, a larger source shard), and destinations that could
read from several replicas are spread over them by rank.  The heads then form *runs*:
consecutive local heads of the destination read from consecutive local heads of one source.
A run is planned with the per-pair planner (:mod:`kvabi.transfer.plan`) on *head windows*
of the two layouts (the same strides, ``sizes.H`` cut to the run, addressed from the run's
first head; affine addressing makes a window's plan the full layouts' plan shifted by the
first head's byte offset), so layouts, block sizes and slots may differ on the two sides
exactly as between unsharded caches.

Component layouts (keys placed apart from values, scale components, vLLM's CPU cache) are
cut the same way, each component by its own ``H`` stride, so scales travel with their heads.
A component that does not vary along ``H`` while its layout holds several heads (one record
shared by all heads of a rank) is copied whole from the one source the destination reads;
it cannot be assembled from several sources (:func:`check_runs`).

Everything the math does not allow is refused by field before any plan exists: ranks
swapped, missing, or holding other heads than their rank's split; a head no source holds;
another model's head count, dtype, head dim or K/V form; another quantization (components,
their dtypes, counts and granularity); a shared component whose destination reads several
sources; sources of different block sizes.
"""
from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ..layout.descriptor import Layout, check_layout
from ..model.shard import Shard, check_group, shard_of
from ..util.errors import KVABIError
from .execute import execute
from .plan import (TransferPlan, _made, check_token_data, granularity, merge_regions,
                   plan_block_transfer, plan_transfer)


@attrs.frozen
class HeadRun:
    """``count`` consecutive local heads of the destination from ``dst_first`` on, read from
    local heads ``src_first ...`` of source rank ``source``."""

    source: int
    src_first: int
    dst_first: int
    count: int


@attrs.frozen(eq=False)
class ShardPlan:
    """The reads of one destination rank: per source rank it reads from, one
    :class:`~kvabi.transfer.TransferPlan` (source: that rank's layout) writing disjoint
    bytes of ``dst_layout``.  ``runs``: which heads come from where."""

    src_layouts: tuple = attrs.field()
    dst_layout: Layout = attrs.field()
    parts: tuple = attrs.field()  # ((source index, TransferPlan), ...) by source index
    runs: tuple = attrs.field()

    @property
    def sources(self) -> tuple[int, ...]:
        """The source ranks read, in order."""
        return tuple(i for i, _ in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for _, p in self.parts)

    def __len__(self) -> int:
        """Regions over all parts."""
        return sum(len(p) for _, p in self.parts)

    def __repr__(self) -> str:
        return (f"ShardPlan(ranks {list(self.sources)} -> {self.dst_layout.name or 'custom'} "
                f"{list(shard_of(self.dst_layout).heads)}: {len(self)} regions, "
                f"{self.nbytes} bytes)")


def head_window(layout: Layout, first: int, count: int) -> tuple[Layout, int]:
    """(``layout`` cut to local heads ``first .. first + count - 1``, byte shift): a layout
    of ``count`` heads whose element (.., h, ..) lies at its own (plane, offset) plus the
    shift in ``layout``'s planes.

    Axis form: the same strides and ``sizes.H = count``, the shift ``first * stride(H)``
    (folds and packing, which move no byte, are dropped; the window's planes end where
    ``layout``'s do).  Component form: every component that varies along ``H`` starts
    ``first`` heads further on (its own ``H`` stride: keys, values and their scales each
    by theirs), the others are unchanged, the planes are ``layout``'s; the shift is 0."""
    if first == 0 and count == layout.size("H"):
        return layout, 0
    if not layout.is_axis_form:
        comps = [attrs.evolve(c, offset=c.offset + first * c.strides["H"])
                 if "H" in c.strides else c for c in layout.components]
        win = Layout(sizes={**layout.sizes, "H": count}, components=comps,
                     plane_bytes=layout.plane_nbytes if layout.uniform_planes else
                     layout.plane_sizes)
        return win, 0
    shift = first * layout.stride("H")
    ext = {a: v for a, v in (layout.extents or {}).items() if a != "H"}
    win = Layout(order=layout.order, sizes={**layout.sizes, "H": count}, dtype=layout.dtype,
                 planes=layout.planes, extents=ext or None,
                 strides={a: layout.stride(a) for a in layout.order},
                 plane_bytes=layout.plane_nbytes - shift)
    return win, shift


def assign(sources: Sequence[Shard], dst: Shard) -> tuple[HeadRun, ...]:
    """Which source rank each of ``dst``'s heads is read from, as runs.

    A source holding every head of ``dst`` is read alone (the ``dst.rank % k``-th of the
    ``k`` that do, spreading destinations over replicas); otherwise each head comes from
    the source of the previous head when it holds it, else from the ``dst.rank % k``-th of
    its ``k`` holders.  KVABIError naming the head when no source holds it."""
    where = {}  # global head -> [(source, local index)]
    for i, s in enumerate(sources):
        for j, h in enumerate(s.heads):
            where.setdefault(h, []).append((i, j))
    for h in dst.heads:
        if h not in where:
            raise KVABIError(f"dst_layout.shard.heads: global head {h} is held by no source "
                             f"rank")
    whole = [i for i, s in enumerate(sources) if set(dst.heads) <= set(s.heads)]
    pick = []
    if whole:
        i = whole[dst.rank % len(whole)]
        pick = [(i, sources[i].heads.index(h)) for h in dst.heads]
    else:
        prev = None
        for h in dst.heads:
            cands = where[h]
            same = [c for c in cands if prev is not None and c[0] == prev]
            c = same[0] if same else cands[dst.rank % len(cands)]
            pick.append(c)
            prev = c[0]
    runs = []
    for k, (i, j) in enumerate(pick):
        r = runs[-1] if runs else None
        if r is not None and r.source == i and r.src_first + r.count == j:
            runs[-1] = attrs.evolve(r, count=r.count + 1)
        else:
            runs.append(HeadRun(i, j, k, 1))
    return tuple(runs)


def shared_components(layout: Layout) -> tuple[str, ...]:
    """The components of ``layout`` that hold one record for all its heads: those that do
    not vary along ``H`` in a layout of more than one head (none where it holds one)."""
    if layout.size("H") == 1:
        return ()
    return tuple(c.name for c in layout.components if not c.varies("H"))


def run_problems(src_layouts, dst_layout: Layout, runs) -> list[tuple[str, str]]:
    """``(component name, why)`` for each component the runs of heads cannot move (see
    :func:`check_runs`); empty when every run can be planned on head windows."""
    out = []
    shared = shared_components(dst_layout)
    if shared and len(runs) > 1:
        srcs = sorted({r.source for r in runs})
        out += [(n, f"one record for all {dst_layout.size('H')} heads of the destination "
                    f"(it does not vary along H), whose heads are read from source ranks "
                    f"{srcs} in {len(runs)} runs; a record shared by heads is copied from "
                    f"one source holding all of them, never assembled from several")
                for n in shared]
    for r in runs:
        src = src_layouts[r.source]
        for cd in dst_layout.components:
            cs = src.component(cd.name)
            gs, gd = granularity(cs, r.count), granularity(cd, r.count)  # the windows
            if gs != gd and cd.name not in {n for n, _ in out}:
                out.append((cd.name, f"{gd} on the destination's heads {r.dst_first}.."
                                     f"{r.dst_first + r.count - 1}, {gs} on those of "
                                     f"src_layouts[{r.source}] (scale granularity differs)"))
    return out


def check_runs(src_layouts, dst_layout: Layout, runs) -> None:
    """KVABIError naming ``dst_layout.components.<name>`` unless every run of heads can
    be planned on head windows: each component has one granularity on both windows (a
    scale per (token, head) on one side is not a scale shared by several heads on the
    other; in a window of one head both are that head's), and a component shared by the
    destination's heads (:func:`shared_components`) comes from one run of one source
    (each source's record covers its own heads: records of other heads are not split or
    merged into one)."""
    bad = run_problems(src_layouts, dst_layout, runs)
    if bad:
        raise KVABIError(f"dst_layout.components.{bad[0][0]}: {bad[0][1]}")


def _check(src_layouts, dst_layout: Layout, standard: bool):
    """The checked sources (a tuple) and their shards, and the destination's shard."""
    if isinstance(src_layouts, Layout) or not isinstance(src_layouts, Sequence) or \
            isinstance(src_layouts, (str, bytes)):
        raise KVABIError(f"src_layouts: must be a list of Layouts, one per source rank, got "
                         f"{type(src_layouts).__name__}")
    srcs = tuple(check_layout(s, f"src_layouts[{i}]") for i, s in enumerate(src_layouts))
    check_layout(dst_layout, "dst_layout")
    if not srcs:
        raise KVABIError("src_layouts: no source ranks")
    shards = check_group([shard_of(s) for s in srcs], "src_layouts", standard=standard)
    dst = shard_of(dst_layout)
    if dst.of != shards[0].of:
        raise KVABIError(f"dst_layout.shard.of: {dst.of} KV heads in the model, the sources "
                         f"say {shards[0].of}")
    if standard and not dst.is_standard:
        raise KVABIError(f"dst_layout.shard.heads: rank {dst.rank} of {dst.ranks} does not "
                         f"hold {list(dst.heads)} in the tensor-parallel split")
    first = srcs[0]
    for i, s in enumerate(srcs):
        for a, what in (("N", "block size"), ("B", "block count")):
            if s.size(a) != first.size(a):
                raise KVABIError(f"src_layouts[{i}].sizes.{a}: {s.size(a)}, rank 0 has "
                                 f"{first.size(a)} (the ranks of one engine share the "
                                 f"{what}: one block table)")
        check_token_data(s, dst_layout, f"src_layouts[{i}]", heads=False)
    return srcs, shards, dst


def _plan(srcs, dst_layout, runs, make) -> tuple:
    """Per source read: the runs' plans on head windows, shifted and merged."""
    check_runs(srcs, dst_layout, runs)
    parts = []
    for i in sorted({r.source for r in runs}):
        src = srcs[i]
        mine = [r for r in runs if r.source == i]
        if len(mine) == 1 and mine[0].count == src.size("H") == dst_layout.size("H"):
            parts.append((i, make(src, dst_layout)))  # whole caches: the plain plan
            continue
        pieces = []
        for r in mine:
            sw, s_shift = head_window(src, r.src_first, r.count)
            dw, d_shift = head_window(dst_layout, r.dst_first, r.count)
            reg = make(sw, dw).regions
            pieces.append(reg + np.array([0, s_shift, 0, d_shift, 0], np.int64))
        r = np.concatenate(pieces) if pieces else np.zeros((0, 5), np.int64)
        merged = merge_regions(*r.T, src.plane_nbytes) if len(r) else r
        # runs write distinct destination heads, each plan distinct slots: disjoint
        parts.append((i, _made(merged, src, dst_layout)))
    return tuple(parts)


def plan_shard_transfer(src_layouts, dst_layout: Layout, src_slots, dst_slots, *,
                        layers=None, standard: bool = True) -> ShardPlan:
    """The reads moving token ``src_slots[i]`` of every source rank (``src_layouts``, one
    tensor-parallel engine in rank order: one block table) to ``dst_slots[i]`` of
    ``dst_layout`` (one rank of another), for the heads ``dst_layout`` holds.

    ``standard``: the shards must be the tensor-parallel split of their ranks
    (:meth:`Shard.tp <kvabi.model.shard.Shard.tp>`), which is how a peer that lies about its
    heads is caught; without it any shards that together hold every head are accepted.
    KVABIError naming the field for anything the heads do not allow, before any plan."""
    srcs, shards, dst = _check(src_layouts, dst_layout, standard)
    runs = assign(shards, dst)
    parts = _plan(srcs, dst_layout, runs, lambda s, d: plan_transfer(
        s, d, src_slots, dst_slots, layers=layers))
    return ShardPlan(srcs, dst_layout, parts, runs)


def plan_shard_block_transfer(src_layouts, dst_layout: Layout, src_blocks, dst_blocks, *,
                              layers=None, standard: bool = True) -> ShardPlan:
    """:func:`plan_shard_transfer` of whole blocks (the tokens of ``src_blocks`` in order to
    those of ``dst_blocks``, as :func:`~kvabi.transfer.plan_block_transfer`)."""
    srcs, shards, dst = _check(src_layouts, dst_layout, standard)
    runs = assign(shards, dst)
    parts = _plan(srcs, dst_layout, runs, lambda s, d: plan_block_transfer(
        s, d, src_blocks, dst_blocks, layers=layers))
    return ShardPlan(srcs, dst_layout, parts, runs)


def plan_tp_transfer(src_layouts, dst_layouts, src_blocks, dst_blocks, *, layers=None,
                     standard: bool = True) -> tuple[ShardPlan, ...]:
    """Whole blocks from every rank of one engine to every rank of another: one
    :class:`ShardPlan` per destination rank (``dst_layouts`` in rank order, checked as a
    group like the sources)."""
    if isinstance(dst_layouts, Layout) or not isinstance(dst_layouts, Sequence):
        raise KVABIError(f"dst_layouts: must be a list of Layouts, one per destination rank, "
                         f"got {type(dst_layouts).__name__}")
    dsts = tuple(check_layout(d, f"dst_layouts[{i}]") for i, d in enumerate(dst_layouts))
    check_group([shard_of(d) for d in dsts], "dst_layouts", standard=standard)
    return tuple(plan_shard_block_transfer(src_layouts, d, src_blocks, dst_blocks,
                                           layers=layers, standard=standard) for d in dsts)


def execute_shards(plan: ShardPlan, srcs, dst):
    """Run a :class:`ShardPlan` locally: ``srcs`` the source ranks' caches (KVCache handles
    or plane lists, in rank order), ``dst`` the destination's.  Each part is a checked
    :func:`~kvabi.transfer.execute`; the destination (a new handle for jax) is returned."""
    if not isinstance(plan, ShardPlan):
        raise KVABIError(f"plan: must be a ShardPlan, got {type(plan).__name__}")
    if isinstance(srcs, (str, bytes)) or not isinstance(srcs, Sequence) or \
            len(srcs) != len(plan.src_layouts):
        raise KVABIError(f"srcs: one cache per source rank ({len(plan.src_layouts)}), got "
                         f"{len(srcs) if isinstance(srcs, Sequence) else type(srcs).__name__}")
    for i, part in plan.parts:
        dst = execute(part, srcs[i], dst)
    return dst
