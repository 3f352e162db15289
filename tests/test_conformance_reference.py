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
from kvabi.backend import registry
from kvabi.commands.cli import main
from kvabi.layout.descriptor import Layout
from kvabi.model.quant import quantize_per_tensor
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing import (BackendConformance, ConformanceFailure, KitOptions, check_write_kv,
                           get_check, run_check)
from kvabi.testing.cases import AttentionCase


class TestReferenceConformance(BackendConformance):
    """The oracle through its own kit: transforms, layouts and byte-exact writes."""

    backend_name = "reference"
    page_aligns = (1, 48)


# -- planted bugs -------------------------------------------------------------------------
# A bug can only live in a backend's own methods (prepare, write, attend): every check of
# the arguments is kvabi.Backend's, which a backend does not override.
class WrongSlot(ReferenceBackend):
    """Also writes the step's last token into the slot after its own."""

    name = "planted.wrong_slot"

    def write(self, plan, cache, key, value, layer, **scales):
        cache = super().write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              **scales)
        m, bs = plan.meta, plan.spec.block_size
        real = np.nonzero(m.slot_mapping >= 0)[0]
        if len(real):
            s = (int(m.slot_mapping[real[-1]]) + 1) % (plan.layout.num_blocks * bs)
            view = cache.kv_view(layer, 0)
            view[s // bs, s % bs] = np.asarray(key[real[-1]]).astype(view.dtype)
        return cache


class WritesPadding(ReferenceBackend):
    """Treats slot -1 as a Python index: padding tokens land in the pool's last slot."""

    name = "planted.writes_padding"

    def write(self, plan, cache, key, value, layer, **scales):
        cache = super().write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              **scales)
        pad = np.nonzero(plan.meta.slot_mapping < 0)[0]
        if len(pad):
            view = cache.kv_view(layer, 0)
            view[-1, -1] = np.asarray(key[pad[-1]]).astype(view.dtype)
        return cache


class _PlanBug(ReferenceBackend):
    """A reference whose kernel glue sees a modified spec or options."""

    def fix(self, plan, sinks):
        return plan, sinks

    def prepare(self, plan):
        return super().prepare(self.fix(plan, None)[0])

    def attend(self, plan, sinks, **kw):
        plan, sinks = self.fix(plan, sinks)
        return super().attend(plan=plan, sinks=sinks, **kw)


class NoWindow(_PlanBug):
    name = "planted.no_window"

    def fix(self, plan, sinks):
        if plan.spec.kind == "sliding_window":
            plan = attrs.evolve(plan, spec=attrs.evolve(plan.spec, kind="full", window=None))
        return plan, sinks


class WindowOffByOne(_PlanBug):
    """Confuses the anchors' W - 1 convention with kvabi's W."""

    name = "planted.window_off_by_one"

    def fix(self, plan, sinks):
        if plan.spec.kind == "sliding_window":
            plan = attrs.evolve(plan, spec=attrs.evolve(plan.spec, window=plan.spec.window + 1))
        return plan, sinks


class NoChunk(_PlanBug):
    name = "planted.no_chunk"

    def fix(self, plan, sinks):
        if plan.spec.kind == "chunked_local":
            plan = attrs.evolve(plan, spec=attrs.evolve(plan.spec, kind="full", chunk=None))
        return plan, sinks


class NoSoftcap(_PlanBug):
    name = "planted.no_softcap"

    def fix(self, plan, sinks):
        return attrs.evolve(plan, softcap=None), sinks


class NoSinks(_PlanBug):
    name = "planted.no_sinks"

    def fix(self, plan, sinks):
        return plan, None


class DefaultScale(_PlanBug):
    name = "planted.default_scale"

    def fix(self, plan, sinks):
        return attrs.evolve(plan, scale=1 / math.sqrt(plan.spec.head_dim)), sinks


class LseLog2(ReferenceBackend):
    """Returns FlashInfer's base-2 lse unconverted."""

    name = "planted.lse_log2"

    def attend(self, **kw):
        out, lse = super().attend(**kw)
        return out, None if lse is None else lse / math.log(2)


class IgnoresLayer(ReferenceBackend):
    name = "planted.ignores_layer"

    def write(self, layer, **kw):
        return super().write(layer=0, **kw)

    def attend(self, layer, **kw):
        return super().attend(layer=0, **kw)


class AttentionWrites(ReferenceBackend):
    """Uses the cache's first slot as scratch space during attention."""

    name = "planted.attention_writes"

    def attend(self, cache, layer, **kw):
        out = super().attend(cache=cache, layer=layer, **kw)
        cache.kv_view(layer, 0)[0, 0] = 0
        return out


class CrashesInPrepare(ReferenceBackend):
    """Claims float16, then fails on it with a TypeError, not a KVABIError."""

    name = "planted.crashes_in_prepare"

    def prepare(self, plan):
        if plan.spec.dtype == "float16":
            raise TypeError("no kernel for float16")
        return super().prepare(plan)


class IgnoresStrides(ReferenceBackend):
    """Addresses every layout as if it had no explicit byte strides (restriding the same
    memory, so kvabi's own plane checks cannot see it)."""

    name = "planted.ignores_strides"

    @staticmethod
    def _plain(plan, cache):
        layout = plan.layout
        plain = attrs.evolve(layout, strides=None, plane_bytes=None)
        isz = layout.itemsize
        planes = tuple(np.lib.stride_tricks.as_strided(
            p, plain.plane_shape, [s * isz for s in plain.plane_strides]) for p in cache)
        return attrs.evolve(plan, layout=plain), kvabi.KVCache(plain, planes, _checked=True)

    def write(self, plan, cache, **kw):
        super().write(*self._plain(plan, cache), **kw)
        return cache

    def attend(self, plan, cache, **kw):
        return super().attend(*self._plain(plan, cache), **kw)


class SwapsHeadOrder(ReferenceBackend):
    """Prefers flashinfer.HND but addresses its tensors as NHD (same shape when N == H)."""

    name = "planted.swaps_head_order"

    def preferred_layouts(self, spec):
        return ("flashinfer.HND",)

    def write(self, plan, cache, **kw):
        layout = cache.layout
        if layout.name == "flashinfer.HND":
            nhd = attrs.evolve(layout, order=("B", "KV", "N", "H", "D"))
            super().write(plan=plan, cache=kvabi.KVCache(nhd, tuple(cache), _checked=True),
                          **kw)
            return cache
        return super().write(plan=plan, cache=cache, **kw)


class PrefersImpossible(ReferenceBackend):
    """Prefers a layout with K and V axes even for MLA caches, which it cannot hold."""

    name = "planted.prefers_impossible"

    def preferred_layouts(self, spec):
        return ("flash_attn",) + super().preferred_layouts(spec)


class NoCausalMask(ReferenceBackend):
    """A decode kernel used for every token: each query sees its request's whole sequence."""

    name = "planted.no_causal_mask"

    def prepare(self, plan):
        m = plan.meta
        req = m.token_request
        as_decodes = kvabi.CommonAttentionMetadata.from_lengths(
            np.ones(len(req), np.int64), m.seq_lens[req] - 1, m.block_table[req],
            m.block_size, num_blocks=m.num_blocks, num_tokens=m.num_tokens)
        return super().prepare(attrs.evolve(plan, meta=as_decodes))


class _Quantized(ReferenceBackend):
    """The reference on quantized per-tensor caches only (so every example is one)."""

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("per_tensor",),
                            dtypes=("float8_e4m3fn", "float8_e5m2", "int8"))


def _rows(plan, x):
    tokens = plan.prepared.write_rows[0]
    return np.asarray(x, np.float32) if tokens is None else np.asarray(x, np.float32)[tokens]


class RoundsNearestAlways(_Quantized):
    """Ignores ``spec.rounding``: codes always round to nearest, ties to even."""

    name = "planted.rounds_nearest"

    def write(self, plan, cache, key, value, layer, scales):
        _, blk, off = plan.prepared.write_rows
        for kv, x in ((0, key), (1, value)):
            if x is not None:
                cache.kv_view(layer, kv)[blk, off] = quantize_per_tensor(
                    _rows(plan, x), scales[kv], plan.spec.dtype, "nearest_even")
        return cache


class NoSaturation(_Quantized):
    """Converts scaled values without clamping them to the format's range first."""

    name = "planted.no_saturation"

    def write(self, plan, cache, key, value, layer, scales):
        _, blk, off = plan.prepared.write_rows
        dt = kvabi.util.dtypes.numpy_dtype(plan.spec.dtype)
        for kv, x in ((0, key), (1, value)):
            if x is None:
                continue
            y = _rows(plan, x) * (np.float32(1) / np.float32(scales[kv]))
            with np.errstate(invalid="ignore", over="ignore"):
                codes = np.rint(y).astype(dt) if dt == np.int8 else y.astype(dt)
            cache.kv_view(layer, kv)[blk, off] = codes
        return cache


class ValueScaleOfKeys(_Quantized):
    """Attention reads values with the key scale (the per-call v_scale is dropped)."""

    name = "planted.value_scale_of_keys"

    def attend(self, plan, cache, query, layer, sinks, out, return_lse, scales):
        return super().attend(plan=plan, cache=cache, query=query, layer=layer, sinks=sinks,
                              out=out, return_lse=return_lse, scales=(scales[0], scales[0]))


class NoEpsilon(ReferenceBackend):
    """Per-token-head scales without vLLM's floor: an all-zero row gets scale 0 (and NaN
    codes from 0 * inf)."""

    name = "planted.no_epsilon"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("per_token_head",),
                            dtypes=("float8_e4m3fn", "int8"))

    def write(self, plan, cache, key, value, layer):
        cache = super().write(plan=plan, cache=cache, key=key, value=value, layer=layer)
        _, blk, off = plan.prepared.write_rows
        for name, x in (("key_scale", key), ("value_scale", value)):
            zero = ~np.abs(_rows(plan, x)).max(-1).astype(bool)  # [T', H] all-zero rows
            sv = cache.component_view(name, layer)
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
    (CrashesInPrepare, "write_kv", KitOptions(dtypes=("float16",)), "TypeError"),
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

    def layout_refusals(self, spec, layout):
        return () if layout.name == "flash_attn" else (f"layout {layout.name!r}",)


class SoftcapUnclaimed(NoSoftcap):
    """Says it has no soft cap and its glue would ignore one: the base class refuses a soft
    cap before the glue runs, so it is never computed wrong."""

    name = "planted.softcap_unclaimed"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), softcap=False)


@pytest.mark.parametrize("backend, check", [
    (OnlyPreferred, "foreign_layouts"), (OnlyPreferred, "unsupported"),
    (OnlyPreferred, "attention"), (OnlyPreferred, "cascade"),
    (SoftcapUnclaimed, "unsupported")])
def test_refusing_backend_passes(backend, check):
    res = run_check(get_check(check), backend(), max_examples=10, seed=3, time_budget=None)
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
