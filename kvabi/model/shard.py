"""Which of the model's KV heads a cache holds: :class:`Shard` (``specs/layout.md``, *Shard*).

Under tensor parallelism each rank's cache holds a slice of the model's KV heads; when ranks
outnumber KV heads each rank holds one head, replicated on ``ranks / heads`` ranks; an MLA
latent (one "head") is replicated on every rank.  A layout states its slice so that a peer
knows which global head every byte holds: local head ``h`` of the layout is global head
``heads[h]`` of ``of``.  A layout without a shard holds every head in order (``heads =
0 .. H-1 of H``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Mapping

import attrs

from ..util.coerce import INT64_MAX, as_int
from ..util.errors import KVABIError

#: JSON keys of a shard (``specs/layout.schema.json``)
FIELDS = ("heads", "of", "rank", "ranks")


def _heads(x) -> tuple[int, ...]:
    if isinstance(x, (str, bytes, Mapping)) or not isinstance(x, (list, tuple, range)):
        raise KVABIError(f"shard.heads: must be a list of global KV head indices, got "
                         f"{x!r:.80}")
    if isinstance(x, range) or all(type(h) is int for h in x):  # plain ints: one check
        t = tuple(x)
        if not t or (min(t) >= 0 and max(t) <= INT64_MAX):
            return t
    return tuple(as_int(h, f"shard.heads[{i}]", lo=0) for i, h in enumerate(x))


@attrs.frozen
class Shard:
    """The global KV heads a cache holds, in local head order, of the model's ``of`` heads,
    and the tensor-parallel ``rank`` of ``ranks`` that holds them (informative for bytes:
    a peer checks it against the rank it expects, see :func:`check_group`).

    ``heads`` are distinct and below ``of``; ``rank < ranks``.  Build the slice a
    tensor-parallel engine holds with :meth:`tp`."""

    heads: tuple[int, ...] = attrs.field(converter=_heads)
    of: int = attrs.field(converter=lambda v: as_int(v, "shard.of", lo=1))
    rank: int = attrs.field(default=0, converter=lambda v: as_int(v, "shard.rank", lo=0))
    ranks: int = attrs.field(default=1, converter=lambda v: as_int(v, "shard.ranks", lo=1))

    def __attrs_post_init__(self):
        if not self.heads:
            raise KVABIError("shard.heads: a shard holds at least one head")
        bad = [h for h in self.heads if h >= self.of]
        if bad:
            raise KVABIError(f"shard.heads: head {bad[0]} out of range [0, {self.of}) "
                             f"(shard.of = {self.of})")
        if len(set(self.heads)) != len(self.heads):
            dup = next(h for h in self.heads if self.heads.count(h) > 1)
            raise KVABIError(f"shard.heads: head {dup} appears twice")
        if self.rank >= self.ranks:
            raise KVABIError(f"shard.rank: {self.rank} out of range [0, {self.ranks}) "
                             f"(shard.ranks = {self.ranks})")

    # -- the tensor-parallel split ---------------------------------------------------------
    @classmethod
    def tp(cls, rank: int, ranks: int, num_kv_heads: int) -> "Shard":
        """The heads rank ``rank`` of ``ranks`` holds of a model with ``num_kv_heads`` KV
        heads, split as tensor-parallel engines split them (vLLM, SGLang, TensorRT-LLM):
        ``ranks <= heads``: ``heads / ranks`` consecutive heads per rank (``ranks`` must
        divide the heads); ``ranks > heads``: one head per rank, head ``rank * heads //
        ranks``, each replicated on ``ranks / heads`` consecutive ranks (the heads must
        divide ``ranks``).  MLA (one latent head): every rank holds head 0."""
        ranks = as_int(ranks, "ranks", lo=1)
        rank = as_int(rank, "rank", lo=0, hi=ranks - 1)
        n = as_int(num_kv_heads, "num_kv_heads", lo=1)
        if cls is Shard:
            return _tp(rank, ranks, n)
        s = _tp(rank, ranks, n)
        return cls(heads=s.heads, of=s.of, rank=s.rank, ranks=s.ranks)

    @property
    def is_whole(self) -> bool:
        """Holds every head, in order (what a layout without a shard holds)."""
        return len(self.heads) == self.of and self.heads == tuple(range(self.of))

    @property
    def is_standard(self) -> bool:
        """Holds exactly what :meth:`tp` gives its rank (False also where :meth:`tp` has no
        split for ``ranks`` and ``of``).  Never builds more heads than this shard holds
        (``of`` may come from an untrusted descriptor)."""
        want = split_heads(self.rank, self.ranks, self.of)
        return want is not None and len(want) == len(self.heads) and \
            self.heads == tuple(want)

    def local(self, head: int) -> int:
        """The local index of global ``head`` (KVABIError when this shard lacks it)."""
        try:
            return self.heads.index(head)
        except ValueError:
            raise KVABIError(f"shard.heads: global head {head} is not held (this shard holds "
                             f"{list(self.heads)})") from None

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"heads": list(self.heads), "of": self.of, "rank": self.rank,
                "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d) -> "Shard":
        """A shard from its (untrusted) JSON object: every field present, integers as JSON
        integers; KVABIError naming the field otherwise (unknown keys are the caller's:
        see ``kvabi.layout.json_form``)."""
        if isinstance(d, Shard):
            return d
        if not isinstance(d, Mapping):
            raise KVABIError(f"shard: must be an object with {', '.join(FIELDS)}, got "
                             f"{d!r:.80}")
        for f in FIELDS:
            if f not in d:
                raise KVABIError(f"shard.{f}: missing")
        if not isinstance(d["heads"], list):
            raise KVABIError(f"shard.heads: must be a list of integers, got {d['heads']!r:.80}")
        return cls(heads=d["heads"], of=d["of"], rank=d["rank"], ranks=d["ranks"])


@lru_cache(maxsize=256)
def _tp(rank: int, ranks: int, n: int) -> Shard:
    """:meth:`Shard.tp` of checked ints (a shard is immutable: one object per split)."""
    heads = split_heads(rank, ranks, n)
    if heads is None and ranks <= n:
        raise KVABIError(f"ranks: {n} KV heads cannot be split evenly over {ranks} "
                         f"tensor-parallel ranks")
    if heads is None:
        raise KVABIError(f"ranks: {ranks} tensor-parallel ranks cannot replicate {n} KV "
                         f"heads evenly (the heads must divide the ranks)")
    return Shard(heads=heads, of=n, rank=rank, ranks=ranks)


@lru_cache(maxsize=256)
def whole(num_kv_heads: int) -> Shard:
    """The shard of a cache holding all ``num_kv_heads`` heads (no tensor parallelism)."""
    return Shard(heads=range(num_kv_heads), of=num_kv_heads)


def check_group(shards, field: str = "sources", *, standard: bool = True) -> tuple:
    """``shards`` (one per rank of one tensor-parallel engine, in rank order) checked as a
    group; returns them as a tuple.  KVABIError naming ``field[i]`` when a position holds
    another rank (ranks swapped or missing), the ranks disagree on ``ranks`` or ``of``,
    their count is not ``ranks``, a head is held by no rank, or (``standard``) a rank holds
    other heads than the tensor-parallel split gives it (:meth:`Shard.tp`): a peer that lies
    about its heads."""
    shards = tuple(shards)
    if not shards:
        raise KVABIError(f"{field}: no ranks")
    for i, s in enumerate(shards):
        if not isinstance(s, Shard):
            raise KVABIError(f"{field}[{i}]: must be a Shard, got {type(s).__name__}")
    first = shards[0]
    for i, s in enumerate(shards):
        if s.of != first.of:
            raise KVABIError(f"{field}[{i}].shard.of: {s.of} KV heads, rank 0 says {first.of}")
        if s.ranks != len(shards):
            raise KVABIError(f"{field}[{i}].shard.ranks: says {s.ranks} ranks, the group has "
                             f"{len(shards)}")
        if s.rank != i:
            raise KVABIError(f"{field}[{i}].shard.rank: says rank {s.rank} at position {i} "
                             f"(ranks swapped?)")
        if standard and not s.is_standard:
            want = split_heads(i, s.ranks, s.of)
            said = _show_heads(want) if want is not None else "no even split"
            raise KVABIError(f"{field}[{i}].shard.heads: rank {i} of {s.ranks} holds "
                             f"{said} of {s.of} heads, it says {_show_heads(s.heads)}")
    held = sorted(set().union(*(s.heads for s in shards)))
    if len(held) != first.of:  # the first head missing, without counting up to `of`
        gap = [i for i, h in enumerate(held) if h != i]
        missing = gap[0] if gap else len(held)
        raise KVABIError(f"{field}: global head {missing} of {first.of} is held by no rank")
    return shards


def split_heads(rank: int, ranks: int, heads: int) -> range | None:
    """The global heads :meth:`Shard.tp` gives ``rank`` of ``ranks`` (a lazy range), or
    None where neither divides the other."""
    if ranks <= heads:
        if heads % ranks:
            return None
        k = heads // ranks
        return range(rank * k, rank * k + k)
    if ranks % heads:
        return None
    return range(rank * heads // ranks, rank * heads // ranks + 1)


def _show_heads(heads) -> str:
    """Heads for a message: the list, or its ends where it is long."""
    h = list(heads[:9]) if len(heads) > 8 else list(heads)
    return str(h) if len(heads) <= 8 else f"[{h[0]}, {h[1]}, ..., {heads[-1]}] " \
        f"({len(heads)} heads)"


def shard_field(x):
    """Converter of :attr:`kvabi.Layout.shard`: None, a Shard, or its JSON object."""
    return None if x is None else Shard.from_dict(x)


def check_layout_shard(shard: Shard | None, num_heads: int) -> None:
    """KVABIError unless ``shard`` (of a layout with ``num_heads`` heads) names one global
    head per local head."""
    if shard is not None and len(shard.heads) != num_heads:
        raise KVABIError(f"shard.heads: names {len(shard.heads)} heads, the layout holds "
                         f"sizes.H = {num_heads}")


def shard_of(layout) -> Shard:
    """The shard of ``layout``: its own, or all its heads in order."""
    return layout.shard if layout.shard is not None else whole(layout.size("H"))
