"""The model-wide view under tensor parallelism: given a :class:`~kvabi.ModelKV` and a TP
size, what each rank's caches hold (:class:`TPView`).

Every KV group of the model is split on its own (groups may have different KV head counts):
rank ``r`` holds :meth:`Shard.tp(r, tp_size, heads) <kvabi.model.shard.Shard.tp>` of the group's
heads, so its cache has the group's spec with the local head count, and its layouts state
the shard.
"""
from __future__ import annotations

import attrs

from ..model.model_kv import ModelKV
from ..model.shard import Shard
from ..model.spec import KVSpec
from ..util.coerce import as_int
from ..util.errors import KVABIError


@attrs.frozen
class TPView:
    """What each of ``tp_size`` ranks holds of ``model``'s KV caches.

    KVABIError naming the group when a group's KV heads cannot be split over ``tp_size``
    ranks (neither divides the other)."""

    model: ModelKV = attrs.field()
    tp_size: int = attrs.field(converter=lambda v: as_int(v, "tp_size", lo=1))
    # per rank, per group: (local spec, shard); computed once
    _ranks: tuple = attrs.field(init=False, repr=False, eq=False)

    @model.validator
    def _check_model(self, _attribute, value):
        if not isinstance(value, ModelKV):
            raise KVABIError(f"model: must be a kvabi.ModelKV, got {type(value).__name__}")

    def __attrs_post_init__(self):
        ranks = []
        for r in range(self.tp_size):
            row = []
            for gi, g in enumerate(self.model.groups):
                try:
                    shard = Shard.tp(r, self.tp_size, g.spec.num_kv_heads)
                except KVABIError as e:
                    raise KVABIError(f"model.groups[{gi}].spec.num_kv_heads: {e}") from None
                row.append((attrs.evolve(g.spec, num_kv_heads=len(shard.heads)), shard))
            ranks.append(tuple(row))
        object.__setattr__(self, "_ranks", tuple(ranks))

    @property
    def num_groups(self) -> int:
        return len(self.model.groups)

    def _at(self, rank, group) -> tuple[KVSpec, Shard]:
        rank = as_int(rank, "rank", lo=0, hi=self.tp_size - 1)
        group = as_int(group, "group", lo=0, hi=self.num_groups - 1)
        return self._ranks[rank][group]

    def shard(self, rank: int, group: int = 0) -> Shard:
        """The heads rank ``rank`` holds of KV group ``group``."""
        return self._at(rank, group)[1]

    def spec(self, rank: int, group: int = 0) -> KVSpec:
        """The spec of rank ``rank``'s cache of KV group ``group`` (local head count)."""
        return self._at(rank, group)[0]

    def layouts(self, rank: int, preset, num_blocks: int) -> tuple:
        """Rank ``rank``'s layout of every KV group: ``preset`` (a preset name, or one per
        group) over the group's owner layers, ``num_blocks`` blocks, stating its shard."""
        from .descriptor import Layout

        names = (preset,) * self.num_groups if isinstance(preset, str) else tuple(preset)
        if len(names) != self.num_groups:
            raise KVABIError(f"preset: one name per KV group ({self.num_groups}), got "
                             f"{len(names)}")
        out = []
        for gi, (name, g) in enumerate(zip(names, self.model.groups)):
            spec, shard = self._at(rank, gi)
            base = Layout.preset(name, spec, num_blocks, len(g.layers))
            out.append(attrs.evolve(base, shard=shard))
        return tuple(out)

    def all_layouts(self, preset, num_blocks: int) -> tuple:
        """:meth:`layouts` of every rank, in rank order."""
        return tuple(self.layouts(r, preset, num_blocks) for r in range(self.tp_size))
