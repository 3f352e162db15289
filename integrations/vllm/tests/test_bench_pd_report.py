"""The P/D bench report states goal and measured figures without a verdict word (a slow,
shared machine is not a broken install), and marks differing tokens."""
from kvabi_vllm.tools.bench_pd import RUNS, report


def test_report_has_goal_and_measured_and_no_verdict():
    row = {"read_s": 0.002, "bytes": 4 << 20, "regions": 32, "gbps": 2.0, "tokens_equal": True,
           "pd_ms": 30.0, "transfer_ms": 5.0, "decode_ms": 20.0}
    out = {r[0]: dict(row) for r in RUNS}
    out[RUNS[2][0]]["tokens_equal"] = False
    out["goals"] = [("relayout >= 1/2 of same-layout throughput", 0.13, 0.5, ">=")]
    text = report(out)
    assert "goal: relayout >= 1/2 of same-layout throughput: >= 0.5x; measured: 0.13x" in text
    assert "    30.0      5.0      20.0" in text  # P/D, pull, decode per request
    assert "NOT met" not in text and "FAIL" not in text
    assert text.count("DIFFER") == 1 and text.count("= single engine") == len(RUNS) - 1
