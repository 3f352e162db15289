"""Negotiation instead of an exact-match hash: can this rank read that engine's KV, and how
(``specs/transfer.md``, *Negotiation*).

:func:`negotiate` takes the local cache's layout (or its handshake) and the remote engine's
ranks (layouts or validated handshakes, in rank order) and answers:

- ``"same"``: one remote rank holds this rank's heads with every block's bytes placed alike
  (only the block count, names, folds or padding outside blocks may differ): a direct plan,
  one region per block and plane chunk;
- ``"relayout"``: the bytes are the same data placed otherwise (another axis order, block
  size, plane split, head split across ranks, keys and values or scales placed apart):
  a plan with relayout, and its cost (:meth:`Negotiation.cost`: regions and staging
  bytes per block);
- a :class:`Refused` error (a :class:`~kvabi.KVABIError`) naming every field that makes the
  data differ: ABI major, model identity, dtype, K/V against an MLA latent, head dim, the
  model's KV head count, layer count, the quantization component by component (a scale
  on one side only, a scale's dtype, count or granularity: ``components.key_scale``,
  ``components.key_scale.dtype``, ...), and a remote group that is inconsistent (ranks
  swapped or missing, a rank that lies about its heads).

Nothing is compared by name: the attention backend that wrote a cache does not enter, only
where its bytes are.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

from ..layout.component import DATA, NAMES
from ..layout.descriptor import Layout
from ..model.shard import shard_of
from ..util.errors import KVABIError
from ..util.version import WIRE_VERSION
from .handshake import Handshake
from .plan import granularity
from .shards import HeadRun, _check, assign, plan_shard_transfer, run_problems
from .staging import STAGE_BELOW

KINDS = ("same", "relayout")


class Refused(KVABIError):
    """Two caches whose data differ: ``fields`` names each difference (``str(e)`` says
    what each side has)."""

    def __init__(self, problems: Sequence[tuple[str, str]]):
        self.fields = tuple(f for f, _ in problems)
        super().__init__("; ".join(f"{f}: {why}" for f, why in problems))


@attrs.frozen
class Cost:
    """What moving one local block costs (all layers, all local heads): ``regions`` of the
    plan, and ``staging_bytes`` a staged pull holds (the source bytes it reads; 0 for a
    direct pull)."""

    regions: int
    staging_bytes: int


@attrs.frozen(eq=False)
class Negotiation:
    """The answer of :func:`negotiate`.

    ``kind``: ``"same"`` (a direct plan) or ``"relayout"``; ``runs``: which remote rank each
    of the local heads is read from (:class:`~kvabi.transfer.shards.HeadRun`);
    ``differences``: the fields whose difference makes it a relayout.  :meth:`cost` plans
    one block to price it (once; a few milliseconds for a relayout of a 64-layer model)."""

    kind: str
    local: Layout
    remote: tuple
    runs: tuple
    differences: tuple
    _cost: list = attrs.field(factory=list, repr=False)  # memo of cost()

    @property
    def sources(self) -> tuple[int, ...]:
        """The remote ranks this rank reads, in order."""
        return tuple(sorted({r.source for r in self.runs}))

    def cost(self) -> Cost:
        """The :class:`Cost` of moving one local block (planned once, then kept)."""
        if not self._cost:
            self._cost.append(Cost(*_cost(self.local, self.remote, self.kind == "same")))
        return self._cost[0]

    @property
    def staged(self) -> bool:
        """Whether a pull may go staged by default (regions average under 64 KiB; it does
        where staging saves descriptors: :func:`~kvabi.transfer.staging.staging_pays`)."""
        c = self.cost()
        return self.kind != "same" and c.regions > 0 and \
            c.staging_bytes < STAGE_BELOW * c.regions


def _side(x, field: str):
    """(layout, abi, model) of a Layout or a validated Handshake."""
    if isinstance(x, Handshake):
        return x.layout, x.abi, x.model
    if isinstance(x, Layout):
        return x, WIRE_VERSION, None
    raise KVABIError(f"{field}: must be a kvabi.Layout or a Handshake (parse_handshake), "
                     f"got {type(x).__name__}")


def _data_problems(local: Layout, remote: Layout, side: str) -> list[tuple[str, str]]:
    out = []
    if local.dtype != remote.dtype:
        out.append(("dtype", f"{side} holds {remote.dtype}, this cache {local.dtype}"))
    if local.has_kv != remote.has_kv:
        kind = lambda x: "K/V" if x.has_kv else "an MLA latent"  # noqa: E731
        out.append(("sizes.KV", f"{side} holds {kind(remote)}, this cache {kind(local)}"))
    if local.size("D") != remote.size("D"):
        out.append(("sizes.D", f"{side} has head dim {remote.size('D')}, this cache "
                               f"{local.size('D')}"))
    if shard_of(local).of != shard_of(remote).of:
        out.append(("shard.of", f"{side}'s model has {shard_of(remote).of} KV heads, this "
                                f"one {shard_of(local).of}"))
    if local.num_layers != remote.num_layers:
        out.append(("sizes.L", f"{side} holds {remote.num_layers} layers, this cache "
                               f"{local.num_layers}"))
    if local.has_kv == remote.has_kv:  # else sizes.KV says it
        out += _quant_problems(local, remote, side, "sizes.D" in {f for f, _ in out})
    return out


def _what(c, layout: Layout) -> str:
    return f"{c.count} x {c.dtype} {granularity(c, layout.size('H'))}"


def _quant_problems(local: Layout, remote: Layout, side: str,
                    dim_differs: bool) -> list[tuple[str, str]]:
    """The quantization compared component by component: ``components.<name>`` (held on
    one side only, or another granularity along tokens), ``components.<name>.dtype`` and
    ``.count``.  A component's dtype is left to ``dtype`` where it is the layout's dtype on
    both sides; the counts of data (keys, values, latent, rope) to ``sizes.D`` where that
    differs.  The
    granularity along heads depends on which heads each rank reads: compared per run
    (:func:`~kvabi.transfer.shards.run_problems`)."""
    out = []
    mine, theirs = set(local.component_names), set(remote.component_names)
    for n in NAMES:
        if n in mine and n in theirs:
            cl, cr = local.component(n), remote.component(n)
            if cl.dtype != cr.dtype and not (cl.dtype == local.dtype and
                                             cr.dtype == remote.dtype):
                out.append((f"components.{n}.dtype", f"{side}'s {n} is {cr.dtype}, this "
                                                     f"cache's {cl.dtype}"))
            if cl.count != cr.count and not (dim_differs and n in DATA):
                out.append((f"components.{n}.count", f"{side} holds {cr.count} {n} "
                                                     f"elements per token and head, this "
                                                     f"cache {cl.count}"))
            if cl.varies("N") != cr.varies("N"):
                out.append((f"components.{n}", f"{side}'s {n} is {_what(cr, remote)}, "
                                               f"this cache's {_what(cl, local)}"))
        elif n in theirs or n in mine:
            has, lay, other = (side, remote, "this cache") if n in theirs else \
                ("this cache", local, side)
            out.append((f"components.{n}", f"{has} holds {n} ({_what(lay.component(n), lay)})"
                                           f", {other} does not"))
    return out


def _same_blocks(a: Layout, b: Layout) -> bool:
    """Every block's bytes placed alike: the same axes in the same order and plane split,
    the same sizes but the block count, the same strides inside a block, the same heads
    (component form: :func:`_same_components`)."""
    sa, sb = shard_of(a), shard_of(b)
    if (sa.heads, sa.of) != (sb.heads, sb.of):
        return False
    if any(a.size(x) != b.size(x) for x in ("L", "KV", "N", "H", "D")):
        return False
    if not (a.is_axis_form and b.is_axis_form):
        return _same_components(a, b) == "same"
    if (a.dtype, a.planes, a.order) != (b.dtype, b.planes, b.order):
        return False
    inner = a.order[a.order.index("B") + 1:]
    return not any(a.stride(x) != b.stride(x) or a.extent(x) != b.extent(x) for x in inner)


def _placement(c, counts) -> tuple:
    """A component's in-plane axes with more than one index, outermost first (by
    stride)."""
    return tuple(sorted((x for x, s in c.strides.items() if counts[x] > 1),
                        key=lambda x: -c.strides[x]))


def _same_components(a: Layout, b: Layout) -> str:
    """How the components of two layouts holding the same data are placed per block:
    ``"same"`` (every component in the same plane, at the same offset, its axes in the
    same order, the same strides inside a block: only the strides of axes outside ``B``,
    which grow with the block count, may differ), ``"order"`` (a component's axes or
    planes in another order) or ``"strides"``."""
    out = "same"
    for n in a.component_names:
        ca, cb = a.component(n), b.component(n)
        counts = {"L": a.num_layers, "B": 2, "N": max(a.size("N"), b.size("N")),
                  "H": max(a.size("H"), b.size("H")), "E": ca.units}
        if _placement(ca, counts) != _placement(cb, counts) or \
                (ca.plane_strides != cb.plane_strides and a.num_layers > 1):
            return "order"
        inner = [x for x in _placement(ca, counts) if ca.strides[x] <= ca.strides["B"]]
        if ca.plane != cb.plane or ca.offset != cb.offset or \
                any(ca.strides[x] != cb.strides[x] for x in inner):
            out = "strides"
    return out


def _differences(local: Layout, remote: tuple) -> tuple[str, ...]:
    out = []
    r = remote[0]
    if len(remote) != 1 or shard_of(r).heads != shard_of(local).heads:
        out.append("shard")
    if r.size("N") != local.size("N"):
        out.append("sizes.N")
    if not (r.is_axis_form and local.is_axis_form):
        how = _same_components(r, local)
        if how == "order" or (how == "strides" and not out):
            out.append(how)
    elif (r.order, r.planes) != (local.order, local.planes):
        out.append("order")
    elif not _same_blocks(r, local) and "shard" not in out and "sizes.N" not in out:
        out.append("strides")
    return tuple(out)


def _cost(local: Layout, remote: tuple, same: bool) -> tuple[int, int]:
    """(regions, staged bytes) of moving one local block: planned on one and two layers
    (regions grow affinely with the layers: addressing is affine in the layer index) over
    the tokens of whole blocks on both sides, per local block."""
    if same and local.is_axis_form:
        outer = local.order[:local.order.index("B")]
        return local.num_planes * math.prod(local.size(a) for a in outer), 0
    bs_l, bs_r = local.size("N"), remote[0].size("N")
    tokens = math.lcm(bs_l, bs_r)
    if tokens // bs_r > remote[0].num_blocks or tokens // bs_l > local.num_blocks:
        tokens = math.gcd(bs_l, bs_r)  # too few blocks: one sub-block, no merges across them
    slots = np.arange(tokens)
    counts = []
    for layers in ([0], [0, 1])[:min(2, local.num_layers)]:
        plan = plan_shard_transfer(remote, local, slots, slots, layers=layers,
                                   standard=False)
        counts.append((len(plan), plan.nbytes))
    (r1, b1), (r2, b2) = counts[0], counts[-1]
    n = local.num_layers
    regions = r1 + (n - 1) * (r2 - r1)
    nbytes = b1 + (n - 1) * (b2 - b1)
    per = tokens / bs_l  # local blocks the plan fills
    return int(math.ceil(regions / per)), 0 if same else int(nbytes / per)


def negotiate(local, remote, *, standard: bool = True) -> Negotiation:
    """How this rank (``local``: its Layout or Handshake) reads the KV of ``remote`` (a
    Layout or Handshake, or one per rank of a tensor-parallel engine, in rank order).

    ``standard``: the remote ranks' shards must be the tensor-parallel split of their
    ranks (what catches a rank lying about its heads); a local cache that holds heads of
    its own choosing names them in its shard.  Raises :class:`Refused` naming every field
    that makes the data differ, or a KVABIError naming a field of an inconsistent remote
    group, before any plan exists."""
    mine, abi, model = _side(local, "local")
    if isinstance(remote, (Layout, Handshake)):
        remote = [remote]
    if isinstance(remote, (str, bytes)) or not isinstance(remote, Sequence) or not remote:
        raise KVABIError(f"remote: must be a Layout or Handshake, or a non-empty list of "
                         f"them (one per rank), got {type(remote).__name__}")
    sides = [_side(r, f"remote[{i}]") for i, r in enumerate(remote)]
    problems = []
    for i, (lay, r_abi, r_model) in enumerate(sides):
        side = "the peer" if len(sides) == 1 else f"remote rank {i}"
        if r_abi[0] != abi[0]:
            problems.append(("kvabi_abi", f"{side} speaks ABI {r_abi[0]}.{r_abi[1]}, this "
                                          f"cache {abi[0]}.{abi[1]}"))
        if model is not None and r_model is not None and r_model != model:
            problems.append(("model", f"{side} serves model {r_model!r}, this cache "
                                      f"{model!r}"))
        problems += _data_problems(mine, lay, side)
    if problems:
        seen, unique = set(), []
        for f, why in problems:  # one line per field: the first rank that differs
            if f not in seen:
                seen.add(f)
                unique.append((f, why))
        raise Refused(unique)
    layouts = tuple(lay for lay, _, _ in sides)
    srcs, shards, dst = _check(layouts, mine, standard)
    runs = assign(shards, dst)
    bad = run_problems(srcs, mine, runs)
    if bad:
        raise Refused([(f"components.{n}", why) for n, why in bad])
    same = len(srcs) == 1 and _same_blocks(srcs[0], mine)
    return Negotiation(kind="same" if same else "relayout", local=mine, remote=srcs,
                       runs=runs, differences=() if same else _differences(mine, srcs))


__all__ = ["Cost", "HeadRun", "KINDS", "Negotiation", "Refused", "negotiate"]
