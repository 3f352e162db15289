"""``kvabi bench transfer --quick --json``: the JSON shape and the goals' evaluation (figures
themselves are the benchmark's business, not asserted)."""
from __future__ import annotations

import json

import pytest

from kvabi.bench import transfer as bench
from kvabi.bench.transfer_table import COLUMNS, alternate, format_table, row
from kvabi.commands.cli import main
from kvabi.transfer.nixl import available


def test_quick_json_shape(capsys):
    assert main(["bench", "transfer", "--quick", "--json", "--presets",
                 f"{bench.CROSS},{bench.PER_LAYER}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"setup", "table", "figures"}
    fig = result["figures"]
    quick = bench.Setup(layers=4, tokens=256, repeat=1)
    assert result["setup"]["layers"] == quick.layers and result["setup"]["tokens"] == quick.tokens
    t_lists, t_conv = fig["from_lengths"]
    assert t_lists > 0 and t_conv > 0
    assert all(a > 0 and b > 0 for a, b in fig.get("torch_vs_numpy", {}).values())
    nixl = available()[0]
    if nixl:
        assert fig["post_check"]["regions"] > 1
    full = quick.layers * quick.tokens * 2 * 8 * 128 * 2
    pairs = {"local copy", "offload", "onload"} | ({"NIXL pull"} if nixl else set())
    seen = set()
    for r in result["table"]:
        assert set(r) == set(COLUMNS)
        assert r["pair"] in pairs and r["blocks"] in ("contiguous", "scattered")
        assert isinstance(r["regions"], int) and r["regions"] >= 1
        assert r["s"] > 0 and r["memcpy_s"] > 0 and r["bytes"] in (full, full // 2)
        assert (r["ref"] is None) == (r["ref_s"] is None)
        assert (r["descriptors"] is None) == (r["pair"] != "NIXL pull")
        seen.add(r["pair"])
    assert seen == pairs
    text = format_table(result["table"])
    assert len(text.splitlines()) == len(result["table"]) + 1
    rows = {(r["pair"], r["src"], r["dst"], r["blocks"]): r for r in result["table"]}

    def regions(src, blocks, dst=None):
        return rows[("local copy", src, dst or src, blocks)]["regions"]

    # Region counts are exact: one per run (cross-layer), one per run and layer (per-layer).
    assert regions(bench.CROSS, "contiguous") == 1
    assert regions(bench.PER_LAYER, "contiguous") == quick.layers
    assert regions(bench.PER_LAYER, "scattered") == quick.layers * regions(bench.CROSS,
                                                                           "scattered")
    for a, b, bs in bench.RELAYOUTS:
        r = rows[("local copy", f"{a}/16", f"{b}/{bs}", "contiguous")]
        assert r["ref"] == "same layout" and r["bytes"] == full
        if nixl:
            p = rows[("NIXL pull", f"{a}/16", f"{b}/{bs}", "contiguous")]
            # staged: a few descriptors for the source blocks, not one per region
            assert p["ref"] == "same layout" and p["descriptors"] < p["regions"]
            assert fig["relayout_pulls"][f"{a}/16 -> {b}/{bs}"]["same_descriptors"] >= 1
    assert fig["checksums"]["s"] > 0 and fig["checksums"]["nbytes"] == full
    neg = fig["negotiation"]
    assert len(neg) == 4 and all(r["s"] > 0 and 0 < r["bytes"] < 4096 for r in neg)
    assert {r["kind"] for r in neg} == {"relayout"} and neg[0]["planes"] == 64
    if nixl:
        tp = [r for r in result["table"] if r["tp"] != "1 -> 1"]
        assert [(r["src"], r["tp"], r["ref"]) for r in tp] == [
            (bench.PER_LAYER, "2 -> 1", "TP 1 -> 1"), (bench.PER_LAYER, "1 -> 2", "TP 2 -> 2")]
        # the same bytes both ways: a whole request (all heads), then half of it
        assert [r["bytes"] for r in tp] == [full, full // 2]
        assert all(r["ref_s"] > 0 and r["descriptors"] >= 1 for r in tp)
    marks = bench.goals(result)
    assert {g for g, _, _ in marks} >= {"relayout >= 0.3x memcpy"}
    assert any(g.startswith("negotiation + handshake < 1 ms") for g, _, _ in marks)
    assert any(g.startswith("relayout pull >= 0.9x") for g, _, _ in marks) == nixl
    assert all(p in (True, False, None) for _, p, _ in marks)


def _row(pair, src, regions, s, ref=None, ref_s=None, memcpy_s=1.0, tp="1 -> 1", dst=None):
    return row(pair, src, dst or src, tp, "contiguous", 10**9, regions,
               None if pair != "NIXL pull" else regions, s, ref, ref_s, memcpy_s)


def test_goals_marks():
    rows = [_row("local copy", bench.CROSS, 1, 1.0, memcpy_s=0.95),
            _row("local copy", bench.PER_LAYER, 32, 1.0, memcpy_s=0.5),
            _row("NIXL pull", bench.CROSS, 1, 1.0, "1-region READ", 0.8),
            _row("NIXL pull", bench.PER_LAYER, 32, 1.0, "1-region READ", 0.5),
            _row("NIXL pull", "vllm.cpu/16", 100, 1.0, "same layout", 0.95,
                 dst="vllm.cpu.BLHNC/64"),
            _row("NIXL pull", "flashinfer.HND", 100, 2.0, "TP 1 -> 1", 1.0, tp="2 -> 1")]
    marks = {g: p for g, p, _ in bench.goals({"table": rows})}
    assert marks["cross-layer >= 32x fewer regions than per-layer (contiguous)"] is True
    # judged against its own side-by-side memcpy
    assert marks[f"local execute >= 0.9x memcpy ({bench.CROSS}, contiguous)"] is True
    assert marks[f"local execute >= 0.9x memcpy ({bench.PER_LAYER}, contiguous)"] is False
    # 0.8x vs 0.5x of their own READs: 1.6x
    assert marks["NIXL cross-layer >= 1.5x per-layer GB/s (contiguous)"] is True
    assert marks["NIXL cross-layer >= 0.7x one single-region READ (contiguous)"] is True
    assert marks["NIXL goals (scattered)"] is None
    assert marks["relayout pull >= 0.9x the same layout pull of the same bytes (vllm.cpu/16 "
                 "-> vllm.cpu.BLHNC/64, TP 1 -> 1)"] is True
    assert marks["relayout pull >= 0.9x the TP 1 -> 1 pull of the same bytes (flashinfer.HND "
                 "-> flashinfer.HND, TP 2 -> 1)"] is False
    tp_marks = [g for g, _, _ in bench.goals({"table": rows}, tp_only=True)]
    assert all(g.startswith("relayout pull") for g in tp_marks) and len(tp_marks) == 2


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

    fig = {"negotiation": [dict(case="x", planes=64, bytes=1800, ranks=1, s=4e-4,
                                kind="relayout", cost_s=0.01, regions_per_block=1,
                                staging_bytes_per_block=1),
                           dict(case="y", planes=64, bytes=5000, ranks=1, s=4e-4,
                                kind="same", cost_s=0.01, regions_per_block=1,
                                staging_bytes_per_block=0)]}
    marks = [p for _, p, _ in transfer_tp.goals(fig)]
    assert marks == [True, False]
    fig["checksums"] = {"nbytes": 2**20, "s": 0.01, "memcpy_s": 0.001}
    assert [p for _, p, _ in transfer_tp.goals(fig)] == [None, True, False]
    assert transfer_tp.goals({}) == []


def test_alternate_and_table_text():
    calls = []
    best = alternate([lambda: calls.append("a"), lambda: calls.append("b")], 3)
    assert calls == ["a", "b"] * 4 and len(best) == 2 and all(b >= 0 for b in best)
    r = _row("NIXL pull", "x", 7, 0.5, "same layout", 0.25, memcpy_s=1.0)
    line = format_table([r]).splitlines()[1].split()
    # ms, GB/s, reference, x ref (0.25 / 0.5), x memcpy (1.0 / 0.5)
    assert line[-6:] == ["500.0", "2.00", "same", "layout", "0.50", "2.00"]
