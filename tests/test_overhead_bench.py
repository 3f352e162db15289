"""`kvabi bench overhead`: JSON shape in a fast mode, a failing backend reported, option
errors."""
import argparse
import json

import pytest

from kvabi.commands.cli import UsageError

import kvabi
from kvabi import KVABIError, hookimpl
from kvabi.commands import bench
from kvabi.backend.reference import ReferenceBackend

KEYS = {"backend", "abi", "framework", "dtype", "layout", "layer_us", "layer_us_min",
        "layer_cpu_us",
        "plan_us", "view", "view_lookup_us", "layout_view_us", "boundary_us", "plan_checks_us",
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
    assert KEYS <= set(row) and row["backend"] == "reference" and row["abi"] == "2.0"
    assert row["layout"] == "vllm.BLHNC" and row["dtype"] == "float32"
    assert row["view"] == "kv_view"
    for k in KEYS - {"backend", "abi", "framework", "dtype", "layout", "view"}:
        assert row[k] > 0, k
    # the percentage is what the row's own figures say
    want = 100 * (row["boundary_us"] + row["plan_checks_us"] / 32) / row["layer_us"]
    assert row["checks_pct"] == pytest.approx(want)
    # the checks are measured with the backend's own methods replaced on the instance, and
    # put back: the backend computes afterwards as before
    ref = kvabi.get_backend("reference")
    assert not {"prepare", "write", "attend"} & set(vars(ref))


def test_overhead_table_prints_goals(capsys):
    assert _run(["overhead", "--backends", "reference"] + FAST) == 0
    out = capsys.readouterr().out
    assert "write+attn/layer" in out and "measured median" in out
    assert "reference write_kv + attention per layer: goal <=" in out
    assert "boundary checks: goal <= 5%" in out and "; measured " in out
    # goal and measured only: no verdict that reads like a broken install on a slow machine
    assert "NOT met" not in out and "FAIL" not in out


class Broken(ReferenceBackend):
    name = "broken.reference"

    def attend(self, **kw):
        raise RuntimeError("boom")


class BrokenPlugin:
    @hookimpl
    def kvabi_backends(self):
        return [Broken()]


def test_a_failing_backend_is_reported(capsys):
    registry = pytest.importorskip("kvabi.backend.registry")
    registry.reset()
    try:
        registry.register(BrokenPlugin(), name="broken-ref")
        assert _run(["overhead", "--json", "--backends", "reference,broken.reference"]
                    + FAST) == 0
        rows = {r["backend"]: r for r in json.loads(capsys.readouterr().out)["results"]}
        assert rows["reference"]["layer_us"] > 0
        assert rows["broken.reference"]["skipped"].startswith("failed: RuntimeError: boom")
    finally:
        registry.reset()


def test_bad_options():
    with pytest.raises(KVABIError, match="--backends"):
        _run(["overhead", "--backends", "no.such", "--quiet"])
    for argv in (["--repeat", "0"], ["--layers", "33"], ["--repeat", "x"]):
        with pytest.raises(UsageError, match=f"bench overhead: (argument )?{argv[0]}"):  # one line, named
            _run(["overhead"] + argv)
