"""What ``kvabi conformance`` reports: the failing error in the table, the failure's details
(got / want / ratio, token and head), JSON and JUnit XML for CI, exit statuses, and option
values refused as usage errors."""
from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import pytest
from kit_fixtures import planted  # noqa: F401 - fixture

from kvabi.commands.cli import main
from kvabi.testing import get_check, run_check
from kvabi.testing.report_table import worst_error


def row(out: str, backend: str, check: str) -> list[str]:
    line = next(l for l in out.splitlines() if l.split()[:2] == [backend, check])
    return line.split(None, 4)


def test_table_shows_the_failing_error_and_the_details(planted, capsys, tmp_path):
    rc = main(["conformance", "planted.lse_log2", "planted.recording", "--check", "attention",
               "--seed", "5"])
    out = capsys.readouterr().out
    assert rc == 1
    cells = row(out, "planted.lse_log2", "attention")
    assert cells[3] == "FAILED"
    failing = float(cells[4].split()[0])
    assert failing > 1e-2 and "> tol 1e-05 float32" in cells[4]  # not the passing 0.00e+00
    assert row(out, "planted.recording", "attention")[3] == "passed"
    # A base-2 lse is named by its ratio at the worst element, with token and head.
    report = out.split("FAILED planted.lse_log2 attention: ", 1)[1]
    details = next(l for l in report.splitlines() if l.strip().startswith("details:"))
    assert "token " in details and "head " in details
    ratio = float(details.split("ratio ")[1].split(";")[0].split(",")[0])
    assert ratio == pytest.approx(1 / math.log(2), rel=1e-4)
    assert "array(" not in report and "np.float" not in report
    assert "reproducer: " + str(tmp_path / "replay") in report


def test_worst_error_of_a_failed_check_is_the_failing_one(planted):
    res = run_check(get_check("attention"), planted.NoWindow(), seed=2, replay=None)
    assert res.failed and res.failing is not None
    err, tol, dtype = res.failing
    assert err > tol == 1e-5 and dtype == "float32"
    assert res.details.get("error", err) == pytest.approx(err)
    assert worst_error(res).startswith(f"{err:.3g} > tol")
    res = run_check(get_check("write_kv"), planted.WrongSlot(), seed=2, replay=None)
    assert res.failed and res.failing is None and worst_error(res) == "cache bytes differ"


def test_json_and_junit(planted, capsys, tmp_path):
    junit = tmp_path / "ci" / "conformance.xml"
    rc = main(["conformance", "planted.no_window", "planted.recording", "--check", "attention",
               "--check", "write_kv", "--json", "--junit-xml", str(junit)])
    out = capsys.readouterr().out
    assert rc == 1
    doc = json.loads(out)  # stdout is exactly one JSON document
    assert doc["profile"] == "ci" and doc["seed"] == 0 and doc["failed"] == 1
    by = {(r["backend"], r["check"]): r for r in doc["results"]}
    assert set(by) == {(b, c) for b in ("planted.no_window", "planted.recording")
                       for c in ("attention", "write_kv")}
    bad = by["planted.no_window", "attention"]
    assert bad["status"] == "FAILED" and bad["seed"] == 0 and bad["duration_s"] >= 0
    assert bad["worst_error"] > bad["tolerance"] == 1e-5 and bad["dtype"] == "float32"
    assert bad["details"]["token"] >= 0 and "got" in bad["details"]
    assert bad["reproducer"].endswith(".py") and open(bad["reproducer"]).read()
    assert bad["examples"] >= 0 and "exceeds tolerance" in bad["message"]
    good = by["planted.recording", "attention"]
    assert good["status"] == "passed" and good["examples"] >= 2 and good["reproducer"] is None
    assert 0 <= good["worst_error"] <= good["tolerance"] and good["details"] == {}
    assert by["planted.recording", "write_kv"]["worst_error"] == 0

    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("tests") == "4" and root.get("failures") == "1"
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert len(cases) == 4
    fail = cases["kvabi.conformance.planted.no_window", "attention"].find("failure")
    assert fail is not None and "exceeds tolerance" in fail.get("message")
    assert "seed 0" in fail.text and "reproducer:" in fail.text
    assert cases["kvabi.conformance.planted.recording", "attention"].find("failure") is None
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["seed"] == "0" and props["profile"] == "ci"

    # Exit status 0 only when nothing failed.
    assert main(["conformance", "planted.recording", "--check", "write_kv", "--json",
                 "--quick"]) == 0
    assert json.loads(capsys.readouterr().out)["failed"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--max-examples", "0"], "argument --max-examples: must be >= 1, got 0"),
    (["--max-examples", "1.5"], "argument --max-examples: must be an integer"),
    (["--time-budget", "-5"], "argument --time-budget: must be >= 0, got -5"),
    (["--time-budget", "inf"], "argument --time-budget: must be a finite number"),
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--seed", str(2**32)], "argument --seed: must be <= 4294967295"),
    (["--check", "atention"], "argument --check: unknown check 'atention'"),
    (["--profile", "fast"], "argument --profile: invalid choice: 'fast'"),
])
def test_bad_option_values_are_usage_errors(argv, message, capsys):
    assert main(["conformance", "reference", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvabi: error: ") and message in err, err
    assert "Traceback" not in err
