"""`kvabi bench layout` counts regions as a direct formula says: one per run of adjacent
blocks and per combination of the axes outside B (planes, L, H)."""
import json

import numpy as np

from kvabi.bench import layout as bench
from kvabi.commands.bench import suites
from kvabi.bench.layout import SPEC
from kvabi.layout.presets import preset_names


def outside_b(name):
    return {"vllm.LBHNC": 32, "vllm.LBNHC": 32, "vllm.LHBNC": 32 * 8, "vllm.cpu_kt": 32,
            "vllm.cpu": 32, "vllm.cpu.LHBNC": 32 * 8,
            "flash_attn": 64,
            "flashinfer.NHD": 32, "flashinfer.HND": 32, "tpu.combined": 32,
            "tpu.hidden": 64, "kvbm.layer_separate": 32}.get(name, 1)


def test_region_counts(capsys):
    rows = bench.measure(seed=3, quick=True)
    scattered = bench.transfers(bench.NUM_BLOCKS, 3)["128 scattered"]
    runs = 1 + int(np.count_nonzero(np.diff(scattered) != 1))
    assert len(rows) == len(preset_names(SPEC))
    for r in rows:
        assert r["regions (run of 128)"] == outside_b(r["layout"])
        assert r["regions (128 scattered)"] == outside_b(r["layout"]) * runs
    assert "layout" in suites()
    assert suites()["layout"](["--json", "--quick"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == len(preset_names(SPEC))
