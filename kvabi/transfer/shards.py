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

Everything the math does not allow is refused by field before any plan exists: ranks
swapped, missing, or holding other heads than their rank's split; a head no source holds;
another model's head count, dtype, head dim or K/V form; sources of different block sizes.
Layouts in the component form (keys and values placed apart, scale components, vLLM's CPU
cache) are refused (:func:`check_axis_form`): head windows are cut on the axis form's one
``H`` stride, and a component layout's scales would need windows of their own.
"""
from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ..errors import KVABIError
from ..layout import Layout, check_layout
from ..shard import Shard, check_group, shard_of
from .execute import execute
from .plan import (TransferPlan, _made, check_token_data, merge_regions, plan_block_transfer,
                   plan_transfer)


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
    with the same strides and ``sizes.H = count``, whose element (.., h, ..) lies at its
    own offset plus the shift in ``layout``'s planes.  Folds and packing (which move no
    byte) are dropped; the window's planes end where ``layout``'s do."""
    if first == 0 and count == layout.size("H"):
        return layout, 0
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


def check_axis_form(layout: Layout, field: str) -> None:
    """KVABIError naming ``field.components`` unless ``layout`` is in the axis form: plans
    between shardings do not yet cut component layouts (scales included) into heads."""
    if not layout.is_axis_form:
        raise KVABIError(f"{field}.components: a component layout "
                         f"({', '.join(layout.component_names)}); plans between shardings "
                         f"take the axis form only (scale components and keys placed apart "
                         f"from values are not cut into heads yet)")


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
    for i, s in enumerate(srcs):
        check_axis_form(s, f"src_layouts[{i}]")
    check_axis_form(dst_layout, "dst_layout")
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
    (:meth:`Shard.tp <kvabi.shard.Shard.tp>`), which is how a peer that lies about its
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
