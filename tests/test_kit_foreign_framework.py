"""The foreign_framework check: a cache of another framework is refused by name (or
converted right) by every built-in backend here, and the check catches a backend that lets
it reach its kernels or refuses it without saying why."""
from __future__ import annotations

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import KVABIError
from kvabi.reference import ReferenceBackend
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
    """Skips the framework check: torch planes reach numpy's fancy indexing."""
    name = "planted.blind"

    def capabilities(self, spec=None):  # writes unquantized values only
        return attrs.evolve(super().capabilities(spec), quant=("none",))

    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        c = kvabi.as_cache(cache, layout)  # no framework: the planted bug
        view = c.kv_view(layer, 0)
        np.add.at(view, (np.zeros(1, np.int64),), np.asarray(key)[:1])  # TypeError on torch
        return cache


class _Mute(ReferenceBackend):
    """Refuses, but without naming the frameworks."""
    name = "planted.mute"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        if kvabi.as_cache(cache, layout).framework != "numpy":
            raise KVABIError("cache: bad")
        return super().write_kv(cache, layout, key, value, plan, layer=layer, **scales)


class _Converts(ReferenceBackend):
    """Converts a foreign cache to numpy, writes, and returns the numpy handle: allowed."""
    name = "planted.converts"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        c = kvabi.as_cache(cache, layout)
        if c.framework != "numpy":
            c = kvabi.KVCache.wrap(layout, [np.array(kvabi.tensors.to_numpy(p)) for p in c])
        return super().write_kv(c, layout, key, value, plan, layer=layer, **scales)


@pytest.mark.parametrize("cls,status,says", [(_Blind, "failed", "not refused with KVABIError"),
                                             (_Mute, "failed", "does not name both"),
                                             (_Converts, "passed", "")])
def test_the_check_catches_what_it_is_for(cls, status, says):
    pytest.importorskip("torch")
    res = _run(cls(), n=5)
    assert res.status.lower() == status, res.message
    assert says in res.message
