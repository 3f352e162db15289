"""The CI matrix a backend author copies (.github/workflows/conformance.yml) names real
backends, runs `kvabi conformance` with JUnit output it uploads, and `thorough` on a
schedule; the repository's own CI stays `make test`."""
from __future__ import annotations

import re
from pathlib import Path

from kvabi.backend import registry
from kvabi.commands.cli import build_parser

ROOT = Path(__file__).parents[1]
WORKFLOW = (ROOT / ".github" / "workflows" / "conformance.yml").read_text()


def matrix(key: str) -> list[str]:
    m = re.search(rf"^\s+{key}: \[(.*?)\]$", WORKFLOW, re.M)
    return [v.strip().strip('"') for v in m.group(1).split(",")]


def test_matrix_names_backends_that_run_on_a_cpu_runner():
    registry.reset()
    names = set(registry.backend_names())
    backends = matrix("backend")
    assert "reference" in backends and "example.torch" in backends
    for b in backends:
        assert b in names, b
        ok, why = registry.get_backend(b).available()
        assert ok, (b, why)  # no GPU or TPU on the runner
    assert matrix("python") == ["3.10", "3.11", "3.12"]


def test_jobs_run_the_kit_and_upload_junit():
    run = re.search(r"kvabi conformance \"\$\{\{ matrix.backend \}\}\"(.*?)\n\s+- name",
                    WORKFLOW, re.S).group(1)
    options = re.findall(r"(--[a-z-]+)", run)
    assert {"--junit-xml", "--json", "--replay"} <= set(options)
    parser = build_parser("conformance")  # the options exist
    args = parser.parse_args(["conformance", "reference", "--junit-xml", "x.xml",
                              "--replay", "r", "--json"])
    assert args.junit_xml == "x.xml" and args.json and args.replay == "r"
    assert "actions/upload-artifact@" in WORKFLOW and "if: always()" in WORKFLOW
    assert "path: reports/" in WORKFLOW
    assert re.search(r"schedule:\n\s+- cron:", WORKFLOW)
    assert "github.event_name == 'schedule' && 'thorough'" in WORKFLOW
    assert "KVABI_HYPOTHESIS_PROFILE" in WORKFLOW
    assert "download.pytorch.org/whl/cpu" in WORKFLOW  # never a CUDA torch


def test_repository_ci_is_the_readme_test_command():
    lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines()
             if l.strip() and not l.startswith("#")]
    assert lines[-1].strip() == "make test"
    assert "make test" in (ROOT / "README.md").read_text()
