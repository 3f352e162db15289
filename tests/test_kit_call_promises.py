"""The kit's checks catch what the calls promise that kvabi.Backend cannot enforce itself:
one plan for every layer, per-call sinks honoured, the output in the query's dtype and lse
in float32; and what the base class does guarantee (``out=`` filled in place) holds for a
backend whose own code ignores it.

``TorchRef`` is a correct torch backend (the reference's math on numpy views of the same
memory); each planted bug breaks one promise in its own methods (prepare, write, attend):
the only place a 2.0 backend can put a bug.
"""
from __future__ import annotations

import collections

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import tensors
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import CHECKS, KitOptions, get_check, run_check

torch = pytest.importorskip("torch")


def _run(check, backend, n=6, seed=5, options=KitOptions()):
    return run_check(get_check(check), backend, options=options, max_examples=n, seed=seed,
                     time_budget=None, shrink=False, replay=None)


# -- a correct torch backend -----------------------------------------------------------------
class TorchRef(kvabi.Backend):
    """The reference behind torch CPU tensors: KVCache planes written in place, output in
    the query's dtype, lse float32.  Dense layouts only (others refused by
    ``layout_refusals``); computes with the reference's glue on numpy views of the same
    memory."""

    name = "kittest.torch_ref"
    framework = "torch"

    def __init__(self):
        self._ref = ReferenceBackend()
        self.seen = collections.Counter()

    def capabilities(self, spec=None):  # the reference's, unquantized caches only
        return attrs.evolve(self._ref.capabilities(spec), quant=("none",))

    def preferred_layouts(self, spec):
        return tuple(n for n in self._ref.preferred_layouts(spec)
                     if kvabi.Layout.preset(n, spec, num_blocks=1).is_c_contiguous)

    def layout_refusals(self, spec, layout):
        return () if layout.is_c_contiguous else (f"layout {layout.name}: not dense",)

    def prepare(self, plan):
        return self._ref.prepare(plan)

    @staticmethod
    def _np(cache):
        return kvabi.KVCache(cache.layout, tuple(tensors.to_numpy(p) for p in cache),
                             _checked=True)  # same memory (dense, CPU)

    def write(self, plan, cache, key, value, layer):
        self._ref.write(plan, self._np(cache), tensors.to_numpy(key),
                        None if value is None else tensors.to_numpy(value), layer)
        return cache

    def compute(self, plan, cache, query, layer, sinks):
        if sinks is not plan.sinks:
            self.seen["per-call sinks"] += 1
        return self._ref.attend(plan, self._np(cache), tensors.to_numpy(query), layer, sinks,
                                None, True)

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        o, lse = self.compute(plan, cache, query, layer, sinks)
        if out is not None:
            self.seen["out"] += 1
        res = torch.from_numpy(o.astype(np.float32)).to(query.dtype)
        return res, torch.from_numpy(lse.astype(np.float32))


@pytest.mark.parametrize("check", [c.name for c in CHECKS])
def test_torch_backend_passes_every_check(check):
    res = _run(check, TorchRef())
    assert res.status in ("passed", "n/a"), res.message + "\n" + res.example


def test_the_attention_check_passes_out_and_per_call_sinks():
    b = TorchRef()
    res = _run("attention", b, n=12, options=KitOptions(dtypes=("float32",)))
    assert res.status == "passed", res.message
    assert b.seen["out"] and b.seen["per-call sinks"]


class IgnoresOut(TorchRef):
    """Its attend never writes ``out``: the base class copies the output there."""

    name = "kittest.ignores_out"

    def attend(self, out, **kw):
        return super().attend(out=None, **kw)


def test_out_is_filled_by_the_base_class_when_the_backend_ignores_it():
    res = _run("attention", IgnoresOut(), n=12, options=KitOptions(dtypes=("float32",)))
    assert res.status == "passed", res.message


# -- planted bugs ----------------------------------------------------------------------------
class Float64Output(TorchRef):
    """Returns the float64 result for every query (no cast to the query's dtype)."""

    name = "planted.float64_output"

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        o, lse = self.compute(plan, cache, query, layer, sinks)
        return torch.from_numpy(o), torch.from_numpy(lse.astype(np.float32))


class Float64Lse(TorchRef):
    name = "planted.float64_lse"

    def attend(self, **kw):
        out, lse = super().attend(**kw)
        return out, lse.double()


class LayerStateInPlan(ReferenceBackend):
    """Remembers the first layer it attends with a plan and reads that layer ever after."""

    name = "planted.layer_state_in_plan"

    def __init__(self):
        super().__init__()
        self._first = {}  # plan id -> the first layer attended with it (the bug)

    def attend(self, plan, layer, **kw):
        first = self._first.setdefault(id(plan), (plan, layer))[1]
        return super().attend(plan=plan, layer=first, **kw)


class SinksOnlyAtPlan(ReferenceBackend):
    """Ignores per-call sinks: every layer gets the plan's."""

    name = "planted.sinks_only_at_plan"

    def attend(self, plan, sinks, **kw):
        return super().attend(plan=plan, sinks=plan.sinks, **kw)


class PerCallSinksStick(ReferenceBackend):
    """Keeps the last per-call sinks for the plan: later calls without sinks reuse them."""

    name = "planted.per_call_sinks_stick"

    def __init__(self):
        super().__init__()
        self._sticky = {}

    def attend(self, plan, sinks, **kw):
        if sinks is not plan.sinks:
            self._sticky[id(plan)] = (plan, sinks)
        elif id(plan) in self._sticky:
            sinks = self._sticky[id(plan)][1]
        return super().attend(plan=plan, sinks=sinks, **kw)


PLANTED = [
    (Float64Output, KitOptions(dtypes=("float32",)), "output dtype: float64, expected the "
                                                     "query's float32"),
    (Float64Lse, KitOptions(dtypes=("float32",)), "lse dtype: float64"),
    (LayerStateInPlan, KitOptions(), "with one plan"),
    (SinksOnlyAtPlan, KitOptions(), "per-call sinks"),
    (PerCallSinksStick, KitOptions(), "with one plan"),
]


@pytest.mark.parametrize("bug, options, phrase", PLANTED, ids=[b.__name__ for b, _, _ in PLANTED])
def test_planted_bug_fails_the_attention_check(bug, options, phrase):
    res = _run("attention", bug(), n=40, seed=11, options=options)
    assert res.failed, f"{bug.__name__} passed the attention check ({res.examples} examples)"
    assert phrase in res.message, res.message


def test_dtype_failure_is_structured():
    res = _run("attention", Float64Output(), n=20, options=KitOptions(dtypes=("float32",)))
    assert res.failed
    d = res.exception.details
    assert d == {"got_dtype": "float64", "want_dtype": "float32"}


# -- the refusal checks report a backend's own exception --------------------------------------
class CrashesOnStrides(ReferenceBackend):
    """Claims every layout, then crashes with a TypeError in ``prepare`` on a layout with
    padding or explicit strides, instead of refusing it."""

    name = "planted.crashes_on_strides"

    def prepare(self, plan):
        if not plan.layout.is_c_contiguous:
            raise TypeError("no kernel for strided layouts")
        return super().prepare(plan)


def test_foreign_exception_is_reported_with_its_place():
    res = _run("foreign_layouts", CrashesOnStrides(), n=40)
    assert res.failed
    assert "not refused with KVABIError: TypeError: no kernel for" in res.message
    assert "test_kit_call_promises.py:" in res.message and "in prepare" in res.message
    assert res.exception.details["raised_at"].startswith("test_kit_call_promises.py:")


class Float32Only(ReferenceBackend):
    """Claims float32 only, and its ``allocate`` cannot make planes of anything else: the
    kit plans (and the base class refuses the spec) before any cache is made."""

    name = "planted.float32_only"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), dtypes=("float32",))

    def allocate(self, layout):
        if layout.dtype != "float32":
            raise TypeError(f"cannot allocate {layout.dtype}")
        return super().allocate(layout)


def test_plan_refuses_before_any_cache_is_made():
    res = _run("unsupported", Float32Only(), n=30)
    assert res.status == "passed", res.message
    assert res.refused == res.examples > 0
