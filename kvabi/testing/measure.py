"""How the conformance kit measures a backend against the reference: errors and tolerances.

Attention outputs are compared by the relative L2 error over the real tokens of a batch,
``||out - ref|| / ||ref||`` (float64, padding tokens excluded); log-sum-exp values by the
largest absolute difference (natural log), which equals the relative error of the softmax
denominator to first order.  Both must stay within the tolerance of the cache dtype.
Cache contents are compared byte for byte: there is no tolerance for a write.
"""
from __future__ import annotations

import numpy as np

#: relative L2 error allowed per cache dtype (see specs/conformance.md for the reasoning)
TOLERANCES = {
    "float32": 1e-5,
    "float16": 2e-3,
    "bfloat16": 2e-2,
    "float8_e4m3fn": 1e-1,
    "float8_e5m2": 1e-1,
    "int8": 2e-2,
}


class ConformanceFailure(AssertionError):
    """A backend computed something other than the canonical semantics."""


def tolerance(dtype: str, overrides: dict | None = None) -> float:
    """The error allowed for a cache dtype (``overrides`` maps dtype -> tolerance)."""
    if overrides and dtype in overrides:
        return float(overrides[dtype])
    return TOLERANCES[dtype]


def relative_l2(got, want) -> float:
    """``||got - want|| / ||want||`` in float64; inf when ``got`` is not finite.

    When ``want`` is all zeros the absolute norm of the difference is returned.
    """
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ConformanceFailure(f"shape {got.shape} differs from the reference's {want.shape}")
    if got.size == 0:
        return 0.0
    if not np.isfinite(got).all():
        return float("inf")
    num = float(np.linalg.norm(got - want))
    den = float(np.linalg.norm(want))
    return num / den if den > 0 else num


def lse_error(got, want) -> float:
    """Largest absolute difference of two log-sum-exp arrays; inf where only one is finite."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ConformanceFailure(f"lse shape {got.shape} differs from the reference's "
                                 f"{want.shape}")
    if got.size == 0:
        return 0.0
    both_inf = np.isneginf(got) & np.isneginf(want)
    with np.errstate(invalid="ignore"):
        d = np.where(both_inf, 0.0, np.abs(got - want))
    d = np.where(np.isnan(d), np.inf, d)
    return float(d.max())


def expect_close(what: str, err: float, tol: float, detail: str = "") -> float:
    """Raise :class:`ConformanceFailure` unless ``err <= tol``; returns ``err``."""
    if not err <= tol:
        msg = f"{what}: error {err:.3g} exceeds tolerance {tol:.3g}"
        raise ConformanceFailure(msg + (f"; {detail}" if detail else ""))
    return err


def worst_rows(got, want, rows, k: int = 3) -> str:
    """The tokens with the largest error, for failure messages."""
    got = np.asarray(got, dtype=np.float64)[rows]
    want = np.asarray(want, dtype=np.float64)[rows]
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want).reshape(len(rows), -1).max(axis=1) if len(rows) else []
    err = np.where(np.isnan(err), np.inf, err)
    top = np.argsort(-np.asarray(err))[:k]
    return "largest errors at tokens " + ", ".join(
        f"{int(rows[i])} ({float(err[i]):.3g})" for i in top)
