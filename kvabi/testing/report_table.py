"""The result table of a conformance run (``kvabi conformance``): one row per backend and
check, the failing example's error for a failed check, the worst passing one otherwise."""
from __future__ import annotations

from .runner import FAILED, NOT_APPLICABLE, PASSED, SKIPPED

HEADER = ["BACKEND", "CHECK", "EXAMPLES", "RESULT", "WORST ERROR", "SECONDS"]
LEGEND = ("(worst error: for a failed check the failing example's error, else the passing "
          "example closest to its tolerance; relative L2 of the output or absolute lse "
          "error; n/m examples: the time budget stopped the check early)")


def worst_error(r) -> str:
    """The WORST ERROR cell of a result."""
    if r.status == FAILED:
        if r.failing is not None:
            err, tol, dtype = r.failing
            limit = "" if tol is None else f" > tol {tol:.0e}"
            return f"{err:.3g}{limit} {dtype or ''}".rstrip()
        return "cache bytes differ" if r.exact else "- (no error measured)"
    if r.status in (NOT_APPLICABLE, SKIPPED) or r.examples == 0:
        return "-"
    if r.refused == r.examples:
        return "- (all refused)"
    if r.exact:
        return "0 (byte-exact)" if r.worst == 0 else f"{r.worst:.2e}"
    if r.closest is None:
        return f"{r.worst:.2e}"
    err, tol, dtype = r.closest
    return f"{err:.2e} (tol {tol:.0e} {dtype})"


def examples_cell(r) -> str:
    if r.budget_hit:
        return f"{r.examples}/{r.max_examples}"
    return str(r.examples)


def result_cell(r) -> str:
    if r.status == PASSED and r.refused:
        return f"passed ({r.refused} refused)"
    return r.status


def align(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def table(results) -> str:
    """The aligned table with its header."""
    rows = [HEADER]
    for r in results:
        rows.append([r.backend, r.check, examples_cell(r), result_cell(r), worst_error(r),
                     f"{r.seconds:.1f}"])
    return align(rows)
