"""``kvabi.tensors.to_jax`` of host arrays: no XLA compile per new shape (a step of a new
size must not pay one), and a copy the caller may overwrite at once."""
from __future__ import annotations

import numpy as np
import pytest

from kvabi.util.tensors import to_jax

jax = pytest.importorskip("jax")
_count = {"n": 0}


def _listener(event, duration, **_kw):
    if event == "/jax/core/compile/backend_compile_duration":
        _count["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def test_new_shapes_compile_nothing():
    to_jax(np.zeros((1, 3), np.float32))  # the first transfer of a process may set up
    before = _count["n"]
    for t in range(2, 9):
        for dt in (np.float32, np.float64, np.int64):
            a = to_jax(np.ones((t, 3), dt))
            assert a.shape == (t, 3)
        to_jax(np.ones((t, 3)), "bfloat16")
    assert _count["n"] == before


def test_the_caller_may_reuse_its_buffer():
    for _ in range(50):
        buf = np.zeros(1 << 14, np.float32)
        a = to_jax(buf)
        buf[:] = 5.0
        assert float(np.asarray(a).max()) == 0.0
    torch = pytest.importorskip("torch")
    t = torch.zeros(8)
    assert str(to_jax(t, "float16").dtype) == "float16"
