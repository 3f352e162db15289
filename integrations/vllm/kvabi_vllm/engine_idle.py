"""An engine that only holds what KvabiConnector keeps for it stays idle.

vLLM keeps stepping an engine while a finished request's blocks are held for a KV
connector (a grant a decode engine has not read yet) or a request waits for its remote
KV: ``EngineCore`` steps it back to back, sleeping 1 ms between steps.  Every step is a
message to the worker process and one back, and vLLM's shared-memory message queues spin
(``os.sched_yield``) for ``busy_loop_s`` = 1 s after each message they read before they
sleep on their socket: a prefill server holding one grant nobody reads spent about 1.2
cores until the grant expired (``py-spy``: the worker's main thread in
``MessageQueue.dequeue`` -> ``SpinCondition.wait`` -> ``sched_yield``, the engine core in
its 1 ms sleep and its own queue's spin), against 0.02-0.06 idle.

Two parts make such an engine idle:

- the connector's worker side waits in a step that computes nothing (up to
  ``kvabi.pd.cache_side.IDLE_WAIT_S``, waking at once when a pull ends or a notification
  arrives), so that such steps come tens of milliseconds apart, not one;
- the engine's message queues stop spinning :data:`SPIN_S` after their last message
  (:func:`quiet_queues`), so that nothing spins between those steps.  Steps of a busy
  engine come faster than that: it spins as before.

:func:`quiet_queues` runs in every vLLM process of an engine that uses KvabiConnector (the
main process says so in :data:`ENV`, which the engine's processes inherit; the plugin reads
it where it loads).
"""
from __future__ import annotations

import os

#: set (to "1") by the main process of an engine that uses KvabiConnector
ENV = "KVABI_VLLM_QUIET_QUEUES"
#: seconds a message queue keeps spinning after its last message (vLLM's: 1 s)
SPIN_S = 0.005


def mark() -> None:
    """Ask every process this one starts for its engine to :func:`quiet_queues`."""
    os.environ[ENV] = "1"


def quiet_queues(spin_s: float = SPIN_S) -> bool:
    """Make vLLM's message-queue readers of this process spin at most ``spin_s`` after
    their last message (False where vLLM has no such queue)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return False
    wait = SpinCondition.wait
    if getattr(wait, "_kvabi", False):
        return True

    def quiet_wait(self, timeout_ms=None):
        if self.busy_loop_s > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, timeout_ms)

    quiet_wait._kvabi = True
    SpinCondition.wait = quiet_wait
    return True


def install_if_marked() -> None:
    """:func:`quiet_queues` when the engine's main process :func:`mark` ed it."""
    if os.environ.get(ENV) == "1":
        quiet_queues()


__all__ = ["ENV", "SPIN_S", "install_if_marked", "mark", "quiet_queues"]
