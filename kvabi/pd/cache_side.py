"""A rank's cache side (``specs/pd.md`` section 1): the memory half of an engine's P/D.

It registers the rank's cache with NIXL, serves its parts and grant table (producer),
pulls (consumer), keeps the host tier, and each step does the front's
:class:`~.work.StepWork` and reports :class:`~.work.Results`: the pulls that ended and why
any failed, and the held requests whose blocks the engine may free.
"""
from __future__ import annotations

import collections
import logging
import time
import uuid

from .consumer import Consumer
from .engine import EngineCaches
from .host_tier import HostTier
from .producer import Producer
from .settings import PDSettings
from .work import Results, Served, StepWork

#: refusals kept for inspection (the log has every one)
REFUSALS = 256
#: longest wait of an engine step that computes nothing while the cache side holds grants
#: or runs pulls (an engine would otherwise step back to back for nothing); it ends at once
#: when a pull ends or a notification comes
IDLE_WAIT_S = 0.02
#: how often that wait looks for notifications (NIXL has no blocking wait for them)
NOTIFY_POLL_S = 0.002


class CacheSide:
    """The cache side of one rank: ``caches`` (:class:`~.engine.EngineCaches`) under
    ``settings``.  ``log``/``label``: where and under which name failures are logged;
    ``fix(message)``: the message with what to change in the engine's configuration (for
    refusals caused by how the engines were started); ``after_pull``/``after_load``: see
    :class:`~.consumer.Consumer` and :class:`~.host_tier.HostTier`; ``settings_at``: where
    the engine's configuration states the bounds (a prefix of their names in messages)."""

    def __init__(self, settings: PDSettings, caches: EngineCaches, *,
                 log: logging.Logger | None = None, label: str = "kvabi.pd", fix=None,
                 after_pull=None, after_load=None, settings_at: str = ""):
        self.settings = settings
        self.caches = caches
        self._log = log or logging.getLogger("kvabi.pd")
        self._label = label
        self._fix = fix or (lambda m: m)
        self.agent = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        if settings.producer or settings.consumer:
            from ..transfer.nixl import NixlAgent

            self.agent = NixlAgent(f"kvabi-{caches.engine_id}-{uuid.uuid4().hex[:8]}",
                                   host=settings.nixl_host)
            for g in caches.groups:
                for _, c in g.parts:
                    self.agent.register(c)
        kw = {"log": self._log, "label": label}
        if settings.producer:
            self.producer = Producer(self.agent, caches, settings, **kw)
        if settings.consumer:
            self.consumer = Consumer(self.agent, caches, settings, after_pull=after_pull,
                                     settings_at=settings_at, **kw)
        self.host = HostTier(caches, settings.host_blocks, after_load=after_load) \
            if settings.host_blocks else None
        self._refused: list[tuple[str, str]] = []    # refused where they entered
        self._saved: set[str] = set()                # host saves done, blocks not yet freed
        self._sent: set[str] = set()                 # grants closed, blocks not yet freed
        self._finished: set[str] = set()             # of those, ids the engine said ended
        #: (request id, reason) of the latest failed loads
        self.refusals: collections.deque = collections.deque(maxlen=REFUSALS)
        #: idle steps waited and the seconds they waited (monitoring, tests)
        self.idle_waits = [0, 0.0]

    def served(self) -> Served | None:
        """What this rank serves (for the front), or None (nothing)."""
        seed = self.host.seed if self.host is not None else b""
        if self.producer is None and not seed:
            return None
        if self.producer is None:
            return Served(host_seed=seed)
        return Served(handshakes=list(self.producer.handshakes), grants=self.producer.grants,
                      host_seed=seed)

    def apply(self, work: StepWork) -> None:
        """The step's work from the front, in its order."""
        self._refused += [(f.req_id, f.reason) for f in work.fails]
        for p in work.pulls:
            why = self.consumer.submit(p) if self.consumer is not None else \
                "kv_role: this engine is not a consumer"
            if why is not None:
                self._refused.append((p.req_id, why))
        for g in work.grants:
            self.producer.publish(g)
        for ld in work.loads:
            self.host.load(ld)
        for key in work.evicts:
            self.host.evict(key)
        for s in work.saves:
            self.host.save(s)
            self._saved.add(s.req_id)

    def results(self, finished=()) -> Results:
        """What happened since the last call: ``sent``, held requests (grants closed, saves
        done) among those the engine said ended (``finished``, this call or before);
        ``received``, pulls that ended; ``failed``, their reasons and those of refusals."""
        held = set()
        if self.producer is not None:
            self._sent |= self.producer.poll()
            held = self.producer.held()
        pending = self._sent | self._saved
        # ids of no interest here are not kept
        self._finished |= set(finished) & (pending | held)
        done = pending & self._finished
        self._finished -= done
        self._sent -= done
        self._saved -= done
        ended = self.consumer.collect() if self.consumer is not None else []
        ended += self._refused
        self._refused = []
        failed = {}
        for req_id, why in ended:
            if why is not None:
                self._log.error("%s: load of request %s failed: %s", self._label, req_id,
                                self._fix(str(why)))
                self.refusals.append((req_id, why))
                failed[req_id] = str(why)
        return Results(sent=done, received={r for r, _ in ended}, failed=failed)

    def idle_wait(self) -> None:
        """For a step that computes nothing, taken only because this cache side holds grants
        or runs pulls: wait (up to IDLE_WAIT_S, never past a pull's deadline) until a pull
        ends or a notification arrives, so that the engine does not spin meanwhile."""
        holds = self.producer is not None and bool(self.producer.table.live)
        pulls = self.consumer is not None and self.consumer.running() > 0
        if not (holds or pulls) or self._refused:
            return
        t0 = time.monotonic()
        end = t0 + IDLE_WAIT_S
        if pulls:
            end = min(end, self.consumer.next_deadline() or end)
        while not (pulls and self.consumer.ended.is_set()):
            if holds:
                got = self.agent.drain_notifications()
                if got:
                    self.producer.notes += got
                    break
            left = end - time.monotonic()
            if left <= 0:
                break
            if pulls:
                self.consumer.ended.wait(min(left, NOTIFY_POLL_S) if holds else left)
            else:
                time.sleep(min(left, NOTIFY_POLL_S))
        self.idle_waits[0] += 1
        self.idle_waits[1] += time.monotonic() - t0

    def part_layouts(self) -> list[dict[str, str]]:
        """Per KV cache group, each part's layout name (what this rank serves and reads)."""
        return [{part: c.layout.name for part, c in g.parts} for g in self.caches.groups]

    def table_sizes(self) -> dict[str, int]:
        """Entries of every per-request table (for tests and monitoring)."""
        c = self.consumer.table_sizes() if self.consumer is not None else \
            {"pulls": 0, "peers": 0, "pull_stats": 0, "used_grants": 0}
        return {**c, "saved": len(self._saved), "sent": len(self._sent),
                "finished": len(self._finished),
                "grants": len(self.producer.table.live) if self.producer is not None else 0,
                "host_blocks": len(self.host) if self.host is not None else 0,
                "refusals": len(self.refusals)}

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.stop()
        if self.agent is not None:
            self.agent.close()
            self.agent = None


__all__ = ["CacheSide"]
