"""What a failed check says, the same in every entry point: the message, the structured
details of the failure (got / want / ratio at the worst element, token, head, slot), where
a backend's own exception was raised, the minimal example, the seed and the reproducer."""
from __future__ import annotations

import math
import os
import traceback

import numpy as np

#: keys of ``ConformanceFailure.details`` shown first, in this order
_ORDER = ("layer", "kv", "token", "head", "slot", "element", "got", "want", "ratio")


def _plain(v):
    """Python scalars and lists for numpy values (no numpy reprs in reports)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _num(v, digits: int = 6) -> str:
    v = _plain(v)
    if isinstance(v, float):
        return repr(v) if not math.isfinite(v) else f"{v:.{digits}g}"
    return str(v)


def failing_error(exc: BaseException, dtype: str | None, overrides: dict | None = None
                  ) -> tuple | None:
    """(error, tolerance, dtype) of the failing example, from the failure's ``details``
    (``error``/``tolerance``, set by ``measure.expect_close``); None when the failure
    measured no error (a wrong byte, a crash)."""
    d = getattr(exc, "details", None)
    err, tol = (d.get("error"), d.get("tolerance")) if isinstance(d, dict) else (None, None)
    if err is None:
        return None
    if tol is None and dtype is not None:
        from .measure import tolerance

        tol = tolerance(dtype, overrides)
    return float(_plain(err)), (None if tol is None else float(_plain(tol))), dtype


def format_details(details: dict) -> str:
    """``details`` as one line: ``token 0, head 1: got 2.08, want 1.44 (ratio 1.4427)``."""
    if not details:
        return ""
    d = {k: _plain(v) for k, v in details.items()
         if k not in ("error", "tolerance", "measure") and v is not None}
    where = [f"{k} {d[k]}" for k in ("layer", "kv", "token", "head", "slot", "element")
             if k in d]
    vals = []
    if "got" in d:
        vals.append(f"got {_num(d['got'])}")
    if "want" in d:
        vals.append(f"want {_num(d['want'])}")
    if "ratio" in d:
        vals.append(f"ratio {_num(d['ratio'], 5)}")
    rest = [f"{k} {_num(v) if not isinstance(v, list) else v}" for k, v in d.items()
            if k not in _ORDER]
    out = ", ".join(where)
    if vals:
        out += (": " if out else "") + ", ".join(vals)
    if rest:
        out += ("; " if out else "") + ", ".join(rest)
    return out


def raise_site(exc: BaseException | None) -> str:
    """Where a backend's own exception (not the kit's ConformanceFailure) was raised:
    ``file:line in function``, the innermost frame outside the kit and Hypothesis."""
    from .measure import ConformanceFailure

    if exc is None:
        return ""
    if isinstance(exc, ConformanceFailure):
        exc = exc.__cause__
        if exc is None or isinstance(exc, ConformanceFailure):
            return ""
    kit = os.path.dirname(os.path.abspath(__file__))
    site = ""
    for fs in traceback.extract_tb(exc.__traceback__):
        f = os.path.abspath(fs.filename)
        if f.startswith(kit) or f"{os.sep}hypothesis{os.sep}" in f:
            continue
        site = f"{fs.filename}:{fs.lineno} in {fs.name}"
    return site


def rerun_command(res) -> str:
    """The ``kvabi conformance`` command that reruns this check with this seed."""
    prof = "" if res.profile in ("", "ci") else f" --profile {res.profile}"
    return f"kvabi conformance {res.backend} --check {res.check} --seed {res.seed}{prof}"


def failure_report(res) -> str:
    """The text report of a failed :class:`~kvabi.testing.runner.CheckResult`."""
    lines = [f"FAILED {res.backend} {res.check}: {res.message}"]
    det = format_details(res.details)
    if det:
        lines.append(f"  details: {det}")
    site = raise_site(res.exception)
    if site:
        lines.append(f"  raised at {site}")
    lines.append(f"  profile {res.profile}, seed {res.seed}; rerun: {rerun_command(res)}")
    if res.reproducer:
        lines.append(f"  reproducer: {res.reproducer} (run: python {res.reproducer})")
    if res.example:
        lines.append(res.example)
    return "\n".join(lines)
