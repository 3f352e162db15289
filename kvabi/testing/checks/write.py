"""write_kv writes exactly the slots of the batch, byte for byte as the reference."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ...memory.cache import KVCache
from ...transforms import kv_update_slices
from ..harness import Runner, StepData, copy_planes, expect_same_cache, put_rows, step_inputs
from ..measure import ConformanceFailure
from .base import KitOptions, WithExtra, attention_cases


def check_write_kv(backend, reference, case, options: KitOptions = KitOptions()) -> float:
    """Poison the cache, fill it, write the step: every plane byte equals the reference's.

    Catches writes to wrong slots, to padding tokens (slot -1), to other layers, into
    padding bytes of the layout, and values changed on the way in.
    """
    b = Runner(backend, case, oracle=False)
    r = Runner(reference, case, oracle=True)
    expect_same_cache("cache before the step (poisoned, every slot filled)", case.layout,
                      case.spec, b.planes(), r.planes())
    k, v, _ = step_inputs(case)
    b.write(b.plan(case.meta), k, v)
    r.write(r.plan(case.meta), k, v)
    written = case.meta.slot_mapping[case.meta.slot_mapping >= 0]
    expect_same_cache(f"write_kv(layer={case.layer})", case.layout, case.spec, b.planes(),
                      r.planes(), written=written,
                      step=StepData(k, v, case.meta.slot_mapping, case.layer,
                                    case.scales()))
    return 0.0


def write_strategy(backend, options):
    return attention_cases(backend, options)


def apply_update_slices(layout, spec, planes, slices, num_slices, key, value, layer,
                        scales=None):
    """Copy K/V rows into numpy planes as the Pallas update slices say (an independent
    application: each row copies ``length`` consecutive tokens to consecutive slots;
    a quantized spec's rows as codes under the layer's static ``scales``)."""
    start, src, length = (slices[i, :num_slices].astype(np.int64) for i in range(3))
    bs = spec.block_size
    if num_slices and ((start % bs) + length > bs).any():
        i = int(np.argmax((start % bs) + length > bs))
        raise ConformanceFailure(f"kv_update_slices: slice {i} crosses a page: cache_start "
                                 f"{int(start[i])}, length {int(length[i])}, block_size {bs}")
    if (slices[2, num_slices:] != 0).any():
        raise ConformanceFailure("kv_update_slices: padding rows must have length 0")
    owner = np.repeat(np.arange(num_slices), length)
    within = np.arange(len(owner)) - np.repeat(np.cumsum(length) - length, length)
    dst = start[owner] + within
    tok = src[owner] + within
    handle = KVCache.wrap(layout, planes)
    for kv, x in enumerate((key, value)):
        if x is not None:
            put_rows(handle, spec, layer, kv, dst, x[tok], scales or {})


def check_kv_update_slices(backend, reference, params, options: KitOptions = KitOptions()
                           ) -> float:
    """``kv_update_slices`` applied to the poisoned cache equals the backend's write_kv
    (and so the slot mapping): the Pallas update input and every backend agree."""
    case, per = params.case, params.extra["num_slices_per_block"]
    b = Runner(backend, case, oracle=False)
    r = Runner(reference, case, oracle=True)
    want = copy_planes(case.layout, r.planes())
    k, v, _ = step_inputs(case)
    slices, n = kv_update_slices(case.meta, per)
    if slices.shape[1] % per or slices.shape[1] < n:
        raise ConformanceFailure(f"kv_update_slices: {slices.shape[1]} rows is not a multiple "
                                 f"of {per} holding {n} slices")
    apply_update_slices(case.layout, case.spec, want, slices, n, k, v, case.layer,
                        case.scales())
    r.write(r.plan(case.meta), k, v)
    expect_same_cache("kv_update_slices applied vs the slot mapping", case.layout, case.spec,
                      want, r.planes())
    b.write(b.plan(case.meta), k, v)
    expect_same_cache("write_kv vs kv_update_slices applied", case.layout, case.spec,
                      b.planes(), want, step=StepData(k, v, case.meta.slot_mapping, case.layer,
                                                      case.scales()))
    return 0.0


@st.composite
def update_slices_strategy_(draw, backend, options):
    case = draw(attention_cases(backend, options))
    per = draw(st.sampled_from((1, 2, 8)))
    return WithExtra(case, {"num_slices_per_block": per})


def update_slices_strategy(backend, options):
    return update_slices_strategy_(backend, options)
