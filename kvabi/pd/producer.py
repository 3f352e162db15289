"""A producer rank's cache side (``specs/pd.md`` sections 4.4, 4.5 and 8): serves its parts
and its grant table, writes each grant's record (what it holds, and a checksum per token
and KV head), frees a request's blocks once every consumer rank notified it, or when the
grant expires."""
from __future__ import annotations

import logging
import time

import numpy as np

from ..transfer.handshake import parse_handshake
from .digests import head_checksums
from .engine import EngineCaches
from .grants import PENDING, GrantTable
from .notify import parse_notification
from .parts import kv_part
from .record import LIVE, GrantRecord, part_claim, record_bytes
from .settings import PDSettings
from .slots import token_slots
from .work import GrantIssue


class Producer:
    """Serves ``caches`` (registered with ``agent``) to consumers under grants."""

    def __init__(self, agent, caches: EngineCaches, settings: PDSettings, *,
                 log: logging.Logger | None = None, label: str = "kvabi.pd"):
        self._agent = agent
        self._caches = caches
        self._settings = settings
        self._log = log or logging.getLogger("kvabi.pd")
        self._label = label
        self.handshakes = [
            {part: agent.handshake(c, include_metadata=True, kv_scales=g.kv_scales,
                                   model=settings.model_id)
             for part, c in g.parts} for g in caches.groups]
        # what a reader must interpret each part's bytes with, as this rank states it
        self._claims = tuple(tuple(part_claim(part, parse_handshake(msgs[part]))
                                   for part, _ in g.parts)
                             for g, msgs in zip(caches.groups, self.handshakes))
        heads = max(g.kv.layout.size("H") for g in caches.groups)
        size = record_bytes(len(caches.groups), caches.max_tokens, caches.block_size, heads)
        self.table = GrantTable(settings.max_held, size)
        agent.register(self.table.cache)
        self.grants = agent.handshake(self.table.cache, include_metadata=True)
        #: notifications ignored (naming no live grant's slot and nonce), and those naming a
        #: grant already closed (not counted as ignored)
        self.ignored_notifications = self.late_notifications = 0
        #: notifications taken while the engine waited, not yet handled
        self.notes: list = []

    def publish(self, g: GrantIssue) -> None:
        """Write grant ``g``'s record: what this rank holds, and a checksum per token."""
        bs = self._caches.block_size
        sums = [head_checksums(kv_part(grp.parts), token_slots(b, bs, 0, g.num_tokens))
                for grp, b in zip(self._caches.groups, g.blocks)]
        record = GrantRecord(LIVE, g.nonce, g.num_tokens, g.tokens,
                             tuple(np.asarray(b, np.int64) for b in g.blocks),
                             self._claims, tuple(sums), self._caches.rank,
                             self._caches.tp_size)
        self.table.write(g.slot, record, g.req_id,
                         time.monotonic() + self._settings.hold_timeout_s)

    def poll(self) -> set[str]:
        """Requests whose blocks may be freed now: every consumer rank notified, or the
        grant expired."""
        out = set()
        notes, self.notes = self.notes + self._agent.drain_notifications(), []
        for sender, msg in notes:
            got = parse_notification(msg)
            req_id = None if got is None else self.table.release(*got)
            if req_id is PENDING:  # other consumer ranks still read
                continue
            if req_id is not None:
                out.add(req_id)
            elif got is not None and self.table.closed(got[0], got[1]):
                self.late_notifications += 1  # a grant already closed: nothing to do
            elif msg:  # empty: a grant record read
                self.ignored_notifications += 1
                n = self.ignored_notifications
                if n <= 16 or n % 1024 == 0:
                    self._log.warning("%s: ignored a notification from %s that names no live "
                                      "grant (%d so far)", self._label, sender, n)
        out.update(self.table.expire())
        return out

    def held(self) -> set[str]:
        """Requests holding blocks under a live grant."""
        return {r for r, _, _ in self.table.live.values()}


__all__ = ["Producer"]
