"""Conformance results as JSON for CI (``kvabi conformance --json``): one object per
backend and check, with plain numbers (non-finite errors as the strings "inf"/"nan")."""
from __future__ import annotations

import json
import math

from .failure import _plain
from .runner import FAILED


def _num(x):
    x = _plain(x)
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, list):
        return [_num(v) for v in x]
    return x


def result_dict(r) -> dict:
    """One result: status, examples, worst error (the failing one for a failure),
    tolerance, dtype, seed, duration, message, details and reproducer path."""
    err = tol = dtype = None
    if r.status == FAILED and r.failing is not None:
        err, tol, dtype = r.failing
    elif r.status != FAILED and r.examples and r.refused < r.examples:
        if r.closest is not None:
            err, tol, dtype = r.closest
        else:
            err = r.worst
        if r.exact:
            tol = 0.0  # byte-exact: no tolerance
    return {
        "backend": r.backend,
        "check": r.check,
        "status": r.status,
        "examples": r.examples,
        "max_examples": r.max_examples,
        "refused": r.refused,
        "budget_hit": r.budget_hit,
        "exact": r.exact,
        "worst_error": _num(err),
        "tolerance": _num(tol),
        "dtype": dtype,
        "profile": r.profile,
        "seed": r.seed,
        "duration_s": round(r.seconds, 3),
        "message": r.message,
        "details": {k: _num(v) for k, v in r.details.items()},
        "example": r.example,
        "reproducer": r.reproducer or None,
    }


def document(results, *, profile: str, seed: int) -> dict:
    from ..util.version import __version__

    failed = sum(r.status == FAILED for r in results)
    return {"kvabi": __version__, "profile": profile, "seed": seed,
            "passed": sum(r.status == "passed" for r in results), "failed": failed,
            "results": [result_dict(r) for r in results]}


def dumps(results, *, profile: str, seed: int) -> str:
    return json.dumps(document(results, profile=profile, seed=seed), indent=2,
                      allow_nan=False)
