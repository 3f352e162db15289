"""Counting XLA compiles: how ``kvabi bench tpu`` and the tests see a compile cliff.

jax reports the duration of every backend compile (a jitted step, and any small operation
on a new shape) as the monitoring event below; one listener, registered on first use,
counts them for the whole process.
"""
from __future__ import annotations

import threading

EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_state = {"registered": False, "count": 0, "seconds": 0.0}


def _listener(event: str, duration: float, **_kw) -> None:
    if event == EVENT:
        with _lock:
            _state["count"] += 1
            _state["seconds"] += duration


def compiles() -> tuple[int, float]:
    """(XLA compiles so far in this process, seconds they took); the count starts when this
    is first called."""
    if not _state["registered"]:
        from jax import monitoring

        with _lock:
            if not _state["registered"]:
                monitoring.register_event_duration_secs_listener(_listener)
                _state["registered"] = True
    return _state["count"], _state["seconds"]
