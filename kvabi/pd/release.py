"""Releasing a grant nobody will read (``specs/pd.md`` section 4.7): the proxy holds the
answer of every request it sent a producer, so it can tell the producer's ranks that the
grant is done (the notification a consumer rank sends, as consumer rank 0 of 1) once the
consumer's answer ended, however it ended (served, refused, failed, the client gone): a
request the consumer never reads then does not hold the producer's blocks until
``hold_timeout_s``.  A notification for a grant the consumer already released is a no-op
on the producer.

From a NIXL agent of the proxy's own, on one thread of its own (NIXL calls block).
Nothing here trusts the answer: anything malformed is logged and skipped (the grant then
expires on the producer).
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import hashlib
import logging
import time
import uuid

from ..util.coerce import as_int
from ..util.errors import KVABIError
from .notify import notify_message

log = logging.getLogger("kvabi.pd.proxy")
#: producers' grant tables kept connected (least recently used dropped)
MAX_TABLES = 16
#: seconds a notification is given to leave before the agent closes (NIXL sends them in the
#: background and drops what is still queued when its agent goes)
FLUSH_S = 1.0


def grant_of(answer) -> tuple[int, bytes, list]:
    """(slot, nonce, grant-table messages) of a producer's answer; KVABIError naming the
    field otherwise."""
    grant, tables = answer.get("kvabi_grant"), answer.get("kvabi_grants")
    if not isinstance(grant, dict) or not isinstance(grant.get("nonce"), str):
        raise KVABIError("kvabi_grant: missing from the producer's answer")
    slot = as_int(grant.get("slot"), "kvabi_grant.slot", lo=0)
    try:
        nonce = bytes.fromhex(grant["nonce"])
    except ValueError:
        raise KVABIError("kvabi_grant.nonce: not hex") from None
    tables = [tables] if isinstance(tables, str) else tables
    if not isinstance(tables, list) or not tables or not all(isinstance(t, str) for t in tables):
        raise KVABIError("kvabi_grants: missing from the producer's answer")
    return slot, nonce, tables


class GrantReleaser:
    """Sends producers' ranks the notification that releases a grant (module docstring)."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._agent = None
        self._tables: collections.OrderedDict = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="release")
        #: grants released (notifications sent), and those that could not be
        self.sent = self.failed = 0
        self._last_sent = 0.0

    def start(self) -> None:
        """Make the agent now, off the event loop (the first release should not wait)."""
        self._pool.submit(self._agent_or_none)

    async def release(self, answer) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._release, answer)

    def release_now(self, answer) -> None:
        """:meth:`release`, waited for (outside an event loop)."""
        self._pool.submit(self._release, answer).result()

    def _release(self, answer) -> None:
        try:
            slot, nonce, tables = grant_of(answer)
            note = notify_message(slot, nonce)
            for msg in tables:
                self._agent_().notify(self._table(msg), note)
            self.sent += 1
            self._last_sent = time.monotonic()
        except KVABIError as e:
            self.failed += 1
            log.warning("proxy: could not release a grant (it expires on the producer after "
                        "hold_timeout_s): %s", e)

    def _agent_or_none(self):
        try:
            return self._agent_()
        except KVABIError:
            return None

    def _agent_(self):
        if self._agent is None:
            from ..transfer.nixl import NixlAgent, available

            ok, why = available()
            if not ok:
                raise KVABIError(f"nixl: {why}")
            try:
                self._agent = NixlAgent(f"kvabi-proxy-{uuid.uuid4().hex[:8]}", host=self.host)
            except KVABIError as e:
                log.error("proxy: no NIXL agent (%s): grants of requests the consumer does "
                          "not read stay held until hold_timeout_s", e)
                raise
        return self._agent

    def _table(self, message: str):
        key = hashlib.blake2b(message.encode(), digest_size=16).digest()
        peer = self._tables.get(key)
        if peer is None:
            peer = self._tables[key] = self._agent_().connect(message, timeout=5.0)
            while len(self._tables) > MAX_TABLES:
                self._agent.disconnect(self._tables.popitem(last=False)[1])
        self._tables.move_to_end(key)
        return peer

    def close(self) -> None:
        """Stop, once the last notification had time to leave."""
        self._pool.shutdown(wait=True)
        time.sleep(max(0.0, self._last_sent + FLUSH_S - time.monotonic()))
        if self._agent is not None:
            self._agent.close()
            self._agent = None


__all__ = ["GrantReleaser", "grant_of"]
