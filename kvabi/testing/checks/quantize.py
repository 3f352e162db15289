"""``quantize``: every quantization a backend claims, at every boundary of its recipe
(``specs/semantics.md`` section 11.1), byte for byte.

Each example is a batch, block size, heads, head dim and layer; for every (dtype, quant,
rounding) the backend claims for the example's kind (narrowed by the options) it takes one
of the backend's preferred layouts, and writes the step through the backend and the
reference into the same poisoned cache, with keys and values on the recipe's boundaries
(:mod:`kvabi.testing.boundaries`): ties and one ulp either side, values a division by the
scale codes differently, saturation edges, signed zeros, e4m3's subnormal grid, rows whose
scale sits on its own rounding boundary or its 1e-6 floor.  A ``per_tensor`` cache is
written under two pairs of static scales (keys and values: two generic ones, then one with
a subnormal reciprocal and the smallest normal float32); a step with fewer places than
values is written again with the next ones.  A wrong code or scale is reported with its
input, the scale, the exact recipe's result and the known mistakes that store what the
backend stored.
"""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from ...layout.descriptor import Layout
from ...util.errors import KVABIError
from ..boundaries import (code_alternatives, head_rows, matching, reciprocal, row_scale,
                          scale_alternatives, tensor_scales, tensor_values)
from ..harness import Runner, StepData, _handle, cache_difference
from ..measure import ConformanceFailure
from .base import (KitOptions, NotApplicable, WithExtra, attention_cases, claimed,
                   preferred_layouts, spec_strategy, supported)

QUANTIZED = ("per_tensor", "per_token_head")


def check_quantize(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """For every claimed quantization of ``params.extra["combos"]`` ((dtype, quant,
    rounding, layout name)), boundary keys and values written by the backend equal the
    reference's write byte for byte (codes and stored scales)."""
    case = params.case
    for i, (dtype, quant, rounding, name) in enumerate(params.extra["combos"]):
        spec = attrs.evolve(case.spec, dtype=dtype, quant=quant, rounding=rounding)
        layout = Layout.preset(name, spec, case.layout.num_blocks, case.num_layers)
        base = case.with_(spec=spec, layout=layout)
        rng = np.random.default_rng([case.seed, 0x0B0D, i])
        if quant == "per_tensor":
            sc = tensor_scales(dtype, rounding, rng)
            for k_s, v_s in ((sc[0], sc[1]), (sc[3], sc[2])):
                c = base.with_(static_scales=(k_s, v_s))
                _write(backend, reference, c, tensor_values(dtype, rounding, k_s, rng),
                       None if spec.is_mla else tensor_values(dtype, rounding, v_s, rng))
        else:
            _write(backend, reference, base, head_rows(dtype, rounding, spec.head_dim, rng),
                   head_rows(dtype, rounding, spec.head_dim_v, rng))
    return 0.0


def _fill(step, values, start: int, rows: bool):
    """``step`` [T', H, D] (the real tokens' rows) filled from ``values`` (elements, or
    ``rows`` [R, D]) from ``start`` on, wrapping round; returns (array, next start)."""
    out = np.array(step, np.float32)
    flat = out.reshape(-1, out.shape[-1]) if rows else out.reshape(-1)
    n = flat.shape[0]
    idx = (start + np.arange(n)) % len(values)
    flat[...] = values[idx]
    return out, start + n


def _write(backend, reference, case, kx, vx) -> None:
    """Write ``case``'s step with its real tokens' keys from ``kx`` and values from ``vx``
    (per_tensor: elements; per_token_head: rows) through both sides, as many times as it
    takes to write every one; compare the caches after each write."""
    spec = case.spec
    rows = spec.quant == "per_token_head"
    slots = case.meta.slot_mapping
    real = np.flatnonzero(slots >= 0)
    b = Runner(backend, case, oracle=False)
    r = Runner(reference, case, oracle=True)
    plan_b, plan_r = b.plan(case.meta), r.plan(case.meta)
    _same("the cache before the step", case, b, r, None, None)
    i = case.inputs()
    k, v = np.array(i.key, np.float32), None if i.value is None else \
        np.array(i.value, np.float32)
    if not real.size:
        return
    ks = vs = 0
    while ks < len(kx) or (vx is not None and vs < len(vx)):
        k[real], ks = _fill(k[real], kx, ks, rows)
        if vx is not None:
            v[real], vs = _fill(v[real], vx, vs, rows)
        b.write(plan_b, k, v)
        r.write(plan_r, k, v)
        _same(f"write_kv(layer={case.layer})", case, b, r, k, v)


def _same(what, case, b, r, k, v) -> None:
    got, want = b.planes(), r.planes()
    d = cache_difference(case.layout, case.spec, got, want,
                         None if k is None else StepData(k, v, case.meta.slot_mapping,
                                                         case.layer, case.scales()))
    if d is None:
        return
    text, details = d
    s = case.spec
    sc = ", ".join(f"{n} {x!r}" for n, x in case.scales().items())
    head = f"quantize {s.dtype} {s.quant} {s.rounding} in {case.layout.name}" + \
        (f" ({sc})" if sc else "")
    if k is not None:
        why = _explain(case, got, want, case.layer, case.meta.slot_mapping, k, v)
    else:  # the backend wrote the starting cache itself (a layout the kit cannot fill)
        i = case.inputs()
        slots = np.arange(case.layout.num_blocks * s.block_size)
        why = next((w for w in (_explain(case, got, want, layer, slots, i.pool_k[layer],
                                         None if i.pool_v is None else i.pool_v[layer])
                                for layer in range(case.num_layers)) if w), "")
    raise ConformanceFailure(f"{head}: {what}: cache bytes differ from the reference: "
                             f"{why}{text}", details)


def _explain(case, got, want, layer, slot_mapping, k, v) -> str:
    """The first wrong code or scale of rows ``k``/``v`` written at ``slot_mapping`` of
    ``layer``: its input, scale, the exact recipe's result and the known mistakes that give
    what the backend stored."""
    spec = case.spec
    gh, wh = _handle(case.layout, got), _handle(case.layout, want)
    slots = np.asarray(slot_mapping, np.int64)
    real = np.flatnonzero(slots >= 0)
    bs = spec.block_size
    blk, off = slots[real] // bs, slots[real] % bs
    names = ("key", "value") if case.layout.has_kv else ("latent",)
    for kv, (name, x) in enumerate(zip(names, (k, v))):
        if x is None:
            continue
        x = np.asarray(x, np.float32)[real]
        width = x.shape[-1]
        g = gh.kv_view(layer, kv)[blk, off][..., :width]
        w = wh.kv_view(layer, kv)[blk, off][..., :width]
        at = f"{name} of layer {layer} slot"
        if spec.quant == "per_token_head":
            sname = f"{'key' if kv == 0 else 'value'}_scale"
            gs = np.asarray(gh.component_view(layer, sname)[blk, off, :, 0], np.float32)
            ws = np.asarray(wh.component_view(layer, sname)[blk, off, :, 0], np.float32)
            bad = np.argwhere(gs.view(np.uint32) != ws.view(np.uint32))
            if bad.size:
                t, h = (int(a) for a in bad[0])
                alt = matching(scale_alternatives(x[t, h], spec.dtype, x[t]), gs[t, h])
                return (f"{at} {int(slots[real[t]])} head {h}: stored scale "
                        f"{float(gs[t, h])!r}, want {float(ws[t, h])!r} = max(fl32(absmax / "
                        f"QMAX), 1e-6) of absmax {float(np.max(np.abs(x[t, h])))!r}"
                        f"{_named(alt)}. ")
        gb = np.ascontiguousarray(g).view(np.uint8).reshape(g.shape)
        wb = np.ascontiguousarray(w).view(np.uint8).reshape(w.shape)
        bad = np.argwhere(gb != wb)
        if not bad.size:
            continue
        t, h, e = (int(a) for a in bad[0])
        if spec.quant == "per_token_head":
            s = float(row_scale(np.max(np.abs(x[t, h])), spec.dtype))
            row = None
        else:
            s = case.scales(layer)["k_scale" if kv == 0 else "v_scale"]
            row = x[t, h]
        xe = np.float32(x[t, h, e])
        y = np.float32(xe * reciprocal(s))
        alt = matching(code_alternatives(xe, s, spec.dtype, spec.rounding, row),
                       g[t, h, e])
        return (f"{at} {int(slots[real[t]])} head {h} element {e}: input {float(xe)!r}, "
                f"scale {s!r}, y = fl32(x * fl32(1 / s)) = {float(y)!r}: want code "
                f"{_code(w[t, h, e])} ({spec.rounding}), got {_code(g[t, h, e])}"
                f"{_named(alt)}. ")
    return ""


def _code(c) -> str:
    v = float(np.asarray(c).astype(np.float64))
    return f"{v!r}" if v != 0 else ("-0.0" if np.signbit(v) else "0.0")


def _named(alt) -> str:
    return f", what {' or '.join(alt)} gives" if alt else \
        ", which no known mistake gives"


#: head dims at least this wide are drawn where the backend claims one (rows hold their
#: targets in fewer writes)
WIDE = 16


@st.composite
def _params(draw, backend, options, specs):
    # one or two requests of up to 32 tokens: the values fit in a write or two
    case = draw(attention_cases(backend, options, specs=specs, softcap=False, sinks=False,
                                max_reqs=2, max_query_len=32, empty_requests=False))
    nb, nl = case.layout.num_blocks, case.num_layers
    combos = []
    for dtype, quant, rounding in claimed(backend, options, kind=case.spec.kind):
        if quant == "none":
            continue
        try:
            spec = attrs.evolve(case.spec, dtype=dtype, quant=quant, rounding=rounding)
        except KVABIError:
            continue
        if not supported(backend, spec, options):
            continue
        names = [lay.name for lay in preferred_layouts(backend, spec, nb, nl)]
        if names:  # none: check_layouts reports a backend that prefers nothing usable
            combos.append((dtype, quant, rounding, draw(st.sampled_from(names))))
    return WithExtra(case, {"combos": tuple(combos)})


def quantize_strategy(backend, options):
    if not any(q != "none" for _, q, _ in claimed(backend, options)):
        caps = backend.capabilities(None)
        narrowed = any(x is not None for x in (options.dtypes, options.quants,
                                                options.roundings))
        raise NotApplicable(f"quantize needs a quantized cache; {backend.name} claims quant "
                            f"{', '.join(caps.quant)} for {', '.join(caps.dtypes)}"
                            + (" and the dtype/quant/rounding options leave none"
                               if narrowed else ""))
    dims = backend.capabilities(None).head_dims
    wide = tuple(d for d in (dims if dims is not None else (16, 32)) if d >= WIDE
                 and (options.head_dims is None or d in options.head_dims))
    narrowed = attrs.evolve(options, head_dims=wide) if wide else options
    return _params(backend, options, spec_strategy(backend, narrowed, quants=QUANTIZED))
