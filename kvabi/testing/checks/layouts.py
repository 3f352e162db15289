"""Layouts: the ones a backend prefers are byte-exact through it and survive JSON; any
other layout is either computed right or refused with a KVABIError."""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from ...layout.descriptor import Layout
from ...util.dtypes import numpy_dtype
from ...util.errors import KVABIError
from ..cases import exact_values, input_dtype, stored
from ..harness import (UINT, StepData, expect_same_cache, fill_meta, in_framework, raw_items,
                       step_inputs, take_cache, to_planes)
from ..measure import ConformanceFailure
from .attention import compare_outputs, reference_step
from .base import KitOptions, Refused, attention_cases, spec_strategy, step_or_refusal


@attrs.frozen
class LayoutParams:
    """A spec and pool size whose preferred layouts are checked; ``layer`` is written."""

    spec: object
    num_blocks: int
    num_layers: int
    layer: int
    seed: int


def _json_round_trip(layout: Layout) -> Layout:
    back = Layout.from_json(layout.to_json())
    if back != layout:
        raise ConformanceFailure(f"layout {layout.name}: JSON round trip changed it:\n"
                                 f"  {layout.to_dict()}\n  {back.to_dict()}")
    all_blocks = np.arange(layout.num_blocks)
    if back.block_regions(all_blocks) != layout.block_regions(all_blocks):
        raise ConformanceFailure(f"layout {layout.name}: block regions differ after JSON")
    return back


def _expected_elements(layout, spec, pool_k, pool_v, layer):
    """(plane, item index, expected bits) of every logical element of every layer (a
    quantized cache: the codes of a write with unit static scales, and a per_token_head
    cache's scales, byte by byte)."""
    grids = np.meshgrid(np.arange(layout.num_layers), np.arange(layout.num_blocks),
                        np.arange(layout.size("KV")), np.arange(spec.block_size),
                        np.arange(spec.num_kv_heads), np.arange(spec.head_dim), indexing="ij")
    ll, bb, kk, nn, hh, dd = (g.ravel() for g in grids)
    plane, off = layout.byte_offset(layer=ll, block=bb, kv=kk, token=nn, head=hh, dim=dd)
    dt = numpy_dtype(spec.dtype)
    slot = bb * spec.block_size + nn
    want = np.zeros(len(ll), dt)
    unit = {"k_scale": 1.0, "v_scale": 1.0}
    planes, items, wants = [np.broadcast_to(plane, off.shape)], [off // layout.itemsize], []
    for kv, pool in enumerate((pool_k, pool_v)):
        if pool is None:
            continue
        codes, rows = stored(spec, pool, kv, unit)
        sel = (ll == layer) & (kk == kv)  # presets hold K and V of equal width
        want[sel] = codes[slot[sel], hh[sel], dd[sel]]
        if rows is None:
            continue
        # per_token_head: the row scales' bytes (quantized dtypes are one byte an item)
        g = np.meshgrid(np.arange(layout.num_blocks), np.arange(spec.block_size),
                        np.arange(spec.num_kv_heads), np.arange(4), indexing="ij")
        b2, n2, h2, byte = (x.ravel() for x in g)
        p2, o2 = layout.element_offset(("key_scale", "value_scale")[kv], layer=layer,
                                       block=b2, token=n2, head=h2)
        planes.append(np.broadcast_to(p2, o2.shape))
        items.append(o2 + byte)
        wants.append(np.ascontiguousarray(rows).view(np.uint8).reshape(
            -1, spec.num_kv_heads, 4)[b2 * spec.block_size + n2, h2, byte])
    u = UINT[layout.itemsize]
    bits = np.concatenate([want.view(u)] + [w.astype(u) for w in wants])
    return np.concatenate(planes), np.concatenate(items), bits


def check_layouts(backend, reference, params, options: KitOptions = KitOptions()) -> float:
    """Every layout the backend prefers for a spec it claims: the preset holds the spec,
    survives a JSON round trip unchanged, ``allocate`` gives zeroed planes of the layout's
    shape, and a pattern written through the backend (using the round-tripped descriptor)
    lands at exactly ``Layout.byte_offset`` of every element, all other bytes untouched."""
    spec = params.spec
    names = backend.preferred_layouts(spec)
    if not names:
        raise ConformanceFailure(f"preferred_layouts({spec}) is empty for a spec the backend "
                                 f"claims")
    for name in names:
        try:
            layout = Layout.preset(name, spec, params.num_blocks, params.num_layers)
        except KVABIError as e:
            raise ConformanceFailure(f"prefers layout {name!r}, which cannot hold {spec}: "
                                     f"{e}") from e
        back = _json_round_trip(layout)
        cache = take_cache(back, backend.allocate(back), f"allocate({name})")
        zero = to_planes(back, cache)
        for i, p in enumerate(zero):
            if p.view(UINT[back.itemsize]).any():
                raise ConformanceFailure(f"layout {name}: allocate() plane {i} is not zeroed")
        rng = np.random.default_rng(params.seed)
        slots = back.num_blocks * spec.block_size
        dt = input_dtype(spec.dtype)
        pool_k = exact_values(rng, (slots, spec.num_kv_heads, spec.head_dim),
                              spec.dtype).astype(dt)
        pool_v = None if spec.is_mla else exact_values(
            rng, (slots, spec.num_kv_heads, spec.head_dim_v), spec.dtype).astype(dt)
        meta = fill_meta(back, spec.block_size)
        plan = backend.plan(meta, spec, back, num_q_heads=spec.num_kv_heads)
        cache = take_cache(back, backend.write_kv(
            plan, cache, key=in_framework(backend, pool_k),
            value=in_framework(backend, pool_v), layer=params.layer), "write_kv")
        planes = to_planes(back, cache)
        raws = [raw_items(back, p) for p in planes]  # component planes may differ in size
        width = max(len(r) for r in raws)
        raw = np.stack([np.pad(r, (0, width - len(r))) for r in raws])
        plane, item, want = _expected_elements(layout, spec, pool_k, pool_v, params.layer)
        got = raw[plane, item]
        bad = np.nonzero(got != want)[0]
        if len(bad):
            raise ConformanceFailure(
                f"layout {name}: {len(bad)} element(s) not at Layout.byte_offset after "
                f"writing layer {params.layer}; first at byte offset "
                f"{int(item[bad[0]]) * back.itemsize} of plane {int(plane[bad[0]])}")
        # Padding bytes between elements must stay zero.
        mask = np.zeros(raw.shape, bool)
        mask[plane, item] = True
        if raw[~mask].any():
            raise ConformanceFailure(f"layout {name}: write_kv changed padding bytes")
    return 0.0


@st.composite
def _layout_params(draw, backend, options):
    spec = draw(spec_strategy(backend, options))
    nl = draw(st.integers(1, 2))
    return LayoutParams(spec, draw(st.integers(1, 4)), nl, draw(st.integers(0, nl - 1)),
                        draw(st.integers(0, 2**32 - 1)))


def layouts_strategy(backend, options):
    return _layout_params(backend, options)


def check_foreign_layouts(backend, reference, case, options: KitOptions = KitOptions()
                          ) -> float:
    """A random layout (not necessarily preferred) is either refused with a KVABIError
    or written and attended exactly as the reference does."""
    result = step_or_refusal(backend, case, "layout")
    if isinstance(result, Refused):
        return result
    got, got_lse, planes = result
    r, want, want_lse = reference_step(reference, case)
    k, v, _ = step_inputs(case)
    expect_same_cache("write_kv in a non-preferred layout", case.layout, case.spec, planes,
                      r.planes(), step=StepData(k, v, case.meta.slot_mapping, case.layer,
                                                case.scales()))
    rows = np.arange(case.meta.num_actual_tokens)
    return compare_outputs("attention in a non-preferred layout", case, got, want, rows,
                           options, got_lse=got_lse, want_lse=want_lse)


def foreign_layouts_strategy(backend, options):
    return attention_cases(backend, options, layouts="random")
