"""Grants on a producer (``specs/pd.md`` section 8): the front's book of slots and nonces,
and each rank's table of records in registered memory.

When an asked request finishes normally, the front issues a grant: a free slot of the
grant table and a random 16-byte nonce, returned (with the slot) in the request's answer.
Each rank's cache side writes the grant's record (:mod:`.record`) into that slot of its
own table, which it registers and serves like a cache.  A rank frees the request's blocks
once every consumer rank has notified it with the live grant's slot and nonce, or the
grant expired (``hold_timeout_s``); the front issues the slot again only after that.
"""
from __future__ import annotations

import collections
import hmac
import secrets
import time

import numpy as np

from ..memory.cache import KVCache
from ..util.errors import KVABIError
from .record import (EXPIRED, HEADER, RELEASED, GrantRecord, encode, read_header,
                     table_layout)

#: :meth:`GrantTable.release`: the notification counted, other consumer ranks still read
PENDING = "pending"


class GrantBook:
    """The producer front's grants: at most ``slots`` live, one per request."""

    def __init__(self, slots: int):
        self._free = collections.deque(range(slots))
        self._live: dict[str, int] = {}

    def issue(self, req_id: str) -> tuple[int, bytes] | None:
        """(slot, nonce) for ``req_id``, or None when every slot is held."""
        if not self._free or req_id in self._live:
            return None
        slot = self._free.popleft()
        self._live[req_id] = slot
        return slot, secrets.token_bytes(16)

    def release(self, req_id: str) -> None:
        slot = self._live.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._live)


class GrantTable:
    """A producer rank's table of grant records (numpy memory, registered by the caller)."""

    def __init__(self, slots: int, slot_bytes: int):
        self.layout = table_layout(slots, slot_bytes)
        self.cache = KVCache.allocate(self.layout, "numpy")
        self._rows = self.cache[0].reshape(slots, slot_bytes).view(np.uint8)
        #: slot -> (request id, nonce, deadline)
        self.live: dict[int, tuple[str, bytes, float]] = {}
        #: slot -> (consumer TP size, the consumer ranks that are done) of live grants
        self._done: dict[int, tuple[int, set]] = {}

    def row(self, slot: int) -> np.ndarray:
        """The bytes of ``slot`` (a view)."""
        return self._rows[slot]

    def write(self, slot: int, record: GrantRecord, req_id: str, deadline: float) -> None:
        data = encode(record)
        row = self._rows[slot]
        if len(data) > row.size:
            raise KVABIError(f"kvabi_grant: a record of {len(data)} bytes exceeds the "
                             f"table's {row.size}-byte slots")
        row[:HEADER] = 0  # no record while the body changes
        row[HEADER:len(data)] = np.frombuffer(data[HEADER:], np.uint8)
        row[:HEADER] = np.frombuffer(data[:HEADER], np.uint8)
        self.live[slot] = (req_id, record.nonce, deadline)
        self._done.pop(slot, None)

    def _close(self, slot: int, state: int) -> str:
        req_id, _, _ = self.live.pop(slot)
        self._done.pop(slot, None)
        self._rows[slot, 8] = state  # the nonce stays: a replay learns it was read
        return req_id

    def release(self, slot: int, nonce: bytes, rank: int = 0, size: int = 1) -> str | None:
        """Consumer rank ``rank`` of ``size`` is done with the live grant ``slot`` holding
        ``nonce``: the request (then released) once every one of the ``size`` ranks is,
        :data:`PENDING` before that; None for no live grant of this slot and nonce, or a
        size other than the first notification's."""
        held = self.live.get(slot)
        if held is None or not hmac.compare_digest(held[1], nonce):
            return None
        want, done = self._done.setdefault(slot, (size, set()))
        if size != want:
            return None
        done.add(rank)
        if len(done) < want:
            return PENDING
        return self._close(slot, RELEASED)

    def closed(self, slot: int, nonce: bytes) -> bool:
        """Whether ``slot`` holds the record of grant ``nonce``, no longer live (a second
        notification for a grant already released: e.g. the proxy's after the consumer's)."""
        if not 0 <= slot < len(self._rows) or slot in self.live:
            return False
        head = read_header(self._rows[slot])
        return head is not None and hmac.compare_digest(head[1], nonce)

    def expire(self, now: float | None = None) -> list[str]:
        """Requests whose grants passed their deadline (then expired)."""
        now = time.monotonic() if now is None else now
        return [self._close(s, EXPIRED) for s, (_, _, d) in list(self.live.items()) if d <= now]


__all__ = ["GrantBook", "GrantTable", "PENDING"]
