"""Attention equals the reference within the dtype's tolerance; lse too; the cache is
only read; one plan serves every layer."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ..cases import layer_inputs, layer_sinks
from ..harness import Runner, expect_same_cache, step_inputs
from ..measure import (ConformanceFailure, describe_worst, expect_close, lse_error,
                       relative_l2, tolerance, worst_element, worst_rows)
from .base import KitOptions, WithExtra, attention_cases


def compare_outputs(what, case, got, want, rows, options, *, got_lse=None, want_lse=None
                    ) -> float:
    """Relative L2 error of ``got`` vs ``want`` at token ``rows`` (and lse error), checked
    against the dtype's tolerance; returns the larger error.  A failure names the worst
    element (token, head, element), its got and want values and their ratio."""
    tol = tolerance(case.spec.dtype, options.tolerances)
    rows = np.asarray(rows, np.int64)
    _shape(f"{what}: output", got, want)
    err = relative_l2(got[rows], want[rows])
    if not err <= tol:
        w = worst_element(got, want, rows)
        expect_close(f"{what}: relative L2 error of the output", err, tol,
                     "; ".join(x for x in (describe_worst(w), worst_rows(got, want, rows)) if x),
                     details=w)
    if got_lse is not None:
        _shape(f"{what}: lse", got_lse, want_lse)
        lerr = lse_error(got_lse[rows], want_lse[rows])
        if not lerr <= tol:
            w = worst_element(got_lse, want_lse, rows)
            expect_close(f"{what}: largest lse error", lerr, tol,
                         "; ".join(x for x in (describe_worst(w),
                                               worst_rows(got_lse, want_lse, rows)) if x),
                         details=w)
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
    """Write each layer's K/V and attend, every layer with the same plan: the output and
    lse equal the reference's within tolerance, and attention leaves every cache byte as
    it was.

    ``params`` is an :class:`AttentionCase` (the case's layer only, both ``return_lse``
    modes) or a ``WithExtra`` whose ``return_lse`` (True/False) picks one mode (halving
    the calls to slow backends), ``layers`` the layers in the order they run (one plan for
    all: a plan holds no layer-specific state) and ``out`` whether the backend gets an
    ``out=`` buffer.  When the case has sinks, the layers get per-call sinks that differ
    per layer (the case's layer uses the plan's default); the output must have the query's
    dtype and lse float32.
    """
    case = getattr(params, "case", params)
    extra = getattr(params, "extra", {})
    mode = extra.get("return_lse")
    order = tuple(extra.get("layers") or (case.layer,))
    use_out = bool(extra.get("out", False))
    meta = case.meta
    rows = np.arange(meta.num_actual_tokens)
    b = Runner(backend, case, oracle=False)
    r = Runner(reference, case, oracle=True)
    plan = b.plan(meta)
    r_default = r.plan(meta)
    err = 0.0
    for i, layer in enumerate(order):
        k, v, q = layer_inputs(case, layer)
        sinks = layer_sinks(case, layer) if (case.sinks and layer != case.layer) else None
        what = "attention" if len(order) == 1 else \
            f"attention at layer {layer} (call {i + 1} of {len(order)} with one plan" + \
            (", per-call sinks)" if sinks is not None else ")")
        r.write(r_default, k, v, layer)
        r_plan = r_default if sinks is None else r.plan(meta, sink_values=sinks)
        want, want_lse = r.attend(r_plan, q, layer, lse=True)
        b.write(plan, k, v, layer)
        before = b.planes()
        if mode in (None, False):
            got, _ = b.attend(plan, q, layer, sinks=sinks, out=use_out)
            err = max(err, compare_outputs(what, case, got, want, rows, options))
        if mode in (None, True):
            got2, got_lse = b.attend(plan, q, layer, lse=True, sinks=sinks, out=use_out)
            err = max(err, compare_outputs(what + " with return_lse=True", case, got2, want,
                                           rows, options, got_lse=got_lse,
                                           want_lse=want_lse))
        expect_same_cache(f"{what}: attention must only read the cache", case.layout,
                          case.spec, b.planes(), before)
    return err


def _shape(what, got, want):
    if got.shape != want.shape:
        raise ConformanceFailure(f"{what}: shape {tuple(got.shape)}, expected "
                                 f"{tuple(want.shape)}")


@st.composite
def _attention_params(draw, backend, options):
    case = draw(attention_cases(backend, options, num_layers=(2, 3)))
    order = tuple(draw(st.permutations(range(case.num_layers))))
    return WithExtra(case, {"return_lse": draw(st.booleans()), "layers": order,
                            "out": draw(st.booleans())})


def attention_strategy(backend, options):
    return _attention_params(backend, options)
