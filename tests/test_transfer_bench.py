"""``kvabi bench transfer --quick --json``: the JSON shape and the goals' evaluation (figures
themselves are the benchmark's business, not asserted)."""
from __future__ import annotations

import json

import pytest

from kvabi.bench import transfer as bench
from kvabi.commands.cli import main
from kvabi.transfer.nixl import available


def test_quick_json_shape(capsys):
    assert main(["bench", "transfer", "--quick", "--json", "--presets",
                 f"{bench.CROSS},{bench.PER_LAYER}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"memcpy_gbps", "nixl_single_gbps", "rows", "figures"}
    fig = result["figures"]
    quick = bench.Setup(layers=4, tokens=256, repeat=1)
    t_lists, t_conv = fig["from_lengths"]
    assert t_lists > 0 and t_conv > 0
    assert all(a > 0 and b > 0 for a, b in fig.get("torch_vs_numpy", {}).values())
    if available()[0]:
        x = fig["nixl_relayout"]
        assert x["relayout_s"] > 0 and x["same_layout_s"] > 0 and x["regions"] > 1
        assert fig["post_check"]["regions"] > 1
    assert result["memcpy_gbps"] > 0
    executors = {"local", "offload", "onload"} | ({"nixl"} if available()[0] else set())
    seen = set()
    for row in result["rows"]:
        assert set(row) == {"src", "dst", "blocks", "executor", "regions", "gbps", "ref_gbps"}
        assert row["ref_gbps"] > 0
        assert row["executor"] in executors and row["blocks"] in ("contiguous", "scattered")
        assert isinstance(row["regions"], int) and row["regions"] >= 1 and row["gbps"] > 0
        seen.add(row["executor"])
    assert seen == executors
    rows = {(r["src"], r["executor"], r["blocks"]): r["regions"] for r in result["rows"]}
    # Region counts are exact: one per run (cross-layer), one per run and layer (per-layer).
    assert rows[(bench.CROSS, "local", "contiguous")] == 1
    assert rows[(bench.PER_LAYER, "local", "contiguous")] == quick.layers
    assert rows[(bench.PER_LAYER, "local", "scattered")] == \
        quick.layers * rows[(bench.CROSS, "local", "scattered")]
    assert any(r["src"] == "flashinfer.HND/16" for r in result["rows"])
    assert fig["checksums"]["s"] > 0 and fig["checksums"]["nbytes"] == \
        quick.layers * quick.tokens * 2 * 8 * 128 * 2
    neg = fig["negotiation"]
    assert len(neg) == 4 and all(r["s"] > 0 and 0 < r["bytes"] < 4096 for r in neg)
    assert {r["kind"] for r in neg} == {"relayout"} and neg[0]["planes"] == 64
    if available()[0]:
        tp = fig["tp_pulls"]
        assert [(r["preset"], r["pair"], r["ref"]) for r in tp] == [
            (bench.PER_LAYER, "TP 2 -> 1", "TP 1 -> 1"), (bench.PER_LAYER, "TP 1 -> 2", "TP 2 -> 2")]
        # the same bytes both ways: a whole request (all heads), then half of it
        full = quick.layers * quick.tokens * 2 * 8 * 128 * 2
        assert [r["nbytes"] for r in tp] == [full, full // 2]
        assert all(r["s"] > 0 and r["ref_s"] > 0 and r["regions"] > r["ref_regions"]
                   for r in tp)
    marks = bench.goals(result)
    assert {g for g, _, _ in marks} >= {"relayout >= 30% of memcpy"}
    assert any(g.startswith("negotiation + handshake < 1 ms") for g, _, _ in marks)
    assert all(p in (True, False, None) for _, p, _ in marks)


def test_goals_marks():
    def row(src, executor, regions, g, ref):
        return dict(src=src, dst=src, blocks="contiguous", executor=executor, regions=regions,
                    gbps=g, ref_gbps=ref)

    rows = [row(bench.CROSS, "local", 1, 9.5, 10.0), row(bench.PER_LAYER, "local", 32, 5.0, 5.2),
            row(bench.CROSS, "nixl", 1, 2.0, 2.5), row(bench.PER_LAYER, "nixl", 32, 1.0, 2.0)]
    marks = {g: p for g, p, _ in bench.goals({"memcpy_gbps": 10.0, "nixl_single_gbps": 2.5,
                                              "rows": rows})}
    assert marks["cross-layer >= 32x fewer regions than per-layer (contiguous)"] is True
    assert marks[f"local execute >= 90% of memcpy ({bench.CROSS}, contiguous)"] is True
    # judged against its own side-by-side memcpy (5.2), not the best one (10.0)
    assert marks[f"local execute >= 90% of memcpy ({bench.PER_LAYER}, contiguous)"] is True
    # 80% vs 50% of their own READs: 1.6x
    assert marks["NIXL cross-layer >= 1.5x per-layer GB/s (contiguous)"] is True
    assert marks["NIXL cross-layer >= 70% of one single-region READ (contiguous)"] is True
    assert marks["NIXL goals (scattered)"] is None


def test_help_and_bad_preset(capsys):
    with pytest.raises(SystemExit) as e:
        bench.run(["--help"])
    assert e.value.code == 0 and "--quick" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.run(["--presets", "nope"])
    assert "unknown preset 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.run(["--repeat", "0"])
    assert "--repeat: must be >= 1, got 0" in capsys.readouterr().err


def test_tp_goals_marks():
    from kvabi.bench import transfer_tp

    fig = {"tp_pulls": [dict(preset="vllm.BHLNC", pair="TP 2 -> 1", ref="TP 1 -> 1",
                             nbytes=10**9, regions=256, ref_regions=1, s=1.0, ref_s=0.95),
                        dict(preset="flashinfer.HND", pair="TP 1 -> 2", ref="TP 2 -> 2",
                             nbytes=10**9, regions=8192, ref_regions=32, s=2.0, ref_s=1.0)],
           "negotiation": [dict(case="x", planes=64, bytes=1800, ranks=1, s=4e-4,
                                kind="relayout", cost_s=0.01, regions_per_block=1,
                                staging_bytes_per_block=1),
                           dict(case="y", planes=64, bytes=5000, ranks=1, s=4e-4,
                                kind="same", cost_s=0.01, regions_per_block=1,
                                staging_bytes_per_block=0)]}
    marks = [p for _, p, _ in transfer_tp.goals(fig)]
    assert marks == [True, False, True, False]
    fig["checksums"] = {"nbytes": 2**20, "s": 0.01, "memcpy_s": 0.001}
    assert [p for _, p, _ in transfer_tp.goals(fig)] == [None, True, False, True, False]
    assert [p for _, p, _ in transfer_tp.goals({})] == [None]
