"""The kit drives 1.0 and 1.1 backends each in their own protocol, and its 1.1 checks
catch what 1.1 promises: one plan for every layer, per-call sinks, ``out=`` in place,
``num_q_heads`` at plan time, the output in the query's dtype and lse in float32.

``TorchRef`` is a correct 1.1 torch backend (the reference behind torch tensors, in
place on KVCache planes); the planted bugs each break one promise.
"""
from __future__ import annotations

import collections
import importlib
import sys
from pathlib import Path

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import tensors
from kvabi.errors import KVABIError
from kvabi.reference import ReferenceBackend
from kvabi.testing import CHECKS, KitOptions, get_check, run_check
from kvabi.views import allocate_numpy

torch = pytest.importorskip("torch")

PLUGINS = Path(__file__).parent / "plugins"


def _run(check, backend, n=6, seed=5, options=KitOptions()):
    return run_check(get_check(check), backend, options=options, max_examples=n, seed=seed,
                     time_budget=None, shrink=False, replay=None)


# -- a correct 1.1 torch backend ----------------------------------------------------------
@attrs.frozen(eq=False)
class TorchPlan:
    ref: object
    num_q_heads: int | None


class TorchRef(kvabi.Backend):
    """ABI 1.1 over torch CPU tensors: KVCache planes written in place, per-call sinks,
    ``out=``, output in the query's dtype and lse float32.  Dense layouts only (others are
    refused in ``plan``); computes with the reference on numpy views of the same memory."""

    name = "kittest.torch_ref"
    framework = "torch"

    def __init__(self):
        self._ref = ReferenceBackend()
        self.seen = collections.Counter()

    def capabilities(self, spec=None):  # the reference's, unquantized caches only
        return attrs.evolve(self._ref.capabilities(spec), quant=("none",))

    def preferred_layouts(self, spec):
        out = []
        for name in self._ref.preferred_layouts(spec):
            if kvabi.Layout.preset(name, spec, num_blocks=1).is_c_contiguous:
                out.append(name)
        return tuple(out)

    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        if not layout.is_c_contiguous:
            raise KVABIError(f"layout: {self.name} needs a dense layout, got "
                             f"{layout.name or 'custom'}")
        if num_q_heads is not None:
            self.seen["num_q_heads"] += 1
        s = None if sinks is None else tensors.to_numpy(sinks)
        return TorchPlan(self._ref.plan(meta, spec, layout, num_q_heads=num_q_heads,
                                        scale=scale, softcap=softcap, sinks=s), num_q_heads)

    def _np(self, cache, layout):
        handle = kvabi.as_cache(cache, layout)
        self.seen[type(cache).__name__] += 1
        return handle, [tensors.to_numpy(p) for p in handle]  # same memory (dense, CPU)

    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        handle, planes = self._np(cache, layout)
        self._ref.write_kv(planes, layout, tensors.to_numpy(key),
                           None if value is None else tensors.to_numpy(value), plan.ref,
                           layer=layer)
        return handle

    def compute(self, query, cache, layout, plan, layer, sinks):
        _, planes = self._np(cache, layout)
        s = None if sinks is None else tensors.to_numpy(sinks)
        if s is not None:
            self.seen["per-call sinks"] += 1
        return self._ref.attention(tensors.to_numpy(query), planes, layout, plan.ref,
                                   layer=layer, sinks=s, return_lse=True)

    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False):
        o, lse = self.compute(query, cache, layout, plan, layer, sinks)
        res = torch.from_numpy(o.astype(np.float32)).to(query.dtype)
        if out is not None:
            self.seen["out"] += 1
            out.copy_(res)
            res = out
        lse = torch.from_numpy(lse.astype(np.float32))
        return (res, lse) if return_lse else res


@pytest.mark.parametrize("check", [c.name for c in CHECKS])
def test_torch_11_backend_passes_every_check(check):
    b = TorchRef()
    res = _run(check, b)
    assert res.status in ("passed", "n/a"), res.message + "\n" + res.example
    assert not b.seen["list"], "a 1.1 backend was handed a plain list in a normal check"


def test_torch_11_backend_gets_the_11_keywords():
    b = TorchRef()
    res = _run("attention", b, n=12, options=KitOptions(dtypes=("float32",)))
    assert res.status == "passed", res.message
    assert b.seen["KVCache"] and b.seen["num_q_heads"] and b.seen["out"]
    assert b.seen["per-call sinks"]


# -- the 1.0 backend ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def abi10():
    sys.path.insert(0, str(PLUGINS))
    try:
        yield importlib.import_module("kvabi_abi10_plugin")
    finally:
        sys.path.remove(str(PLUGINS))


@pytest.mark.parametrize("check", [c.name for c in CHECKS])
def test_abi10_backend_passes_every_check(abi10, check):
    b = abi10.Abi10Backend()
    res = _run(check, b)
    assert res.status in ("passed", "n/a"), res.message + "\n" + res.example
    if res.status == "passed" and check not in ("unsupported", "huge_lengths"):
        assert b.seen["list cache"] or b.seen["plan"]


def test_abi10_backend_is_driven_the_10_way(abi10):
    """Its own asarray/to_numpy convert the arrays; caches are plain lists."""
    b = abi10.Abi10Backend()
    res = _run("attention", b, n=8)
    assert res.status == "passed", res.message
    assert b.seen["asarray"] and b.seen["to_numpy"] and b.seen["list cache"]


def test_abi10_plugin_registers(abi10):
    from kvabi import registry

    registry.reset()
    try:
        registry.register(abi10, name="abi10")
        assert registry.get_backend("abi10.reference").abi_version == (1, 0)
    finally:
        registry.reset()


# -- planted 1.1 bugs ------------------------------------------------------------------------
class Float64Output(TorchRef):
    """Returns the float64 result for every query (no cast to the query's dtype)."""

    name = "planted.float64_output"

    def attention(self, query, cache, layout, plan, *, layer=0, sinks=None, out=None,
                  return_lse=False):
        o, lse = self.compute(query, cache, layout, plan, layer, sinks)
        res = torch.from_numpy(o)
        return (res, torch.from_numpy(lse.astype(np.float32))) if return_lse else res


class Float64Lse(TorchRef):
    name = "planted.float64_lse"

    def attention(self, *a, return_lse=False, **kw):
        got = super().attention(*a, return_lse=return_lse, **kw)
        return (got[0], got[1].double()) if return_lse else got


class OutNotInPlace(TorchRef):
    """Returns a new tensor and leaves ``out`` as it was."""

    name = "planted.out_not_in_place"

    def attention(self, *a, out=None, **kw):
        return super().attention(*a, **kw)


class LayerStateInPlan(ReferenceBackend):
    """Remembers the first layer it attends in the plan and reads that layer ever after."""

    name = "planted.layer_state_in_plan"

    def __init__(self):
        super().__init__()
        self._first = {}  # plan id -> the first layer attended with it (the bug)

    def attention(self, query, cache, layout, plan, *, layer=0, **kw):
        first = self._first.setdefault(id(plan), (plan, layer))[1]
        return super().attention(query, cache, layout, plan, layer=first, **kw)


class SinksOnlyAtPlan(ReferenceBackend):
    """Ignores per-call sinks: every layer gets the plan's."""

    name = "planted.sinks_only_at_plan"

    def attention(self, *a, sinks=None, **kw):
        return super().attention(*a, **kw)


class PerCallSinksStick(ReferenceBackend):
    """Stores per-call sinks in the plan: later calls without sinks keep them."""

    name = "planted.per_call_sinks_stick"

    def attention(self, query, cache, layout, plan, *, sinks=None, **kw):
        if sinks is not None:
            object.__setattr__(plan, "sinks", np.asarray(sinks, np.float64))
        return super().attention(query, cache, layout, plan, **kw)


PLANTED = [
    (Float64Output, KitOptions(dtypes=("float32",)), "output dtype: float64, expected the "
                                                     "query's float32"),
    (Float64Lse, KitOptions(dtypes=("float32",)), "lse dtype: float64"),
    (OutNotInPlace, KitOptions(dtypes=("float32",)), "not written in place"),
    (LayerStateInPlan, KitOptions(), "with one plan"),
    (SinksOnlyAtPlan, KitOptions(), "per-call sinks"),
    (PerCallSinksStick, KitOptions(), "with one plan"),
]


@pytest.mark.parametrize("bug, options, phrase", PLANTED, ids=[b.__name__ for b, _, _ in PLANTED])
def test_planted_11_bug_fails_the_attention_check(bug, options, phrase):
    res = _run("attention", bug(), n=40, seed=11, options=options)
    assert res.failed, f"{bug.__name__} passed the attention check ({res.examples} examples)"
    assert phrase in res.message, res.message


def test_dtype_failure_is_structured():
    res = _run("attention", Float64Output(), n=20, options=KitOptions(dtypes=("float32",)))
    assert res.failed
    d = res.exception.details
    assert d == {"got_dtype": "float64", "want_dtype": "float32"}


# -- the refusal checks report a backend's own exception --------------------------------------
class CrashesOnBf16(ReferenceBackend):
    """Claims float32 only and crashes with a TypeError on bfloat16, instead of a
    KVABIError."""

    name = "planted.crashes_on_bf16"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), dtypes=("float32",))

    def plan(self, meta, spec, layout, **kw):
        if spec.dtype != "float32":
            raise TypeError(f"no kernel for {spec.dtype}")
        return super().plan(meta, spec, layout, **kw)


def test_foreign_exception_is_reported_with_its_place():
    res = _run("unsupported", CrashesOnBf16(), n=30,
               options=KitOptions())
    assert res.failed
    assert "not refused with KVABIError: TypeError: no kernel for" in res.message
    assert "test_kit_abi_versions.py:" in res.message and "in plan" in res.message
    assert res.exception.details["raised_at"].startswith("test_kit_abi_versions.py:")


class Float32Only10(kvabi.Backend):
    """A 1.0 backend claiming float32 and float16 whose own ``asarray`` cannot take a
    bfloat16 array (the kit used to hand it bfloat16 planes before ``plan`` could
    refuse the spec); it refuses unsupported specs in ``plan``."""

    abi_version = (1, 0)
    name = "planted.float32_only_10"

    def __init__(self):
        self._ref = ReferenceBackend()

    def capabilities(self, spec=None):
        return attrs.evolve(self._ref.capabilities(spec), dtypes=("float32", "float16"))

    def preferred_layouts(self, spec):
        return self._ref.preferred_layouts(spec)

    def asarray(self, x):
        if str(np.asarray(x).dtype) not in ("float32", "float16", "float64"):
            raise TypeError(f"cannot convert {np.asarray(x).dtype}")
        return np.array(x)

    def to_numpy(self, x):
        return np.asarray(x)

    def allocate(self, layout):
        return allocate_numpy(layout, 0)

    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        return self._ref.plan(meta, spec, layout, scale=scale, softcap=softcap, sinks=sinks)

    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        return self._ref.write_kv(list(cache), layout, key, value, plan, layer=layer)

    def attention(self, query, cache, layout, plan, *, layer=0, return_lse=False):
        return self._ref.attention(query, list(cache), layout, plan, layer=layer,
                                   return_lse=return_lse)


def test_plan_refuses_before_any_cache_is_handed_over():
    res = _run("unsupported", Float32Only10(), n=30)
    assert res.status == "passed", res.message
    assert res.refused == res.examples > 0
