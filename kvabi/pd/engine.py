"""What an engine adapter supplies to kvabi's P/D: the engine's facts, nothing else.

An engine joins P/D (``specs/pd.md``) by describing its cache, once per rank, and by
telling kvabi, per request, which blocks hold it and when it ends; kvabi does the protocol.

**The cache** (:class:`EngineCaches`, per rank): per KV cache group its served parts
(:class:`CacheGroup`: at least ``kv``, a :class:`kvabi.KVCache` over the engine's own memory
whose layout places every byte where the engine's kernels do; under tensor parallelism the
layout states the rank's shard, :func:`~.parts.with_shard`), the group's sliding window, and
a per-tensor quantized cache's per-layer scales; the engine's block size, tokens per
request at most, rank and TP size.  An engine proves its layouts before serving them
(``kvabi.probe.verify_layout`` against its own cache write).

**A request's blocks**: per group, the engine's block ids for positions from 0, in order,
``-1`` where it holds none (an engine whose allocator marks "no block" otherwise maps it).

**Driving it** (one process: :class:`~.endpoint.Endpoint`; an engine whose scheduler and
workers are separate processes uses :class:`~.front.Front` in the scheduler and one
:class:`~.cache_side.CacheSide` per worker, carrying :class:`~.work.StepWork` and
:class:`~.work.Served` in its own messages):

- at start, each rank's cache side registers its memory and serves its parts; the front
  learns what every rank serves (``Front.serve``);
- a request arrives: ``Front.matched`` says how many prompt tokens will arrive (pulled or
  from the host tier); after allocating blocks, ``Front.allocated`` queues the pull;
- each step: ``Front.take_work`` -> ``CacheSide.apply``; ``CacheSide.results`` says which
  pulls ended (the engine computes from pulled tokens only once told they arrived, and
  fails a request whose pull failed) and which held requests' blocks may be freed
  (``Front.sent`` then reuses their grant slots);
- a request ends: ``Front.finished`` (a producer gets the answer to return with it, and
  keeps the request's blocks until they are reported sent).
"""
from __future__ import annotations

import attrs

from ..memory.cache import KVCache
from ..util.coerce import as_int
from ..util.errors import KVABIError
from .parts import KV, MAX_PARTS, NAME_CHARS, split_kv


@attrs.frozen(eq=False)
class CacheGroup:
    """One KV cache group of a rank's cache: ``parts`` ``((name, KVCache), ...)``, ``kv``
    among them (``specs/pd.md`` section 3); ``window`` the group's sliding window (None:
    full attention); ``kv_scales`` per layer of the ``kv`` layout ``(k_scale, v_scale)`` of
    a per-tensor quantized cache (None: unscaled)."""

    parts: tuple = attrs.field(converter=tuple)
    window: int | None = None
    kv_scales: tuple | None = None

    @parts.validator
    def _check(self, _a, parts):
        names = [n for n, _ in parts]
        if KV not in names:
            raise KVABIError(f"parts: a group serves a part named 'kv', got {names}")
        if len(set(names)) != len(names) or len(names) > MAX_PARTS:
            raise KVABIError(f"parts: 1 to {MAX_PARTS} distinct names, got {names}")
        for n, c in parts:
            if not isinstance(n, str) or not 0 < len(n) <= NAME_CHARS:
                raise KVABIError(f"parts: names of 1 to {NAME_CHARS} characters, got {n!r:.60}")
            if not isinstance(c, KVCache):
                raise KVABIError(f"parts.{n}: must be a KVCache, got {type(c).__name__}")

    @classmethod
    def of(cls, kv: KVCache, *, window=None, kv_scales=None, extra=()) -> "CacheGroup":
        """A group serving ``kv``, and its keys and values apart (``k``, ``v``) where its
        layout allows, plus ``extra`` parts."""
        parts = [(KV, kv), *extra]
        if not {"k", "v"} & {n for n, _ in parts}:
            parts += split_kv(kv) or []
        return cls(parts, window, kv_scales)

    @property
    def kv(self) -> KVCache:
        return dict(self.parts)[KV]


@attrs.frozen(eq=False)
class EngineCaches:
    """A rank's cache as P/D sees it: ``groups`` (:class:`CacheGroup` per KV cache group,
    in the engine's group order), ``block_size`` (tokens per block, every group),
    ``max_tokens`` (the longest request: sizes the grant records), ``rank`` and ``tp_size``;
    ``engine_id`` names its transfer agent; ``identity`` what makes its KV bytes differ
    from another engine's (model, revision, dtype, cache dtype: seeds the host tier's
    keys); ``host_framework`` the framework of host tier pools (``numpy`` or ``torch``)."""

    groups: tuple = attrs.field(converter=tuple)
    block_size: int = attrs.field(converter=lambda v: as_int(v, "block_size", lo=1))
    max_tokens: int = attrs.field(converter=lambda v: as_int(v, "max_tokens", lo=1))
    engine_id: str = "engine"
    rank: int = 0
    tp_size: int = 1
    identity: str = ""
    host_framework: str = "numpy"

    @groups.validator
    def _check(self, _a, groups):
        if not groups or not all(isinstance(g, CacheGroup) for g in groups):
            raise KVABIError("groups: one CacheGroup per KV cache group")

    @property
    def windows(self) -> tuple:
        return tuple(g.window for g in self.groups)


__all__ = ["CacheGroup", "EngineCaches"]
