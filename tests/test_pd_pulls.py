"""Pulls off the engine's thread: a stuck pull is given up at its deadline while the
others finish; a given-up pull's commit refuses (no byte lands after the engine gave up);
the queue is bounded; errors come back as reasons, never as a dead thread."""
import os
import threading
import time

import pytest

from kvabi import KVABIError

from kvabi.pd.pulls import Puller, on_any_core


def _wait(puller, n, limit=60.0):
    """The first ``n`` pulls that end; AssertionError saying which ended after ``limit``."""
    out, t0 = [], time.monotonic()
    while len(out) < n:
        assert time.monotonic() - t0 < limit, \
            f"waited {limit:g} s for {n} pulls to end, {len(out)} did: {out}"
        out += puller.collect()
        time.sleep(0.01)
    return dict(out)


def test_a_stuck_pull_is_given_up_and_the_others_finish():
    release = threading.Event()
    landed = []

    def run(job):
        if job.work == "frozen":
            release.wait(5)  # a peer that answers only after the engine gave up
            with job.commit:  # the copy into the request's blocks
                landed.append(job.req_id)
            return
        if job.work == "bad":
            raise KVABIError("kvabi_grant: forged")
        if job.work == "crash":
            raise IndexError("a bug")
        with job.commit:
            landed.append(job.req_id)

    p = Puller(run, max_jobs=8, timeout_s=0.5, threads=2)
    try:
        t0 = time.monotonic()
        for req, work in [("f", "frozen"), ("a", "ok"), ("b", "bad"), ("c", "crash"),
                          ("d", "ok")]:
            assert p.submit(req, work) is None
        got = _wait(p, 5)
        assert time.monotonic() - t0 < 3.0
        assert got["a"] is None and got["d"] is None
        assert got["b"] == "kvabi_grant: forged"
        assert got["c"].startswith("pull: internal error: IndexError")
        assert got["f"].startswith("pull: no answer within pull_timeout_s = 0.5 s")
        release.set()
        time.sleep(0.2)
        assert "f" not in landed and sorted(landed) == ["a", "d"]  # the late copy refused
        assert len(p) == 0 and p.collect() == []
    finally:
        release.set()
        p.stop()


def test_queue_is_bounded():
    gate = threading.Event()
    p = Puller(lambda job: gate.wait(5), max_jobs=2, timeout_s=10, threads=1)
    try:
        assert p.submit("a", 1) is None and p.submit("b", 1) is None
        why = p.submit("c", 1)
        assert why.startswith("max_pulls: 2 pulls are already queued or running")
        gate.set()
        assert set(_wait(p, 2)) == {"a", "b"}
        assert p.submit("c", 1) is None
    finally:
        gate.set()
        p.stop()


def test_job_left_raises_past_the_deadline():
    seen = []

    def run(job):
        seen.append(job.left())
        time.sleep(0.7)
        job.left()  # past deadline - GRACE: the stage reports its own reason

    p = Puller(run, max_jobs=2, timeout_s=1.0, threads=1)
    try:
        p.submit("a", None)
        got = _wait(p, 1)
        assert 0 < seen[0] <= 0.5 and got["a"] == "pull: past its deadline (pull_timeout_s)"
    finally:
        p.stop()


def test_an_abandoned_commit_refuses():
    from kvabi.pd.pulls import Commit

    c = Commit()
    with c:
        pass
    c.abandon()
    with pytest.raises(KVABIError, match="given up after its deadline"):
        with c:
            pass


def test_pull_threads_of_a_pinned_engine_run_on_any_core():
    """An engine thread bound to one core (vLLM's CPU worker binds its main thread, and so
    every thread it starts, to its OpenMP cores): the pull threads and a thread started
    through ``on_any_core`` (NIXL's progress thread is started that way) may run on every
    core the process may use, and so may the threads they start.  Bound beside the
    engine's spinning threads, a first pull waited past its deadline."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no sched_setaffinity on this platform")
    everything = os.sched_getaffinity(0)
    if len(everything) < 2:
        pytest.skip("one core: nothing to bind apart")
    seen = {}

    def engine():  # a thread of its own: pytest's thread keeps its cores
        os.sched_setaffinity(0, {min(everything)})
        seen["engine"] = os.sched_getaffinity(0)

        def pull(job):
            seen["pull"] = os.sched_getaffinity(0)

        def agent():
            inner = threading.Thread(target=lambda: seen.setdefault(
                "progress", os.sched_getaffinity(0)))
            inner.start()
            inner.join()
            return os.sched_getaffinity(0)

        seen["agent"] = on_any_core(agent)
        p = Puller(pull, max_jobs=1, timeout_s=30, threads=1)
        try:
            p.submit("r", "work")
            seen["ended"] = _wait(p, 1)
        finally:
            p.stop()

    t = threading.Thread(target=engine)
    t.start()
    t.join(60)
    assert not t.is_alive(), "waited 60 s for the pinned engine thread's pull"
    assert seen.get("ended") == {"r": None}, f"the pull did not end well: {seen}"
    assert seen["engine"] == {min(everything)}, "the engine thread was not pinned"
    assert {k: seen[k] for k in ("pull", "agent", "progress")} == dict.fromkeys(
        ("pull", "agent", "progress"), everything)
