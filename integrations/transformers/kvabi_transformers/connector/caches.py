"""transformers' paged cache as P/D sees it: the kvabi caches of a
:class:`~kvabi_transformers.session.Session`, one KV cache group per kvabi group, served as
:class:`kvabi.pd.CacheGroup` parts.

The session's caches are already kvabi layouts over memory kvabi allocated (checked once
against the backend's own write when the session starts, ``kvabi.probe.verify_layout``),
so they are served as they are: numpy and torch caches are written in place, and NIXL reads
and writes their planes directly.  A jax cache is replaced by every ``write_kv`` (its
buffers are donated), so its memory cannot stay registered: P/D then goes through a numpy
*mirror* of the same layout and block ids, copied from the device cache when a producer
holds a request, and into it when a consumer's pull arrived (both in the engine's thread).

Block ids: transformers' allocator runs one bookkeeping allocator for every layer, so all
KV cache groups share one block table; a transformers block id minus the session's
``first_block`` is the block index on every layout's ``B`` axis.
"""
from __future__ import annotations

import numpy as np

import kvabi
from kvabi.pd import CacheGroup, EngineCaches
from kvabi.transfer import execute, plan_block_transfer


def group_window(group) -> int | None:
    """The sliding window of a kvabi KV group (None: full attention).  The session holds a
    sliding group's whole sequence, so it serves every block; a producer that drops blocks
    out of the window may send the null block there, which this engine never reads."""
    spec = group.spec
    return int(spec.window) if spec.kind == "sliding_window" and spec.window else None


class SessionCaches:
    """What P/D serves and pulls into for one session: per KV group the session's own cache
    (numpy, torch) or a numpy mirror of it (jax)."""

    def __init__(self, session):
        self.session = session
        self.mirrored = session.fw == "jax"
        if self.mirrored:
            self.caches = [kvabi.KVCache.allocate(lay, "numpy") for lay in session.layouts]
        else:
            self.caches = list(session.caches)

    def engine_caches(self, *, engine_id: str, max_tokens: int, identity: str) -> EngineCaches:
        """The session's cache as :class:`kvabi.pd.EngineCaches` (``max_tokens``: the longest
        request, which sizes the grant records)."""
        groups = self.session.integration.model_kv.groups
        return EngineCaches(
            [CacheGroup.of(c, window=group_window(g)) for c, g in zip(self.caches, groups)],
            block_size=self.session.block_size, max_tokens=max_tokens, engine_id=engine_id,
            identity=identity,
            host_framework="torch" if self.session.fw == "torch" else "numpy")

    def kvabi_blocks(self, transformers_blocks) -> list:
        """Per KV group, the kvabi block ids of a request's transformers block list."""
        ids = [int(b) - self.session.first_block for b in transformers_blocks]
        return [list(ids) for _ in self.caches]

    def export_blocks(self, blocks) -> None:
        """Copy ``blocks`` (kvabi ids) of every group from the session's cache into the mirror
        (a jax session; nothing to do otherwise): what a producer serves from now on."""
        if not self.mirrored or not len(blocks):
            return
        ids = np.asarray(blocks, np.int64)
        for g, lay in enumerate(self.session.layouts):
            plan = plan_block_transfer(lay, lay, ids, ids)
            execute(plan, self.session.caches[g], self.caches[g])

    def import_blocks(self, blocks) -> None:
        """Copy ``blocks`` (kvabi ids) of every group from the mirror into the session's cache
        (a jax session: its cache handles are replaced; nothing to do otherwise)."""
        if not self.mirrored or not len(blocks):
            return
        ids = np.asarray(blocks, np.int64)
        s = self.session
        for g, lay in enumerate(s.layouts):
            plan = plan_block_transfer(lay, lay, ids, ids)
            s.caches[g] = kvabi.KVCache.wrap(lay, execute(plan, self.caches[g], s.caches[g]))


__all__ = ["SessionCaches", "group_window"]
