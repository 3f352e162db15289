"""Pulls off the engine's thread, each bounded by a deadline (``specs/pd.md`` 6.2).

A decode engine hands each request's pull to a few background threads and keeps stepping
(a frozen peer holds one thread, not the others); at every step it collects the pulls
that finished, and gives up on any not done by its deadline (``pull_timeout_s`` after it
was queued): that request is reported failed at once (the engine fails or recomputes it, its
blocks return to the pool), whatever the peer does next.  The bytes of a pull reach the
request's blocks only inside its :class:`Commit`, and a given-up pull's commit refuses:
a READ that completes after its deadline lands in a staging buffer, never in blocks that
may already belong to another request.
"""
from __future__ import annotations

import logging
import queue
import threading
import time

from ..util.errors import KVABIError

log = logging.getLogger(__name__)

_STOP = object()
#: seconds before its deadline a pull's own stages stop waiting
GRACE = 0.5


class Commit:
    """Held while a pull copies into its request's blocks; :meth:`abandon` makes every
    later entry raise (and waits for a copy in progress to end: a local copy, bounded)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.abandoned = False

    def __enter__(self):
        self._lock.acquire()
        if self.abandoned:
            self._lock.release()
            raise KVABIError("pull: given up after its deadline (pull_timeout_s)")
        return self

    def __exit__(self, *exc):
        self._lock.release()
        return False

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True


class Job:
    """One request's pull: ``run(job)`` does it (raising KVABIError with the reason)."""

    def __init__(self, req_id: str, work, deadline: float):
        self.req_id = req_id
        self.work = work
        self.deadline = deadline
        self.commit = Commit()
        self.started = None
        self.peers: list = []  # what the pull holds (the worker side's connected peers)

    def left(self) -> float:
        """Seconds a stage of the pull may still take: up to a little before the deadline,
        so that a stage that times out reports its own reason before the engine gives up
        (KVABIError once that time has passed)."""
        t = self.deadline - time.monotonic() - GRACE
        if t <= 0 or self.commit.abandoned:
            raise KVABIError("pull: past its deadline (pull_timeout_s)")
        return t


class Puller:
    """At most ``max_jobs`` pulls queued or running, run by ``threads`` threads (started on
    first use) with ``run(job)``."""

    def __init__(self, run, max_jobs: int, timeout_s: float, threads: int = 4,
                 settings_at: str = ""):
        self._run = run
        self.max_jobs = max_jobs
        self.timeout_s = timeout_s
        self.threads = threads
        self._at = settings_at  # where the engine's configuration states max_pulls
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}           # queued or running
        self._done: list[tuple[str, str | None]] = []  # (request id, None or the reason)
        self._threads: list[threading.Thread] = []
        #: set when a pull ends (an engine's idle wait wakes on it)
        self.ended = threading.Event()

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, req_id: str, work) -> str | None:
        """Queue a pull; the reason it is refused (too many), or None."""
        with self._lock:
            if len(self._jobs) >= self.max_jobs:
                return (f"max_pulls: {len(self._jobs)} pulls are already queued or running "
                        f"({self._at}max_pulls = {self.max_jobs})")
            job = Job(req_id, work, time.monotonic() + self.timeout_s)
            self._jobs[req_id] = job
        if not self._threads:
            for i in range(self.threads):
                t = threading.Thread(target=self._loop, name=f"kvabi-pull-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        self._queue.put(job)
        return None

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pull queued or running (None: none)."""
        with self._lock:
            return min((j.deadline for j in self._jobs.values()), default=None)

    def collect(self) -> list[tuple[str, str | None]]:
        """The pulls that ended since the last call, and those given up now (past their
        deadline): (request id, None when it succeeded, else the reason)."""
        self.ended.clear()
        now = time.monotonic()
        late = []
        with self._lock:
            for req_id, job in list(self._jobs.items()):
                if job.deadline <= now:
                    late.append(job)
                    del self._jobs[req_id]
            done, self._done = self._done, []
        for job in late:  # outside the lock: abandon may wait for a copy in progress
            job.commit.abandon()
            done.append((job.req_id, f"pull: no answer within pull_timeout_s = "
                                     f"{self.timeout_s:g} s (peer slow, frozen or gone)"))
        return done

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if job.commit.abandoned:
                continue
            job.started = time.monotonic()
            try:
                self._run(job)
                reason = None
            except KVABIError as e:
                reason = str(e)
            except Exception as e:  # noqa: BLE001 - never let one pull end the thread
                log.exception("kvabi.pd: pull of request %s failed", job.req_id)
                reason = f"pull: internal error: {type(e).__name__}: {e}"
            with self._lock:
                if self._jobs.pop(job.req_id, None) is job:
                    self._done.append((job.req_id, reason))
            self.ended.set()

    def stop(self, timeout: float = 5.0) -> None:
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join(timeout)
        self._threads = []


__all__ = ["Commit", "Job", "Puller"]
