"""How the conformance kit measures a backend against the reference: errors and tolerances.

Attention outputs are compared by the relative L2 error over the real tokens of a batch,
``||out - ref|| / ||ref||`` (float64, padding tokens excluded); log-sum-exp values by the
largest absolute difference (natural log), which equals the relative error of the softmax
denominator to first order.  Both must stay within the tolerance of the cache dtype.
Cache contents are compared byte for byte: there is no tolerance for a write.
"""
from __future__ import annotations

import math

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
    """A backend computed something other than the canonical semantics.

    ``details`` holds the facts of the failure as plain Python numbers and strings, for
    machine-readable reports: for attention ``error``, ``tolerance``, ``token``, ``head``,
    ``element``, ``got``, ``want``, ``ratio`` at the worst element; for writes ``layer``,
    ``kv``, ``slot`` and which token's data landed there.
    """

    def __init__(self, message: str = "", details: dict | None = None):
        super().__init__(message)
        self.details = dict(details or {})


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


def expect_close(what: str, err: float, tol: float, detail: str = "",
                 details: dict | None = None) -> float:
    """Raise :class:`ConformanceFailure` (with ``details`` plus the error and tolerance)
    unless ``err <= tol``; returns ``err``."""
    if not err <= tol:
        msg = f"{what}: error {_num(err)} exceeds tolerance {_num(tol)}"
        d = {"measure": what, "error": _plain(err), "tolerance": _plain(tol)}
        d.update(details or {})
        raise ConformanceFailure(msg + (f"; {detail}" if detail else ""), d)
    return err


def _plain(x):
    """A Python int/float/str for a numpy scalar (no numpy reprs in reports)."""
    if isinstance(x, np.generic):
        x = x.item()
    return x


def _num(x) -> str:
    """A number for a message: ints as they are, floats with 3 significant digits."""
    x = _plain(x)
    if isinstance(x, (bool, int)):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return f"{x:.4g}"
    return str(x)


def _ratio(got: float, want: float):
    """got / want, or None when undefined (want 0, or non-finite values)."""
    if want == 0 or not (math.isfinite(got) and math.isfinite(want)):
        return None
    return got / want


def worst_element(got, want, rows) -> dict:
    """The worst element of ``got`` vs ``want`` over token ``rows``: its token, head and
    (for [T, H, D] arrays) element index, the got and want values, their ratio and the
    absolute error, as plain numbers.  A non-finite ``got`` where ``want`` is finite is
    the worst; empty ``rows`` give {}."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    rows = np.asarray(rows, np.int64)
    if not len(rows) or got.shape != want.shape or got[rows].size == 0:
        return {}
    g, w = got[rows], want[rows]
    with np.errstate(invalid="ignore"):
        err = np.abs(g - w)
    same_inf = np.isinf(g) & (g == w)
    err = np.where(same_inf, 0.0, np.where(np.isnan(err), np.inf, err))
    flat = int(np.argmax(err))
    idx = np.unravel_index(flat, err.shape)
    gv, wv = float(g[idx]), float(w[idx])
    out = {"token": int(rows[idx[0]])}
    if len(idx) > 1:
        out["head"] = int(idx[1])
    if len(idx) > 2:
        out["element"] = int(idx[2])
    out.update(got=gv, want=wv, ratio=_ratio(gv, wv), abs_error=float(err[idx]))
    return out


def describe_worst(d: dict) -> str:
    """``worst at token 3 head 1 element 0: got 0.52, want -1.2 (ratio -0.43)``."""
    if not d:
        return ""
    where = " ".join(f"{k} {d[k]}" for k in ("token", "head", "element") if k in d)
    s = f"worst at {where}: got {_num(d['got'])}, want {_num(d['want'])}"
    if d.get("ratio") is not None:
        s += f" (ratio {_num(d['ratio'])})"
    return s


def worst_rows(got, want, rows, k: int = 3) -> str:
    """The tokens with the largest error, for failure messages."""
    got = np.asarray(got, dtype=np.float64)[rows]
    want = np.asarray(want, dtype=np.float64)[rows]
    with np.errstate(invalid="ignore"):
        err = np.abs(got - want).reshape(len(rows), -1).max(axis=1) if len(rows) else []
    err = np.where(np.isnan(err), np.inf, err)
    top = np.argsort(-np.asarray(err))[:k]
    return "largest errors at tokens " + ", ".join(
        f"{int(rows[i])} ({_num(float(err[i]))})" for i in top)
