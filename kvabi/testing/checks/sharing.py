"""KV sharing: a layer that reads another layer's cache reads exactly it and never writes."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ...transforms import prefill_skip
from ..cases import step_arrays
from ..harness import Runner, expect_same_cache
from ..measure import ConformanceFailure
from ..strategies import kv_sharing_models
from .attention import compare_outputs
from .base import KitOptions, WithExtra, attention_cases, spec_strategy


def check_kv_sharing(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """Run a model's layers in order over one multi-layer cache (one layer per owner).

    Owners write their K/V at their layer index and attend; sharing layers attend over
    their owner's layer without writing (the trailing run of sharing layers with
    ``prefill_skip``).  Every output equals the reference's full computation, attention of a
    sharing layer changes no byte, and the final cache equals the reference's.
    """
    case, model = params.case, params.extra["model"]
    owners = {name: i for i, name in enumerate(model.owners)}
    if case.layout.num_layers != len(owners):
        raise ConformanceFailure("internal: layout layers != owner layers")
    skip = set(model.prefill_skip_layers)
    meta = case.meta
    meta2, tok = prefill_skip(meta)
    b = Runner(backend, case, oracle=False)
    r = Runner(reference, case, oracle=True)
    bplan, rplan = b.plan(meta), r.plan(meta)
    bplan2 = b.plan(meta2) if skip else None
    rows = np.arange(meta.num_actual_tokens)
    worst = 0.0
    for i, layer in enumerate(model.layers):
        li = owners[model.owner(layer.name)]
        k, v, q = step_arrays(case, i, li)
        what = f"layer {layer.name}" + (f" (shares {layer.shares}, cache layer {li})"
                                        if layer.shares else f" (cache layer {li})")
        if layer.shares is None:
            b.write(bplan, k, v, layer=li)
            r.write(rplan, k, v, layer=li)
            got, got_lse = b.attend(bplan, q, li, lse=True)
            want, want_lse = r.attend(rplan, q, li, lse=True)
            worst = max(worst, compare_outputs(what, case, got, want, rows, options,
                                               got_lse=got_lse, want_lse=want_lse))
            continue
        before = b.planes()
        want, want_lse = r.attend(rplan, q, li, lse=True)
        if layer.name in skip:
            got, got_lse = b.attend(bplan2, q[tok], li, lse=True)
            err = compare_outputs(what + " with prefill skip", case, got, want[tok],
                                  np.arange(len(tok)), options, got_lse=got_lse,
                                  want_lse=want_lse[tok])
        else:
            got, got_lse = b.attend(bplan, q, li, lse=True)
            err = compare_outputs(what, case, got, want, rows, options, got_lse=got_lse,
                                  want_lse=want_lse)
        worst = max(worst, err)
        expect_same_cache(f"{what}: a sharing layer must not write", case.layout, case.spec,
                          b.planes(), before)
    expect_same_cache("cache after all layers", case.layout, case.spec, b.planes(), r.planes())
    return worst


@st.composite
def _sharing_params(draw, backend, options):
    spec = draw(spec_strategy(backend, options))
    model = draw(kv_sharing_models(spec, max_layers=4))
    case = draw(attention_cases(backend, options, spec=spec,
                                num_layers=(len(model.owners),)))
    return WithExtra(case, {"model": _ModelRepr(model)})


class _ModelRepr:
    """A ModelKV with a one-line repr for failing examples (attribute access passes on)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __repr__(self):
        return "[" + ", ".join(l.name + (f"->{l.shares}" if l.shares else "")
                               for l in self._model.layers) + "]"


def sharing_strategy(backend, options):
    return _sharing_params(backend, options)
