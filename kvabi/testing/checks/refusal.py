"""Specs outside a backend's capabilities are refused with a KVABIError, never computed
wrong."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ...model.spec import KINDS
from ...util.dtypes import DTYPES
from ...util.errors import KVABIError
from ..measure import ConformanceFailure, expect_close, lse_error, relative_l2, tolerance
from ..strategies import SMALL_BLOCK_SIZES, SMALL_HEAD_DIMS, kv_specs, preset_layouts_for
from .attention import reference_step
from .base import KitOptions, NotApplicable, Refused, WithExtra, attention_cases, step_or_refusal

#: head dims and block sizes tried when a backend restricts them
ODD_HEAD_DIMS = SMALL_HEAD_DIMS + (12, 24, 40, 48, 64, 72, 96, 128)
ODD_BLOCK_SIZES = SMALL_BLOCK_SIZES + (3, 5, 12, 24, 32)


def violations(caps) -> list[str]:
    """The ways a spec can fall outside ``caps``."""
    out = []
    if set(KINDS) - set(caps.kinds):
        out.append("kind")
    if set(DTYPES) - set(caps.dtypes):
        out.append("dtype")
    if caps.head_dims is not None:
        out.append("head_dim")
    if caps.block_sizes is not None or caps.block_size_multiple > 1:
        out.append("block_size")
    if not caps.softcap:
        out.append("softcap")
    if not caps.sinks:
        out.append("sinks")
    return out


@st.composite
def _unsupported_params(draw, backend, options):
    caps = backend.capabilities(None)
    which = draw(st.sampled_from(violations(caps)))
    kinds = [k for k in KINDS if k not in caps.kinds] if which == "kind" else caps.kinds
    dtypes = [d for d in DTYPES if d not in caps.dtypes] if which == "dtype" else caps.dtypes
    dims = caps.head_dims
    if which == "head_dim":
        dims = [d for d in ODD_HEAD_DIMS if d not in caps.head_dims]
    sizes = caps.block_sizes
    multiple = caps.block_size_multiple
    if which == "block_size":
        sizes = [b for b in ODD_BLOCK_SIZES
                 if (caps.block_sizes is not None and b not in caps.block_sizes)
                 or b % caps.block_size_multiple]
        multiple = 1
    spec = draw(kv_specs(kinds, dtypes, dims, sizes, block_size_multiple=multiple))
    softcap = 2.0 if which == "softcap" else None
    sinks = which == "sinks"
    why = backend.capabilities(spec).refusals(spec, softcap=softcap,
                                               sinks=True if sinks else None)
    from hypothesis import assume

    assume(why)
    case = draw(attention_cases(backend, options, spec=spec, softcap=False, sinks=False,
                                layouts="random", num_layers=(1,)))
    # A layout that holds the spec: the backend's preferred one when it names any.
    try:
        names = backend.preferred_layouts(spec)
    except KVABIError:
        names = None
    built = preset_layouts_for(spec, case.meta.num_blocks, 1, names) or \
        preset_layouts_for(spec, case.meta.num_blocks, 1)
    if built:
        case = case.with_(layout=draw(st.sampled_from(built)), layer=0)
    case = case.with_(softcap=softcap, sinks=sinks)
    return WithExtra(case, {"violates": which, "reason": why})


def unsupported_strategy(backend, options):
    if not violations(backend.capabilities(None)):
        raise NotApplicable("the backend claims every kind, dtype, size, soft cap and sinks")
    return _unsupported_params(backend, options)


def check_unsupported(backend, reference, params, options: KitOptions = KitOptions()
                      ) -> float:
    """A spec (or soft cap / sinks) the capabilities exclude: ``check_supported`` raises
    UnsupportedError naming every reason the capabilities give, and plan/write_kv/attention
    raise a KVABIError, or else compute the reference's result (capabilities may
    understate); anything else fails."""
    case, reasons = params.case, params.extra["reason"]
    why = "; ".join(reasons)
    try:
        backend.check_supported(case.spec, softcap=case.softcap,
                                sinks=True if case.sinks else None)
    except KVABIError as e:
        missing = [r for r in reasons if r not in str(e)]
        if missing:
            raise ConformanceFailure(f"check_supported refused, but its message does not "
                                     f"name every reason ({'; '.join(missing)}): {e}") from e
    else:
        raise ConformanceFailure(f"check_supported accepted a spec its capabilities "
                                 f"exclude ({why})")
    result = step_or_refusal(backend, case, f"unsupported spec ({why})")
    if isinstance(result, Refused):
        return result
    got, got_lse, _ = result
    _, want, want_lse = reference_step(reference, case)
    rows = np.arange(case.meta.num_actual_tokens)
    tol = tolerance(case.spec.dtype, options.tolerances)
    if got.shape != want.shape:
        raise ConformanceFailure(f"unsupported spec ({why}) computed an output of shape "
                                 f"{got.shape} instead of refusing")
    err = max(relative_l2(got[rows], want[rows]), lse_error(got_lse[rows], want_lse[rows]))
    expect_close(f"unsupported spec ({why}) computed instead of refused, and wrong", err, tol)
    return err
