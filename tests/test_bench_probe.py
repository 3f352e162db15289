"""``kvabi bench probe`` runs and reports every figure (tiny caches; the real shape is the
suite's default)."""
from kvabi.bench import probe
from kvabi.commands.bench import suites


def test_suite_registered_and_measures():
    assert "probe" in suites()
    rows = probe.measure(quick=True, blocks_list=(3,), num_layers=2)
    assert [r["layout"] for r in rows] == ["vllm.LBHNC", "flash_attn"]
    for r in rows:
        assert r["infer_s"] > 0 and r["verify_ms"] > 0 and r["memset_s"] >= 0
