"""Attention equals the reference within the dtype's tolerance; lse too; the cache is
only read."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ..harness import Runner, expect_same_cache, step_inputs
from ..measure import expect_close, lse_error, relative_l2, tolerance, worst_rows
from .base import KitOptions, WithExtra, attention_cases


def compare_outputs(what, case, got, want, rows, options, *, got_lse=None, want_lse=None
                    ) -> float:
    """Relative L2 error of ``got`` vs ``want`` at token ``rows`` (and lse error), checked
    against the dtype's tolerance; returns the larger error."""
    tol = tolerance(case.spec.dtype, options.tolerances)
    rows = np.asarray(rows, np.int64)
    err = relative_l2(got[rows], want[rows])
    expect_close(f"{what}: relative L2 error of the output", err, tol,
                 worst_rows(got, want, rows))
    if got_lse is not None:
        lerr = lse_error(got_lse[rows], want_lse[rows])
        expect_close(f"{what}: largest lse error", lerr, tol, worst_rows(got_lse, want_lse, rows))
        err = max(err, lerr)
    return err


def reference_step(reference, case, meta=None, *, lse=True, spec=None):
    """(runner, out, lse) of the reference writing and attending the case's step."""
    r = Runner(reference, case, oracle=True)
    plan = r.plan(case.meta if meta is None else meta, spec)
    k, v, q = step_inputs(case)
    r.write(plan, k, v)
    out, l_ = r.attend(plan, q, lse=lse)
    return r, out, l_


def check_attention(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """Write the step and attend: the output and lse equal the reference's within
    tolerance, and attention leaves every cache byte as it was.

    ``params`` is an :class:`AttentionCase` (both ``return_lse`` modes are checked) or a
    ``WithExtra`` whose ``return_lse`` (True/False) picks one, which halves the calls to
    slow backends.
    """
    case = getattr(params, "case", params)
    mode = getattr(params, "extra", {}).get("return_lse")
    meta = case.meta
    rows = np.arange(meta.num_actual_tokens)
    r, want, want_lse = reference_step(reference, case)
    b = Runner(backend, case, oracle=False)
    plan = b.plan(meta)
    k, v, q = step_inputs(case)
    b.write(plan, k, v)
    before = b.planes()
    err = 0.0
    if mode in (None, False):
        got, _ = b.attend(plan, q)
        _shape("attention output", got, want)
        err = compare_outputs("attention", case, got, want, rows, options)
    if mode in (None, True):
        got2, got_lse = b.attend(plan, q, lse=True)
        _shape("attention(return_lse=True) output", got2, want)
        _shape("lse", got_lse, want_lse)
        err = max(err, compare_outputs("attention(return_lse=True)", case, got2, want, rows,
                                       options, got_lse=got_lse, want_lse=want_lse))
    expect_same_cache("attention must only read the cache", case.layout, case.spec,
                      b.planes(), before)
    return err


def _shape(what, got, want):
    from ..measure import ConformanceFailure

    if got.shape != want.shape:
        raise ConformanceFailure(f"{what}: shape {got.shape}, expected {want.shape}")


@st.composite
def _attention_params(draw, backend, options):
    case = draw(attention_cases(backend, options))
    return WithExtra(case, {"return_lse": draw(st.booleans())})


def attention_strategy(backend, options):
    return _attention_params(backend, options)
