"""The foreign_framework check: a cache of another framework is refused by name by every
built-in backend here, and by kvabi.Backend for a backend whose own code would let it reach
its kernels."""
from __future__ import annotations

import numpy as np
import pytest

import kvabi
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import get_check, run_check


def _run(backend, n=10):
    return run_check(get_check("foreign_framework"), backend, max_examples=n, seed=5,
                     time_budget=None, shrink=False, replay=None)


@pytest.mark.parametrize("name", ["reference", "example.torch", "tpu.jax", "cuda.triton"])
def test_built_in_backends_refuse_by_name(name):
    backend = kvabi.get_backend(name)
    if not backend.available()[0]:
        pytest.skip(backend.available()[1])
    res = _run(backend)
    assert res.status == "passed", res.message + "\n" + res.example
    assert res.refused == res.examples == 10


class _Blind(ReferenceBackend):
    """Its write would hand torch planes to numpy's fancy indexing (a TypeError deep in
    numpy): the base class refuses the cache by name before it runs."""
    name = "planted.blind"

    def write(self, plan, cache, key, value, layer, **scales):
        view = cache.kv_view(layer, 0)
        np.add.at(view, (np.zeros(1, np.int64),), np.asarray(key)[:1])  # TypeError on torch
        return cache


def test_a_backend_blind_to_frameworks_is_protected_by_the_base_class():
    pytest.importorskip("torch")
    res = _run(_Blind(), n=5)
    assert res.status == "passed", res.message
    assert res.refused == res.examples == 5
