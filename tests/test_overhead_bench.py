"""`kvabi bench overhead`: JSON shape in a fast mode, 1.0 backends called without 1.1
keywords, option errors."""
import argparse
import json

import pytest

from kvabi.cli import UsageError

from kvabi import KVABIError, hookimpl
from kvabi.commands import bench
from kvabi.reference import ReferenceBackend
from kvabi.views import allocate_numpy

KEYS = {"backend", "abi", "framework", "dtype", "layout", "layer_us", "layer_us_min",
        "layer_cpu_us",
        "plan_us", "view", "view_lookup_us", "layout_view_us", "as_cache_us", "wrap_list_us",
        "check_step_us", "checks_pct"}


def _run(argv):
    p = argparse.ArgumentParser()
    bench.configure(p)
    return bench.run(p.parse_args(argv))


FAST = ["--repeat", "1", "--layers", "2", "--quiet"]


def test_overhead_json_shape(capsys):
    assert _run(["overhead", "--json", "--backends", "reference"] + FAST) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["suite"] == "overhead" and doc["unit"] == "us"
    assert doc["case"]["layers"] == 32 and doc["case"]["q_heads"] == 32
    assert set(doc["goals"]) == {"reference_layer_us", "view_lookup_us", "checks_pct"}
    (row,) = doc["results"]
    assert KEYS <= set(row) and row["backend"] == "reference" and row["abi"] == "1.2"
    assert row["layout"] == "vllm.BLHNC" and row["dtype"] == "float32"
    assert row["view"] == "kv_view"
    for k in KEYS - {"backend", "abi", "framework", "dtype", "layout", "view"}:
        assert row[k] > 0, k
    # the percentage is what the row's own figures say
    want = 100 * (2 * row["as_cache_us"] + row["check_step_us"] / 32) / row["layer_us"]
    assert row["checks_pct"] == pytest.approx(want)


def test_overhead_table_prints_goals(capsys):
    assert _run(["overhead", "--backends", "reference"] + FAST) == 0
    out = capsys.readouterr().out
    assert "write+attn/layer" in out and "measured median" in out
    assert "reference write_kv + attention per layer: goal <=" in out
    assert "boundary checks: goal <= 5%" in out and "; measured " in out
    # goal and measured only: no verdict that reads like a broken install on a slow machine
    assert "NOT met" not in out and "FAIL" not in out


class OldReference(ReferenceBackend):
    """An ABI 1.0 backend: no num_q_heads, no per-call sinks, no out=."""

    name = "old.reference"
    abi_version = (1, 0)
    calls = []

    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self.calls.append("plan")
        return super().plan(meta, spec, layout, scale=scale, softcap=softcap, sinks=sinks)

    def attention(self, query, cache, layout, plan, *, layer=0, return_lse=False, **scales):
        return super().attention(query, cache, layout, plan, layer=layer,
                                 return_lse=return_lse, **scales)

    def allocate(self, layout):
        return allocate_numpy(layout, 0)  # a 1.0 list of planes


class Plugin:
    @hookimpl
    def kvabi_backends(self):
        return [OldReference()]


class Broken(ReferenceBackend):
    name = "broken.reference"

    def attention(self, *a, **kw):
        raise RuntimeError("boom")


class BrokenPlugin:
    @hookimpl
    def kvabi_backends(self):
        return [Broken()]


def test_1_0_backends_get_no_1_1_keywords_and_failures_are_reported(capsys):
    registry = pytest.importorskip("kvabi.registry")
    registry.reset()
    try:
        registry.register(Plugin(), name="old-ref")
        registry.register(BrokenPlugin(), name="broken-ref")
        assert _run(["overhead", "--json", "--backends", "old.reference,broken.reference"]
                    + FAST) == 0
        rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["results"]}
        assert rows["old.reference"]["abi"] == "1.0" and rows["old.reference"]["layer_us"] > 0
        assert "plan" in OldReference.calls
        assert rows["broken.reference"]["skipped"].startswith("failed: RuntimeError: boom")
    finally:
        registry.reset()


def test_bad_options():
    with pytest.raises(KVABIError, match="--backends"):
        _run(["overhead", "--backends", "no.such", "--quiet"])
    for argv in (["--repeat", "0"], ["--layers", "33"], ["--repeat", "x"]):
        with pytest.raises(UsageError, match=f"bench overhead: (argument )?{argv[0]}"):  # one line, named
            _run(["overhead"] + argv)
