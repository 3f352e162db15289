"""An engine process of KvabiConnector does not spin between steps that come tens of
milliseconds apart (``kvabi_vllm.engine_idle``): a reader of vLLM's own shared-memory
message queue, the way a worker waits for the engine core's next step, sleeps on its
socket for most of the wait, where vLLM's reader calls ``sched_yield`` in a loop for a
second after every message (a core's worth on an idle machine).  Side by side in one
process: how much of the wait the reader slept."""
import threading
import time

from kvabi_vllm import engine_idle


def _slept(gap: float, messages: int) -> tuple[float, float]:
    """(seconds slept on its socket, seconds waited) of a thread reading ``messages``
    messages of vLLM's MessageQueue written ``gap`` seconds apart (an engine stepping
    only for what its connector holds)."""
    from vllm.distributed.device_communicators import shm_broadcast as sb

    writer = sb.MessageQueue(n_reader=1, n_local_reader=1)
    handle = writer.export_handle()
    got = {}

    def read():
        reader = sb.MessageQueue.create_from_handle(handle, 0)
        reader.wait_until_ready()
        poller, slept = reader._spin_condition.poller, [0.0]
        poll = poller.poll

        def timed(*a, **k):
            t = time.monotonic()
            try:
                return poll(*a, **k)
            finally:
                slept[0] += time.monotonic() - t

        poller.poll = timed
        reader.dequeue(timeout=60)  # the first message: from here the reader waits
        slept[0], t0 = 0.0, time.monotonic()
        for _ in range(messages):
            reader.dequeue(timeout=60)
        got["slept"], got["waited"] = slept[0], time.monotonic() - t0

    t = threading.Thread(target=read)
    t.start()
    writer.wait_until_ready()
    for _ in range(messages + 1):
        writer.enqueue("step")
        time.sleep(gap)
    t.join(120)
    assert not t.is_alive(), "waited 120 s for the reader to take every message"
    return got["slept"], got["waited"]


def test_a_queue_reader_sleeps_between_steps_of_an_idle_engine():
    spun_slept, spun_waited = _slept(gap=0.02, messages=25)  # vLLM's own reader first
    assert engine_idle.quiet_queues()
    slept, waited = _slept(gap=0.02, messages=25)
    # vLLM's reader never sleeps within a second of a message; a quiet one after 5 ms of
    # the 20 ms between messages
    assert spun_slept < 0.1 * spun_waited, (spun_slept, spun_waited)
    assert slept > 0.4 * waited, \
        f"a quiet reader slept {slept:.3f} s of {waited:.3f} s waiting for messages"
