"""``kvabi bench quant`` runs every variant on both settings and reports figures (tiny
settings; no figure is asserted beyond being measured)."""
import json

from kvabi.commands.cli import main


def test_bench_quant_json(capsys):
    assert main(["bench", "quant", "--batch", "2", "--context", "16", "--prefill", "16",
                 "--repeat", "1", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["goal"] == 1.5 and len(doc["settings"]) == 2
    for rows in doc["settings"].values():
        assert set(rows) == {"float16", "int8 per_token_head", "fp8 per_token_head",
                             "fp8 per_tensor"}
        assert rows["float16"]["ratio"] == 1.0
        assert all(r["layer_ms"] > 0 and r["ratio"] > 0 for r in rows.values())


def test_bench_quant_table_prints_the_goal(capsys):
    assert main(["bench", "quant", "--batch", "1", "--context", "4", "--prefill", "4",
                 "--repeat", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "goal: reference on an int8 per-token-head cache within 1.5x of float16" in out
    assert main(["bench", "quant", "--repeat", "0"]) == 2
