"""Conformance results as JUnit XML (``kvabi conformance --junit-xml PATH``): one test suite
per backend, one test case per backend and check, which CI systems show as test results."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from itertools import groupby
from pathlib import Path

from .coverage import combo_label
from .coverage import counts as coverage_counts
from .failure import failure_report
from .report_table import examples_cell, worst_error
from .runner import FAILED, NOT_APPLICABLE, SKIPPED


def _suite(backend: str, results, profile: str, seed: int) -> ET.Element:
    suite = ET.Element("testsuite", name=f"kvabi conformance {backend}")
    props = ET.SubElement(suite, "properties")
    for k, v in (("backend", backend), ("profile", profile), ("seed", str(seed))):
        ET.SubElement(props, "property", name=k, value=v)
    counts = {"tests": 0, "failures": 0, "skipped": 0, "errors": 0}
    total = 0.0
    for r in results:
        case = ET.SubElement(suite, "testcase", classname=f"kvabi.conformance.{backend}",
                             name=r.check, time=f"{r.seconds:.3f}")
        cov = r.coverage
        drawn = (("drawn.kinds", coverage_counts(cov.kinds())),
                 ("drawn.dtypes", coverage_counts(cov.combos())),
                 ("drawn.layouts", coverage_counts(cov.layouts())),
                 ("not_drawn", "; ".join(f"{combo_label(d, q, x)}: {why}"
                                         for d, q, x, why in cov.not_drawn) or "-"))
        if cov.drawn or cov.not_drawn:
            cprops = ET.SubElement(case, "properties")
            for k, v in drawn:
                ET.SubElement(cprops, "property", name=k, value=v)
        counts["tests"] += 1
        total += r.seconds
        if r.status == FAILED:
            counts["failures"] += 1
            f = ET.SubElement(case, "failure", message=r.message.splitlines()[0][:500],
                              type=type(r.exception).__name__ if r.exception else "Failure")
            f.text = failure_report(r)
        elif r.status in (NOT_APPLICABLE, SKIPPED):
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", message=f"{r.status}: {r.message}")
        out = ET.SubElement(case, "system-out")
        out.text = (f"examples {examples_cell(r)}, refused {r.refused}, worst error "
                    f"{worst_error(r)}, seed {r.seed}"
                    + "".join(f"\n{k}: {v}" for k, v in drawn if cov.drawn or cov.not_drawn))
    for k, v in counts.items():
        suite.set(k, str(v))
    suite.set("time", f"{total:.3f}")
    return suite


def tree(results, *, profile: str, seed: int) -> ET.ElementTree:
    root = ET.Element("testsuites", name="kvabi conformance")
    for backend, rs in groupby(results, key=lambda r: r.backend):
        root.append(_suite(backend, list(rs), profile, seed))
    for k in ("tests", "failures", "skipped", "errors"):
        root.set(k, str(sum(int(s.get(k)) for s in root)))
    return ET.ElementTree(root)


def write(path, results, *, profile: str, seed: int) -> Path:
    """Write the JUnit XML file (parent directories created); returns its path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    t = tree(results, profile=profile, seed=seed)
    ET.indent(t)
    t.write(p, encoding="utf-8", xml_declaration=True)
    return p
