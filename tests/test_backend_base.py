"""kvabi.Backend owns the boundary: a backend that writes only its small methods (and checks
nothing) gets every refusal the conformance kit checks; the base class's own promises
(every reason at once, plans only from their backend, keyword calls to the glue, sinks
checked again after an in-place change, 1.x backends refused by name)."""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import (Capabilities, CommonAttentionMetadata, KVABIError, KVCache, KVSpec, Layout,
                   UnsupportedError)
from kvabi.backend import registry
from kvabi.testing import KitOptions, get_check, run_check

torch = pytest.importorskip("torch")


class Naive(kvabi.Backend):
    """Only the small methods, written as if no input could be wrong: writes through raw
    strided views computed from the layout's byte offsets (no plane check), slots held in
    int32, attention one token at a time.  Right on valid input; every check is the base
    class's."""

    name = "kittest.naive"

    def capabilities(self, spec=None):
        return Capabilities(kinds=("full", "sliding_window"), dtypes=("float32",))

    def preferred_layouts(self, spec):
        return ("flash_attn", "vllm.LBHNC")

    @staticmethod
    def _view(cache, layer, kv):
        lay = cache.layout
        plane, base = lay.byte_offset(layer=layer, kv=kv)
        isz = lay.itemsize
        flat = np.lib.stride_tricks.as_strided(cache[plane], (lay.plane_nbytes // isz,),
                                               (isz,))
        axes = ("B", "N", "H", "D")
        return np.lib.stride_tricks.as_strided(flat[base // isz:],
                                               tuple(lay.size(a) for a in axes),
                                               tuple(lay.stride(a) for a in axes))

    def prepare(self, plan):
        return plan.meta.slot_mapping.astype(np.int32)  # no wider index: nothing checked

    def write(self, plan, cache, key, value, layer):
        slots, bs = plan.prepared, plan.spec.block_size
        real = slots >= 0
        for kv, x in ((0, key), (1, value)):
            self._view(cache, layer, kv)[slots[real] // bs, slots[real] % bs] = x[real]
        return cache

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        meta, spec = plan.meta, plan.spec
        k, v = self._view(cache, layer, 0), self._view(cache, layer, 1)
        hq, bs = plan.num_q_heads, spec.block_size
        res = np.zeros((meta.num_tokens, hq, spec.head_dim), np.float32)
        lse = np.full((meta.num_tokens, hq), -np.inf, np.float32)
        for t in range(meta.num_actual_tokens):
            r = int(np.searchsorted(meta.query_start_loc, t, side="right")) - 1
            p = int(meta.positions[t])
            j = np.arange(int(spec.first_visible_key(np.array(p))), p + 1)
            blocks = meta.block_table[r, j // bs]
            for h in range(hq):
                kh = h // (hq // spec.num_kv_heads)
                x = k[blocks, j % bs, kh].astype(np.float64) @ query[t, h] * plan.scale
                e = np.exp(x - x.max())
                res[t, h] = e @ v[blocks, j % bs, kh] / e.sum()
                lse[t, h] = x.max() + math.log(e.sum())
        return res, lse


def _run(check, backend, n=15, seed=2, options=KitOptions()):
    return run_check(get_check(check), backend, options=options, max_examples=n, seed=seed,
                     time_budget=None, shrink=False, replay=None)


@pytest.mark.parametrize("check", ["write_kv", "attention"])
def test_the_naive_backend_is_right_on_valid_input(check):
    res = _run(check, Naive(), n=8)
    assert res.status == "passed", res.message + "\n" + res.example


@pytest.mark.parametrize("check", ["hostile_cache", "huge_lengths", "foreign_framework",
                                   "unsupported"])
def test_a_backend_that_checks_nothing_gets_every_refusal_of_the_kit(check):
    res = _run(check, Naive())
    assert res.status == "passed", res.message + "\n" + res.example
    assert res.refused == res.examples > 0


# -- every reason at once ---------------------------------------------------------------------
def test_every_refusal_reason_is_listed():
    caps = Capabilities(kinds=("full",), dtypes=("float16",), head_dims=(64,),
                        block_size_multiple=16)
    spec = KVSpec("sliding_window", 8, 2, 32, dtype="float32", window=4)
    want = ("kind 'sliding_window' not in ('full',)", "dtype 'float32' not in ('float16',)",
            "head_dim 32 not in (64,)", "block_size 8 not a multiple of 16",
            "soft cap not supported", "attention sinks not supported")
    assert caps.refusals(spec, softcap=1.0, sinks=True) == want
    assert caps.refusals(KVSpec("full", 16, 2, 64, dtype="float16")) == ()

    class Claims(Naive):
        def capabilities(self, spec=None):
            return caps

        def available(self):
            return False, "no such device"

        def layout_refusals(self, spec, layout):
            return ("never reached: the spec is refused already",)

    b = Claims()
    assert b.refusals(spec, softcap=1.0, sinks=True) == ("unavailable: no such device",) + want
    layout = Layout.preset("flash_attn", spec, num_blocks=2)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 8)
    with pytest.raises(UnsupportedError) as info:
        b.plan(meta, spec, layout, num_q_heads=2, softcap=1.0, sinks=[0.0, 0.0])
    assert all(w in str(info.value) for w in want)


def test_layout_refusals_are_asked_for_the_layout_of_the_plan():
    class DenseOnly(Naive):
        def layout_refusals(self, spec, layout):
            return () if layout.name == "flash_attn" else (f"layout {layout.name}", "and why")

    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 2)
    b = DenseOnly()
    b.plan(meta, spec, Layout.preset("flash_attn", spec, 1), num_q_heads=1)
    with pytest.raises(UnsupportedError, match="kittest.naive: unsupported: layout vllm.LBHNC; "
                                               "and why"):
        b.plan(meta, spec, Layout.preset("vllm.LBHNC", spec, 1), num_q_heads=1)


def test_capabilities_are_built_once_per_spec_and_options():
    calls = []

    class Counting(Naive):
        def capabilities(self, spec=None):
            calls.append(spec)
            return super().capabilities(spec)

    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 1)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 2)
    b = Counting()
    for _ in range(3):
        b.plan(meta, spec, layout, num_q_heads=1)
    assert calls == [spec]


# -- the plan -----------------------------------------------------------------------------------
def test_the_plan_is_frozen_and_carries_what_prepare_returned():
    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 2)
    meta = CommonAttentionMetadata.from_lengths([3], [0], [[0, 1]], 2)
    plan = Naive().plan(meta, spec, layout, num_q_heads=2, sinks=None)
    assert plan.layout is layout and plan.meta is meta and plan.num_q_heads == 2
    assert plan.prepared.tolist() == [0, 1, 2] and plan.num_tokens == 3
    for field in ("meta", "layout", "prepared", "num_q_heads"):
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(plan, field, None)


def test_the_glue_is_called_by_keyword():
    """A backend may name its methods' parameters in any order."""
    class Reordered(Naive):
        def write(self, layer, value, key, cache, plan):
            return super().write(plan, cache, key, value, layer)

        def attend(self, return_lse, out, sinks, layer, query, cache, plan):
            return super().attend(plan, cache, query, layer, sinks, out, return_lse)

    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 2, num_layers=2)
    meta = CommonAttentionMetadata.from_lengths([3], [0], [[0, 1]], 2)
    rng = np.random.default_rng(0)
    k, v, q = (rng.standard_normal((3, n, 4)).astype(np.float32) for n in (1, 1, 2))
    got = []
    for b in (Naive(), Reordered()):
        plan = b.plan(meta, spec, layout, num_q_heads=2)
        cache = b.write_kv(plan, b.allocate(layout), key=k, value=v, layer=1)
        got.append(b.attention(plan, cache, query=q, layer=1))
    np.testing.assert_array_equal(got[0], got[1])


def test_inputs_arrive_in_the_backends_framework():
    """numpy (and lists) handed to a torch backend reach its methods as torch tensors."""
    seen = {}

    class Spy(kvabi.get_backend("example.torch").__class__):
        def write(self, plan, cache, key, value, layer):
            seen["key"], seen["value"] = type(key), type(value)
            return super().write(plan=plan, cache=cache, key=key, value=value, layer=layer)

    b = Spy()
    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 2)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 2)
    plan = b.plan(meta, spec, layout, num_q_heads=1)
    b.write_kv(plan, b.allocate(layout), key=np.ones((1, 1, 4), np.float32),
               value=[[[1.0, 2.0, 3.0, 4.0]]])
    assert seen == {"key": torch.Tensor, "value": torch.Tensor}


def test_per_call_sinks_changed_in_place_are_checked_again():
    """A torch tensor of sinks is checked once per tensor and in-place change: NaN put into
    it after a first call is refused at the next."""
    b = kvabi.get_backend("example.torch")
    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 2)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 2)
    plan = b.plan(meta, spec, layout, num_q_heads=2)
    cache = b.allocate(layout)
    q = torch.ones((1, 2, 4))
    sinks = torch.zeros(2)
    b.attention(plan, cache, query=q, sinks=sinks)
    b.attention(plan, cache, query=q, sinks=sinks)
    sinks[1] = float("nan")
    with pytest.raises(KVABIError, match="sinks: must not be NaN"):
        b.attention(plan, cache, query=q, sinks=sinks)


def test_return_lse_is_a_bool():
    b = Naive()
    spec = KVSpec("full", 2, 1, 4, dtype="float32")
    layout = Layout.preset("flash_attn", spec, 2)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 2)
    plan = b.plan(meta, spec, layout, num_q_heads=1)
    with pytest.raises(KVABIError, match="return_lse: must be true or false"):
        b.attention(plan, b.allocate(layout), query=np.ones((1, 1, 4), np.float32),
                    return_lse="yes")


# -- registration -----------------------------------------------------------------------------
def test_1x_backends_and_backends_running_their_own_boundary_are_refused(tmp_path):
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "plugins"))
    try:
        plugin = importlib.import_module("kvabi_abi1_plugin")
        registry.reset()
        registry.register(plugin, name="abi1")
        why = {r.name: r.reason for r in registry.refused()}
        assert why["abi1.reference"] == (
            f"built for kvabi ABI 1.2, but this kvabi speaks ABI "
            f"{kvabi.ABI_VERSION[0]}.{kvabi.ABI_VERSION[1]} (major versions must match)")
        assert why["abi1.overrides_plan"].startswith("overrides Backend.plan, which the base "
                                                     "class runs")
        with pytest.raises(KVABIError, match=r"ABI 1\.2.*ABI 2\.1"):
            registry.get_backend("abi1.reference")
    finally:
        registry.reset()
        sys.path.remove(str(Path(__file__).parent / "plugins"))


def _spec_served_by(be) -> KVSpec:
    """A small full-attention spec ``be`` serves: float32, else an int8 per-tensor cache
    (a backend of quantized caches only, such as example.torch_quant)."""
    for kw in ({"dtype": "float32"}, {"dtype": "int8", "quant": "per_tensor"}):
        spec = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=64, **kw)
        if not be.refusals(spec):
            return spec
    raise AssertionError(f"{be.name} serves neither a float32 nor an int8 cache")


_NOT_NUMBERS = {"str": np.full((3, 2, 64), "a"), "object": np.full((3, 2, 64), None, object),
                "datetime": np.zeros((3, 2, 64), "datetime64[s]"),
                "void": np.zeros((3, 2, 64), "V4"), "complex": np.zeros((3, 2, 64), complex),
                "bool": np.zeros((3, 2, 64), bool), "text": "abc", "bytes": b"abc"}


@pytest.mark.parametrize("name", [n for n in kvabi.backend_names()
                                  if kvabi.get_backend(n).available()[0]])
def test_arrays_of_no_numbers_are_refused_by_their_field_in_every_framework(name):
    """key, value and query that hold no real numbers are refused naming the argument,
    before a framework converts them (jax raised TypeError, torch named ``array``)."""
    be = kvabi.get_backend(name)
    spec = _spec_served_by(be)
    layout = Layout.preset(be.preferred_layouts(spec)[0], spec, 8, 1)
    meta = CommonAttentionMetadata.from_lengths([3], [0], [[0, 1]], 16)
    plan = be.plan(meta, spec, layout, num_q_heads=2)
    cache = be.allocate(layout)
    ok = np.zeros((3, 2, 64), np.float32)
    for label, bad in _NOT_NUMBERS.items():
        for field, call in (
                ("key", lambda: be.write_kv(plan, cache, key=bad, value=ok)),
                ("value", lambda: be.write_kv(plan, cache, key=ok, value=bad)),
                ("query", lambda: be.attention(plan, cache, query=bad))):
            with pytest.raises(KVABIError, match=f"^{field}: ") as e:
                call()
            assert "integers" not in str(e.value), (label, str(e.value))


@pytest.mark.parametrize("name", [n for n in kvabi.backend_names()
                                  if kvabi.get_backend(n).available()[0]])
def test_a_backends_own_methods_get_their_arguments_checked_by_name(name):
    """capabilities, preferred_layouts, layout_refusals, allocate and warmup are the
    backend author's code; the base class names a bad argument before it runs (they
    raised AttributeError on a string spec); a call before any plan with plan=None is a
    refused plan, not an AttributeError."""
    from kvabi import StepLimits

    be = type(kvabi.get_backend(name))()
    spec = _spec_served_by(be)
    layout = Layout.preset(be.preferred_layouts(spec)[0], spec, 4, 1)
    limits = StepLimits(max_tokens=4, max_reqs=2, max_seq_len=32)
    for field, call in (
            ("spec", lambda: be.capabilities("full")),
            ("spec", lambda: be.preferred_layouts(None)),
            ("spec", lambda: be.layout_refusals({"kind": "full"}, layout)),
            ("layout", lambda: be.layout_refusals(spec, "flashinfer.NHD")),
            ("layout", lambda: be.allocate("flashinfer.NHD")),
            ("limits", lambda: be.warmup(spec, layout, {"max_tokens": 4})),
            ("plan", lambda: be.write_kv(None, None, key=np.zeros((1, 2, 64)))),
            ("plan", lambda: be.attention(None, None, query=np.zeros((1, 2, 64))))):
        with pytest.raises(KVABIError, match=f"^{field}: "):
            call()
    assert be.capabilities(None) is not None and be.refusals(spec, layout) == ()
    be.warmup(spec, layout, limits, num_q_heads=2)
