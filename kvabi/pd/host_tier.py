"""The host tier's memory (``specs/pd.md`` section 10, a cache side's): per KV cache group
and kept part a :class:`kvabi.transfer.HostPool`, blocks saved under the front's keys and
loaded back into the engine's blocks."""
from __future__ import annotations

import hashlib

import numpy as np

from ..transfer import HostPool
from .digests import layout_fingerprint
from .engine import EngineCaches
from .parts import host_parts
from .work import HostLoad, HostSave


class HostTier:
    """``capacity`` host blocks per group of ``caches``; ``after_load(load, group, part,
    cache, blocks)`` (optional) is called once a part of a group's blocks are back."""

    def __init__(self, caches: EngineCaches, capacity: int, *, after_load=None):
        self._groups = caches.groups
        self._after_load = after_load
        seed = hashlib.blake2b(caches.identity.encode(), digest_size=16)
        self._pools, self._ids = [], []
        for g in caches.groups:
            kept = host_parts(g.parts)
            self._pools.append({part: HostPool(c.layout, capacity, preset="cross_layer",
                                               framework=caches.host_framework)
                                for part, c in kept})
            self._ids.append({})  # key -> {part: host block}
            for part, c in kept:
                seed.update(part.encode() + layout_fingerprint(c.layout))
        #: what makes this engine's host keys its own (its identity and layouts)
        self.seed = seed.digest()
        #: blocks saved, loaded and evicted (per group, all parts)
        self.stats = {"saved": 0, "loaded": 0, "evicted": 0}

    def __len__(self) -> int:
        return sum(len(h) for h in self._ids)

    def save(self, s: HostSave) -> None:
        for g, grp in enumerate(self._groups):
            blocks = np.asarray(s.blocks[g], np.int64)
            keep = blocks >= 0
            if not keep.any():
                continue
            ids = {part: self._pools[g][part].offload(c, blocks[keep])
                   for part, c in host_parts(grp.parts)}
            self.stats["saved"] += int(keep.sum())
            for j, key in enumerate(k for k, kp in zip(s.keys, keep) if kp):
                self._ids[g][key] = {part: int(i[j]) for part, i in ids.items()}

    def evict(self, key: bytes) -> None:
        for g, held in enumerate(self._ids):
            ids = held.pop(key, None)
            if ids is not None:
                for part, i in ids.items():
                    self._pools[g][part].free([i])
                self.stats["evicted"] += 1

    def load(self, ld: HostLoad) -> None:
        for g, grp in enumerate(self._groups):
            blocks = np.asarray(ld.blocks[g], np.int64)
            keep = blocks >= 0
            if not keep.any():
                continue
            held = [self._ids[g][k] for k, kp in zip(ld.keys, keep) if kp]
            self.stats["loaded"] += int(keep.sum())
            for part, c in host_parts(grp.parts):
                self._pools[g][part].onload(c, [h[part] for h in held], blocks[keep])
                if self._after_load is not None:
                    self._after_load(ld, g, part, c, blocks[keep])


__all__ = ["HostTier"]
