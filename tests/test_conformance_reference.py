"""The conformance kit: the reference passes it, and planted bugs fail it.

Each planted backend is the reference with one deliberate mistake (a wrong slot, a dropped
window, an ignored soft cap, ...); the kit must catch every one, from its check functions
(the CLI's path) and from the pytest base class.  Backends that legitimately differ
(refusing layouts or specs they do not support) must pass.
"""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

import kvabi
from kvabi import KVCache, registry
from kvabi.abi import UnsupportedError
from kvabi.cli import main
from kvabi.layout import Layout
from kvabi.reference import ReferenceBackend
from kvabi.testing import (BackendConformance, ConformanceFailure, KitOptions, check_write_kv,
                           get_check, run_check)
from kvabi.testing.cases import AttentionCase


class TestReferenceConformance(BackendConformance):
    """The oracle through its own kit: transforms, layouts and byte-exact writes."""

    backend_name = "reference"
    page_aligns = (1, 48)


# -- planted bugs -------------------------------------------------------------------------
class WrongSlot(ReferenceBackend):
    """Also writes the step's last token into the slot after its own."""

    name = "planted.wrong_slot"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        cache = super().write_kv(cache, layout, key, value, plan, layer=layer, **scales)
        m, bs = plan.meta, plan.spec.block_size
        real = np.nonzero(m.slot_mapping >= 0)[0]
        if len(real):
            s = (int(m.slot_mapping[real[-1]]) + 1) % (layout.num_blocks * bs)
            view = KVCache.wrap(layout, cache).kv_view(layer, 0)
            view[s // bs, s % bs] = np.asarray(key[real[-1]]).astype(view.dtype)
        return cache


class WritesPadding(ReferenceBackend):
    """Treats slot -1 as a Python index: padding tokens land in the pool's last slot."""

    name = "planted.writes_padding"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        cache = super().write_kv(cache, layout, key, value, plan, layer=layer, **scales)
        pad = np.nonzero(plan.meta.slot_mapping < 0)[0]
        if len(pad):
            view = KVCache.wrap(layout, cache).kv_view(layer, 0)
            view[-1, -1] = np.asarray(key[pad[-1]]).astype(view.dtype)
        return cache


class _PlanBug(ReferenceBackend):
    """A reference whose plan sees a modified spec or options."""

    def fix(self, spec, kw):
        return spec, kw

    def plan(self, meta, spec, layout, **kw):
        spec, kw = self.fix(spec, kw)
        return super().plan(meta, spec, layout, **kw)


class NoWindow(_PlanBug):
    name = "planted.no_window"

    def fix(self, spec, kw):
        if spec.kind == "sliding_window":
            spec = attrs.evolve(spec, kind="full", window=None)
        return spec, kw


class WindowOffByOne(_PlanBug):
    """Confuses the anchors' W - 1 convention with kvabi's W."""

    name = "planted.window_off_by_one"

    def fix(self, spec, kw):
        if spec.kind == "sliding_window":
            spec = attrs.evolve(spec, window=spec.window + 1)
        return spec, kw


class NoChunk(_PlanBug):
    name = "planted.no_chunk"

    def fix(self, spec, kw):
        if spec.kind == "chunked_local":
            spec = attrs.evolve(spec, kind="full", chunk=None)
        return spec, kw


class NoSoftcap(_PlanBug):
    name = "planted.no_softcap"

    def fix(self, spec, kw):
        return spec, {**kw, "softcap": None}


class NoSinks(_PlanBug):
    name = "planted.no_sinks"

    def fix(self, spec, kw):
        return spec, {**kw, "sinks": None}


class DefaultScale(_PlanBug):
    name = "planted.default_scale"

    def fix(self, spec, kw):
        return spec, {**kw, "scale": None}


class LseLog2(ReferenceBackend):
    """Returns FlashInfer's base-2 lse unconverted."""

    name = "planted.lse_log2"

    def attention(self, *a, return_lse=False, **kw):
        got = super().attention(*a, return_lse=return_lse, **kw)
        return (got[0], got[1] / math.log(2)) if return_lse else got


class IgnoresLayer(ReferenceBackend):
    name = "planted.ignores_layer"

    def write_kv(self, *a, layer=0, **kw):
        return super().write_kv(*a, layer=0, **kw)

    def attention(self, *a, layer=0, **kw):
        return super().attention(*a, layer=0, **kw)


class AttentionWrites(ReferenceBackend):
    """Uses the cache's first slot as scratch space during attention."""

    name = "planted.attention_writes"

    def attention(self, query, cache, layout, plan, *, layer=0, **kw):
        out = super().attention(query, cache, layout, plan, layer=layer, **kw)
        KVCache.wrap(layout, cache).kv_view(layer, 0)[0, 0] = 0
        return out


class SoftcapUnclaimed(NoSoftcap):
    """Says it has no soft cap, then silently ignores one instead of refusing it."""

    name = "planted.softcap_unclaimed"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), softcap=False)


class CrashesOnUnsupported(ReferenceBackend):
    """Claims float32 only and fails on other dtypes with a TypeError, not a KVABIError."""

    name = "planted.crashes_on_unsupported"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), dtypes=("float32",))

    def plan(self, meta, spec, layout, **kw):
        if spec.dtype != "float32":
            raise TypeError(f"no kernel for {spec.dtype}")
        return super().plan(meta, spec, layout, **kw)


class IgnoresStrides(ReferenceBackend):
    """Addresses every layout as if it had no explicit byte strides (restriding the same
    memory, so kvabi's own plane checks cannot see it)."""

    name = "planted.ignores_strides"

    def _plain(self, layout, cache):
        plain = attrs.evolve(layout, strides=None, plane_bytes=None)
        isz = layout.itemsize
        planes = [np.lib.stride_tricks.as_strided(
            p, plain.plane_shape, [s * isz for s in plain.plane_strides]) for p in cache]
        return plain, planes

    def plan(self, meta, spec, layout, **kw):
        return super().plan(meta, spec, attrs.evolve(layout, strides=None, plane_bytes=None),
                            **kw)

    def write_kv(self, cache, layout, *a, **kw):
        plain, planes = self._plain(layout, cache)
        super().write_kv(planes, plain, *a, **kw)
        return cache

    def attention(self, query, cache, layout, *a, **kw):
        plain, planes = self._plain(layout, cache)
        return super().attention(query, planes, plain, *a, **kw)


class SwapsHeadOrder(ReferenceBackend):
    """Prefers flashinfer.HND but addresses its tensors as NHD (same shape when N == H)."""

    name = "planted.swaps_head_order"

    def preferred_layouts(self, spec):
        return ("flashinfer.HND",)

    def _nhd(self, layout):
        if layout.name != "flashinfer.HND":
            return layout
        return attrs.evolve(layout, order=("B", "KV", "N", "H", "D"))

    def write_kv(self, cache, layout, *a, **kw):
        return super().write_kv(cache, self._nhd(layout), *a, **kw)


class PrefersImpossible(ReferenceBackend):
    """Prefers a layout with K and V axes even for MLA caches, which it cannot hold."""

    name = "planted.prefers_impossible"

    def preferred_layouts(self, spec):
        return ("flash_attn",) + super().preferred_layouts(spec)


class NoCausalMask(ReferenceBackend):
    """A decode kernel used for every token: each query sees its request's whole sequence."""

    name = "planted.no_causal_mask"

    def attention(self, query, cache, layout, plan, *, layer=0, return_lse=False, **kw):
        m = plan.meta
        req = m.token_request
        as_decodes = kvabi.CommonAttentionMetadata.from_lengths(
            np.ones(len(req), np.int64), m.seq_lens[req] - 1, m.block_table[req],
            m.block_size, num_blocks=m.num_blocks, num_tokens=m.num_tokens)
        plan2 = super().plan(as_decodes, plan.spec, layout, scale=plan.scale,
                             softcap=plan.softcap, sinks=plan.sinks)
        return super().attention(query, cache, layout, plan2, layer=layer,
                                 return_lse=return_lse, **kw)


class _Quantized(ReferenceBackend):
    """The reference on quantized per-tensor caches only (so every example is one)."""

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("per_tensor",),
                            dtypes=("float8_e4m3fn", "float8_e5m2", "int8"))


class RoundsNearestAlways(_Quantized):
    """Ignores ``spec.rounding``: codes always round to nearest, ties to even."""

    name = "planted.rounds_nearest"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        spec = plan.spec
        if spec.rounding != "nearest_even":
            plan = attrs.evolve(plan, spec=attrs.evolve(spec, rounding="nearest_even"))
        return super().write_kv(cache, layout, key, value, plan, layer=layer, **scales)


class NoSaturation(_Quantized):
    """Converts scaled values without clamping them to the format's range first."""

    name = "planted.no_saturation"

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, k_scale=None,
                 v_scale=None):
        spec = plan.spec
        ks, vs = kvabi.check_scales(spec, k_scale, v_scale)
        tokens, blk, off = plan.write_rows
        dt = kvabi.dtypes.numpy_dtype(spec.dtype)
        for kv, x, s in ((0, key, ks), (1, value, vs)):
            x = np.asarray(x, np.float32) if tokens is None else np.asarray(x, np.float32)[tokens]
            y = x * (np.float32(1) / np.float32(s))
            with np.errstate(invalid="ignore", over="ignore"):
                codes = np.rint(y).astype(dt) if dt == np.int8 else y.astype(dt)
            kvabi.as_cache(cache, layout).kv_view(layer, kv)[blk, off] = codes
        return cache


class ValueScaleOfKeys(_Quantized):
    """Attention reads values with the key scale (the per-call v_scale is dropped)."""

    name = "planted.value_scale_of_keys"

    def attention(self, query, cache, layout, plan, *, k_scale=None, v_scale=None, **kw):
        return super().attention(query, cache, layout, plan, k_scale=k_scale,
                                 v_scale=k_scale, **kw)


class NoEpsilon(ReferenceBackend):
    """Per-token-head scales without vLLM's floor: an all-zero row gets scale 0 (and NaN
    codes from 0 * inf)."""

    name = "planted.no_epsilon"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("per_token_head",),
                            dtypes=("float8_e4m3fn", "int8"))

    def write_kv(self, cache, layout, key, value, plan, *, layer=0, **scales):
        cache = super().write_kv(cache, layout, key, value, plan, layer=layer, **scales)
        tokens, blk, off = plan.write_rows
        c = kvabi.as_cache(cache, layout)
        for name, x in (("key_scale", key), ("value_scale", value)):
            x = np.asarray(x, np.float32) if tokens is None else np.asarray(x, np.float32)[tokens]
            zero = ~np.abs(x).max(-1).astype(bool)  # [T', H] all-zero rows
            sv = c.component_view(name, layer)
            sv[blk[:, None].repeat(zero.shape[1], 1)[zero], off[:, None].repeat(
                zero.shape[1], 1)[zero], np.nonzero(zero)[1], 0] = 0.0
        return cache


PLANTED = [
    (RoundsNearestAlways, "write_kv", KitOptions(), "slot(s) differ"),
    (NoEpsilon, "write_kv", KitOptions(), "_scale"),
    (NoSaturation, "write_kv", KitOptions(), "slot(s) differ"),
    (ValueScaleOfKeys, "attention", KitOptions(), "error"),
    (WrongSlot, "write_kv", KitOptions(), "slot(s) differ"),
    (WritesPadding, "write_kv", KitOptions(), "slot(s) differ"),
    (IgnoresLayer, "write_kv", KitOptions(), "layer"),
    (NoWindow, "attention", KitOptions(kinds=("sliding_window",)), "relative L2"),
    (WindowOffByOne, "attention", KitOptions(kinds=("sliding_window",)), "error"),
    (NoChunk, "attention", KitOptions(kinds=("chunked_local",)), "error"),
    (NoSoftcap, "attention", KitOptions(), "error"),
    (NoSinks, "attention", KitOptions(), "error"),
    (DefaultScale, "attention", KitOptions(), "error"),
    (LseLog2, "attention", KitOptions(), "lse error"),
    (AttentionWrites, "attention", KitOptions(), "only read"),
    (NoCausalMask, "attention", KitOptions(), "error"),
    (IgnoresLayer, "kv_sharing", KitOptions(), "layer"),
    (AttentionWrites, "kv_sharing", KitOptions(), "layer"),
    (NoWindow, "prefill_skip", KitOptions(kinds=("sliding_window",)), "prefill_skip"),
    (SoftcapUnclaimed, "unsupported", KitOptions(), "computed instead of refused"),
    (CrashesOnUnsupported, "unsupported", KitOptions(), "TypeError"),
    (IgnoresStrides, "foreign_layouts", KitOptions(), "non-preferred layout"),
    (SwapsHeadOrder, "layouts", KitOptions(), ""),
    (PrefersImpossible, "layouts", KitOptions(kinds=("mla",)), "cannot hold"),
    (WrongSlot, "split_ubatches", KitOptions(), "split_ubatches"),
    (WritesPadding, "pad", KitOptions(), "pad"),
]


@pytest.mark.parametrize("bug, check, options, phrase", PLANTED,
                         ids=[f"{b.__name__}-{c}" for b, c, _, _ in PLANTED])
def test_planted_bug_is_caught(bug, check, options, phrase):
    res = run_check(get_check(check), bug(), options=options, max_examples=40, seed=7,
                    shrink=False, time_budget=None)
    assert res.failed, f"{bug.__name__} passed {check} ({res.examples} examples)"
    assert phrase in res.message, res.message
    assert "Failing test case" in res.example


def test_base_class_raises_with_minimal_example():
    class TestBroken(BackendConformance):
        backend_name = NoWindow.name
        kinds = ("sliding_window",)
        dtypes = ("float32",)
        max_examples = 20

        def make_backend(self):
            return NoWindow()

    with pytest.raises(ConformanceFailure) as info:
        TestBroken().test_attention()
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "sliding_window float32" in notes and "window=" in notes


def test_check_function_directly_on_a_hand_made_case():
    """The check functions work without Hypothesis: one decode after a 3-token context."""
    spec = kvabi.KVSpec("full", block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths([1], [3], [[1, 0]], 2, num_blocks=2,
                                                      num_tokens=2)
    layout = Layout.preset("flash_attn", spec, num_blocks=2)
    case = AttentionCase(spec, layout, meta, num_q_heads=2, seed=3)
    ref = ReferenceBackend()
    assert check_write_kv(ref, ref, case) == 0.0
    with pytest.raises(ConformanceFailure, match="slot"):
        check_write_kv(WritesPadding(), ref, case)


# -- legitimate differences pass ------------------------------------------------------------
class OnlyPreferred(ReferenceBackend):
    """Supports float32 full attention in flash_attn only, and refuses everything else."""

    name = "planted.only_preferred"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), kinds=("full",), dtypes=("float32",),
                            softcap=False, sinks=False)

    def preferred_layouts(self, spec):
        return ("flash_attn",)

    def plan(self, meta, spec, layout, **kw):
        self.check_supported(spec, softcap=kw.get("softcap"), sinks=kw.get("sinks"))
        if layout.name != "flash_attn":
            raise UnsupportedError(f"{self.name}: layout {layout.name!r} not supported")
        return super().plan(meta, spec, layout, **kw)


@pytest.mark.parametrize("check", ["foreign_layouts", "unsupported", "attention", "cascade"])
def test_refusing_backend_passes(check):
    res = run_check(get_check(check), OnlyPreferred(), max_examples=10, seed=3,
                    time_budget=None)
    assert res.status == "passed", res.message
    if check in ("foreign_layouts", "unsupported"):
        assert res.refused > 0


# -- the command line -----------------------------------------------------------------------
class _Plugin:
    @kvabi.hookimpl
    def kvabi_backends(self):
        return [NoWindow(), _Unavailable()]


class _Unavailable(ReferenceBackend):
    name = "planted.unavailable"

    def available(self):
        return False, "no such device"


@pytest.fixture
def planted_registry():
    registry.reset()
    registry.register(_Plugin(), name="planted")
    yield
    registry.reset()


def test_cli_reference_quick(capsys):
    assert main(["conformance", "reference", "--quick", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    for name in ("write_kv", "attention", "layouts", "kv_sharing", "cascade"):
        assert f"reference  {name}" in err  # one progress line per check
        assert name in out
    assert "byte-exact" in out and "0 failed" in out
    assert "seed 1" in err


def test_cli_fails_on_a_planted_bug(planted_registry, capsys):
    rc = main(["conformance", NoWindow.name, "--check", "attention", "--max-examples", "30",
               "--seed", "2", "--dtype", "float32", "--no-shrink"])
    out, _ = capsys.readouterr()
    assert rc == 1
    assert f"FAILED {NoWindow.name} attention" in out and "Failing test case" in out


def test_cli_refuses_unavailable_and_unknown(planted_registry, capsys):
    assert main(["conformance", "planted.unavailable"]) == 2
    assert "no such device" in capsys.readouterr().err
    assert main(["conformance", "no.such.backend"]) == 2


def test_cli_all_skips_unavailable(planted_registry, capsys, monkeypatch):
    monkeypatch.setattr(registry, "all_backends",
                        lambda: [registry.get_backend("reference"),
                                 registry.get_backend("planted.unavailable")])
    assert main(["conformance", "--all", "--quick", "--check", "write_kv", "--seed", "4"]) == 0
    out, _ = capsys.readouterr()
    assert "planted.unavailable" in out and "skipped" in out and "no such device" in out


# -- the pytest plugin ----------------------------------------------------------------------
def test_pytest_plugin_collects_the_kit(tmp_path):
    """``pytest --kvabi-backend NAME`` in an empty directory runs the kit's tests."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--kvabi-backend",
           "reference", "--kvabi-profile", "quick", "-k", "registered or write_kv or layouts",
           str(tmp_path)]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout  # registered, write_kv, layouts, foreign_layouts
