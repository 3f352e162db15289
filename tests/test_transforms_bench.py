"""`kvabi bench`: the built-in transforms suite and plugin-contributed suites."""
import argparse
import json

import pytest

from kvabi import KVABIError, hookimpl
from kvabi.bench import transforms as bench_transforms
from kvabi.commands import bench


def _run(argv):
    p = argparse.ArgumentParser()
    bench.configure(p)
    return bench.run(p.parse_args(argv))


def test_transforms_suite_json(capsys):
    assert _run(["transforms", "--quick", "--json", "--sizes", "6x40,3x9"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["unit"] == "us"
    assert [(r["num_reqs"], r["num_tokens"]) for r in doc["results"]] == [(6, 40), (3, 9)]
    for r in doc["results"]:
        assert "from_lengths (build)" in r["us"] and "kv_update_slices" in r["us"]
        assert "validate" in r["us"] and "baseline: cumsum + slot gather" in r["us"]
        assert all(v > 0 for v in r["us"].values())
        assert set(r["ratios"]) == {f"{a} / {b}" for a, b in bench_transforms.RATIOS}
        for (a, b_), v in zip(bench_transforms.RATIOS, r["ratios"].values()):
            assert v == pytest.approx(r["us"][a] / r["us"][b_])


def test_mixed_lengths_sum_and_mix():
    q, c = bench_transforms.mixed_lengths(256, 8192, seed=3)
    assert q.sum() == 8192 and len(q) == 256 and (q >= 1).all()
    assert ((q == 1).sum() > 0) and ((q > 1) & (c == 0)).sum() > 0 and ((q > 1) & (c > 0)).sum()


def test_table_and_errors(capsys):
    assert _run(["transforms", "--quick", "--sizes", "4x8"]) == 0
    assert "4 req / 8 tok" in capsys.readouterr().out
    with pytest.raises(KVABIError, match="sizes"):
        _run(["transforms", "--quick", "--sizes", "8x4"])
    with pytest.raises(KVABIError, match="suite"):
        _run(["no-such-suite"])


def test_plugin_suites():
    registry = pytest.importorskip("kvabi.backend.registry")
    calls = []

    class Good:
        @hookimpl
        def kvabi_bench_suites(self):
            return {"dummy": lambda argv: calls.append(argv) or 3}

    class Broken:
        @hookimpl
        def kvabi_bench_suites(self):
            raise RuntimeError("boom")

    registry.reset()
    try:
        registry.register(Good(), name="bench-good")
        registry.register(Broken(), name="bench-broken")
        assert _run(["dummy", "--x", "1"]) == 3
        assert calls == [["--x", "1"]]
        assert set(bench.suites()) >= {"dummy", "transforms"}
    finally:
        registry.reset()
