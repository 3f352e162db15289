"""The result table of a conformance run (``kvabi conformance``): one row per backend and
check, the failing example's error for a failed check, the worst passing one otherwise."""
from __future__ import annotations

from .coverage import counts, summary
from .runner import FAILED, NOT_APPLICABLE, PASSED, SKIPPED

HEADER = ["BACKEND", "CHECK", "EXAMPLES", "RESULT", "WORST ERROR", "DRAWN", "SECONDS"]
COVERAGE_HEADER = ["BACKEND", "CHECK", "KINDS", "DTYPE QUANT ROUNDING", "LAYOUTS"]
LEGEND = ("(worst error: for a failed check the failing example's error, else the passing "
          "example closest to its tolerance; relative L2 of the output or absolute lse "
          "error; n/m examples: the time budget stopped the check early; drawn: kinds, "
          "cache dtype/quant/rounding combinations and layouts the examples asked the "
          "backend for, listed below)")


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
                     summary(r.coverage), f"{r.seconds:.1f}"])
    return align(rows)


def coverage_table(results) -> str:
    """What each check drew: examples per kind, per cache dtype / quant / rounding (short
    names: i8 int8, e4m3 float8_e4m3fn, tensor per_tensor, token-head per_token_head, away
    nearest_away, ...) and per layout; then every claimed dtype / quant / rounding a check
    did not draw, with the reason."""
    rows = [COVERAGE_HEADER]
    missing = []
    for r in results:
        cov = r.coverage
        if not cov.drawn:
            continue
        rows.append([r.backend, r.check, counts(cov.kinds()), counts(cov.combos(), True),
                     counts(cov.layouts())])
        groups: dict = {}
        for d, q, rnd, why in cov.not_drawn:
            groups.setdefault(why, []).append(short(combo_text(d, q, rnd)))
        for why, combos in groups.items():
            missing.append(f"  {r.backend} {r.check}: {', '.join(combos)}: {why}")
    out = align(rows) if len(rows) > 1 else "(no example ran)"
    if missing:
        out += "\nclaimed but not drawn:\n" + "\n".join(missing)
    return out


def short(label: str) -> str:
    """A dtype/quant/rounding label in the short names of the coverage table."""
    from .coverage import SHORT

    return " ".join(SHORT.get(w, w) for w in label.split())


def combo_text(dtype, quant, rounding) -> str:
    from .coverage import combo_label

    return combo_label(dtype, quant, rounding)
