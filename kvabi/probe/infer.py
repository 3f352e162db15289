"""``infer_layout``: find the layout an engine's cache write really produces.

One round of marked writes (more for 8-bit dtypes) into poisoned planes, one scan of the
planes' bytes, then a fit:

1. which plane each (layer, kv) went to gives the plane axes (none, ``L``, ``KV``, or
   both in either order: planes are numbered row-major, keys first);
2. inside a plane, the byte offset of index 1 of each axis (from the element with every
   index 0, which must sit at byte 0) gives that axis' stride; every other probed element
   must then sit exactly at the sum of its indices times the strides (an affine placement:
   anything else, a tiled or swizzled order, is not a layout);
3. strides sorted give the memory order; they must nest (each axis steps over the whole
   of the next), and the gaps they leave are padding;
4. the result is the preset that places every element identically, when one does, else a
   custom layout with explicit strides; it is then checked on a fresh random sample
   (:func:`.verify.check_marked`).

Rows probed: layers 0, 1 and the last; tokens (block, token) (0, 0), (0, 1), (1, 0), the
last slot and two random slots.  Axes of size 1 have no stride that matters: they are put
innermost (a preset that matches is preferred anyway).
"""
from __future__ import annotations

import attrs
import numpy as np

from ..layout.component import Component
from ..layout.descriptor import Layout
from ..layout.presets import preset_names
from ..util.dtypes import itemsize
from ..util.errors import KVABIError
from .compare import placement_difference
from .markers import Alphabet
from .marking import Geometry, Marked, gather, read_ids, scan
from .verify import check_marked, probe_arguments, sample_rows

_PLANE_CHOICES = ((), ("L",), ("KV",), ("L", "KV"), ("KV", "L"))


def _discovery_rows(geo: Geometry, rng) -> Marked:
    layers = sorted({0, min(1, geo.num_layers - 1), geo.num_layers - 1})
    toks = [(0, 0), (0, 1), (1, 0), (geo.num_blocks - 1, geo.block_size - 1)]
    toks += [(int(rng.integers(geo.num_blocks)), int(rng.integers(geo.block_size)))
             for _ in range(2)]
    toks = sorted({(b, n) for b, n in toks if b < geo.num_blocks and n < geo.block_size})
    grid = [(l, b, n) for l in layers for b, n in toks]
    arr = np.array(grid, np.int64)
    return Marked(geo, arr[:, 0], arr[:, 1], arr[:, 2])


def infer_layout(spec, planes, write, *, num_blocks: int, num_layers: int = 1,
                 samples: int = 8, seed: int = 0) -> Layout:
    """The layout ``write`` really produces in ``planes``.

    ``planes``: the engine's own tensors (numpy arrays or torch tensors, any shape and
    dtype: only their bytes are read, so a flat buffer works as well as a 4-D tensor).
    ``write(layer, slot_mapping, key, value)``: the engine's cache write (numpy key/value
    [tokens, kv_heads, head_dim] in the spec's dtype, value None for MLA; int64 slots).
    The planes are overwritten (poison, then markers): probe a fresh cache.

    Returns the preset that places every element as the engine does, when one does, else a
    custom :class:`~kvabi.Layout` (explicit strides, planes, plane bytes).  Raises
    KVABIError saying what was seen when the placement is ambiguous (two elements at the
    same bytes), not a layout (not affine, strides that interleave, elements before a
    plane's first byte), or when the fitted layout fails the check on a fresh sample.
    """
    geo = Geometry.of_spec(spec, num_blocks, num_layers)
    samples, seed, mem = probe_arguments(planes, write, samples, seed)
    isz = spec.itemsize
    for m in mem:
        m.fill()
    rows = _discovery_rows(geo, np.random.default_rng(seed))
    alphabet = Alphabet.of(geo.dtype)
    n = rows.count
    found_p = found_o = None
    words = []
    for r in range(alphabet.rounds(n)):
        rows.write_round(write, alphabet, r)
        if found_p is None:
            found_p, found_o = scan(mem, isz, [(i, 0, m.nbytes) for i, m in enumerate(mem)],
                                    n)
        words.append(gather(mem, found_p, found_o, isz))
    ids = read_ids(alphabet, words)
    place_p, place_o = _placements(rows, ids, found_p, found_o, n)
    layout = _fit(geo, rows, place_p, place_o, len(mem), min(m.nbytes for m in mem))
    layout = _named(layout, spec, geo)
    check = sample_rows(geo, samples, seed + 1, avoid=zip(rows.layer, rows.block *
                                                          geo.block_size + rows.token))
    try:
        check_marked(layout, mem, write, check, layout.name or "the inferred layout")
    except KVABIError as e:
        raise KVABIError(f"infer_layout: the placement fitted from the probed tokens fails on "
                         f"a fresh sample (the write is not one layout): {e}") from None
    return layout


def _placements(rows: Marked, ids, found_p, found_o, n):
    """(plane, offset) of every element id; KVABIError for foreign values, elements found
    twice, or never found."""
    foreign = np.flatnonzero(ids < 0)
    if len(foreign):
        k = int(foreign[0])
        raise KVABIError(f"write: plane {int(found_p[k])}, byte {int(found_o[k])} changed to "
                         f"a value kvabi never wrote (the write converts values, or writes "
                         f"outside the slots it was given)")
    order = np.argsort(ids, kind="stable")
    ids_s = ids[order]
    dup = np.flatnonzero(ids_s[1:] == ids_s[:-1])
    if len(dup):
        a, b = order[dup[0]], order[dup[0] + 1]
        raise KVABIError(f"{rows.name(int(ids[a]))} was found at two places (plane "
                         f"{int(found_p[a])} byte {int(found_o[a])}, plane {int(found_p[b])} "
                         f"byte {int(found_o[b])}); a layout places each element once")
    if len(ids) < n:
        missing = np.setdiff1d(np.arange(n), ids)
        raise KVABIError(f"{rows.name(int(missing[0]))} was written but found nowhere: "
                         f"the write dropped it, or another element landed on the same "
                         f"bytes (axes the writes cannot tell apart)")
    place_p = np.empty(n, np.int64)
    place_o = np.empty(n, np.int64)
    place_p[ids] = found_p
    place_o[ids] = found_o
    return place_p, place_o


def _plane_axes(geo: Geometry, rows: Marked, place_p, nplanes: int):
    c = rows.coords(np.arange(rows.count))
    keys = np.stack([c["layer"], c["kv"]], 1)
    pairs, first = np.unique(keys, axis=0, return_index=True)
    for (layer, kv), i in zip(pairs, first):
        sel = (c["layer"] == layer) & (c["kv"] == kv)
        got = np.unique(place_p[sel])
        if len(got) > 1:
            what = "latent" if geo.kvs == 1 else ("keys", "values")[kv]
            raise KVABIError(f"planes: the {what} of layer {layer} went to several planes "
                             f"{got.tolist()}; a layout keeps a layer's keys (or values) in "
                             f"one plane")
    seen = {(int(l), int(k)): int(place_p[i]) for (l, k), i in zip(pairs, first)}
    size = {"L": geo.num_layers, "KV": geo.kvs}
    for cand in _PLANE_CHOICES:
        if "KV" in cand and geo.kvs == 1:
            continue
        if int(np.prod([size[a] for a in cand])) != nplanes:
            continue
        if all(_plane_no(cand, size, l, k) == p for (l, k), p in seen.items()):
            return cand
    shown = ", ".join(f"(layer {l}, kv {k}) -> {p}" for (l, k), p in sorted(seen.items()))
    raise KVABIError(f"planes: {nplanes} tensors, and the writes went {shown}; a layout "
                     f"numbers planes row-major over L and KV (keys first), which no choice "
                     f"of plane axes matches")


def _plane_no(axes, size, layer, kv):
    p = 0
    for a in axes:
        p = p * size[a] + (layer if a == "L" else kv)
    return p


def _fit(geo: Geometry, rows: Marked, place_p, place_o, nplanes: int,
         plane_nbytes: int) -> Layout:
    c = rows.coords(np.arange(rows.count))

    def element(**idx):  # id of the probed element with these indices (others 0)
        want = {"layer": 0, "block": 0, "kv": 0, "token": 0, "head": 0, "dim": 0, **idx}
        sel = np.ones(rows.count, bool)
        for k, v in want.items():
            sel &= c[k] == v
        return int(np.flatnonzero(sel)[0])

    origin = element()
    if place_o[origin] != 0:
        raise KVABIError(f"{rows.name(origin)} (every index 0) sits at byte "
                         f"{int(place_o[origin])} of plane {int(place_p[origin])}; a layout "
                         f"puts it at byte 0 (the plane's first element)")
    fits = [_component_fit(geo, rows, c, place_p, place_o, element, kv)
            for kv in range(geo.kvs)]
    if geo.kvs == 2 and _steps_of(fits[0]) != _steps_of(fits[1]):
        # keys and values step differently (e.g. keys dim-major, values token-major):
        # two components, each placed on its own
        return _component_layout(geo, fits, plane_nbytes)
    planes = _plane_axes(geo, rows, place_p, nplanes)
    isz = itemsize(geo.dtype)
    size = {"L": geo.num_layers, "B": geo.num_blocks, "KV": geo.kvs, "N": geo.block_size,
            "H": geo.num_heads, "D": geo.head_dim}
    inplane = [a for a in ("L", "B", "KV", "N", "H", "D")
               if a not in planes and not (a == "KV" and geo.kvs == 1)
               and not (a == "L" and geo.num_layers == 1)]
    arg = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim"}
    stride = {a: fits[0]["strides"][a] for a in inplane if a in fits[0]["strides"]}
    if "KV" in inplane:
        s = int(place_o[element(kv=1)]) - int(place_o[origin])
        if s <= 0 or s % isz:
            raise KVABIError(f"KV: index 1 sits {s} bytes from index 0; a layout's strides "
                             f"are positive multiples of the itemsize {isz}")
        stride["KV"] = s
    pred = sum(c[arg[a]] * s for a, s in stride.items())
    off = np.flatnonzero(pred != place_o)
    if len(off):
        i = int(off[0])
        raise KVABIError(f"{rows.name(i)} sits at byte {int(place_o[i])}, but strides "
                         f"{stride} (from index 1 of each axis) put it at byte "
                         f"{int(pred[i])}: the placement is not affine, which no layout "
                         f"expresses (a tiled or split axis?)")
    order = sorted(stride, key=lambda a: -stride[a])
    for outer, inner in zip(order, order[1:]):
        if stride[outer] < size[inner] * stride[inner]:
            raise KVABIError(f"{outer}: steps {stride[outer]} bytes, inside the "
                             f"{size[inner]} x {stride[inner]} bytes of axis {inner}: the "
                             f"axes interleave, which no layout expresses")
    for a in inplane:  # size-1 axes: any place works; innermost, one element apart
        if a not in stride:
            order.append(a)
            stride[a] = isz
    sizes = {a: size[a] for a in list(planes) + order}
    kw = dict(order=tuple(order), sizes=sizes, dtype=geo.dtype, planes=planes)
    dense = Layout(**kw)
    if all(dense.stride(a) == stride[a] for a in order) and dense.plane_nbytes == plane_nbytes:
        return dense
    return Layout(**kw, strides=stride, plane_bytes=plane_nbytes)


def _component_fit(geo, rows, c, place_p, place_o, element, kv) -> dict:
    """Where the keys (kv 0), values (1) or latent were found: their first element's plane
    and byte, the plane step per layer (0: every layer in one plane), and the byte stride
    of each in-plane axis of size > 1 (from index 1 of it), checked on every probed
    element of the component (affine, positive multiples of the itemsize)."""
    isz = itemsize(geo.dtype)
    what = "latent" if geo.kvs == 1 else ("keys", "values")[kv]
    o0 = element(kv=kv)
    p0, off0 = int(place_p[o0]), int(place_o[o0])
    size = {"L": geo.num_layers, "B": geo.num_blocks, "N": geo.block_size,
            "H": geo.num_heads, "D": geo.head_dim}
    arg = {"L": "layer", "B": "block", "N": "token", "H": "head", "D": "dim"}
    mine = c["kv"] == kv
    ps, strides = 0, {}
    for a in ("L", "B", "N", "H", "D"):
        if size[a] == 1:
            continue
        e = element(kv=kv, **{arg[a]: 1})
        if a == "L" and int(place_p[e]) != p0:
            ps = int(place_p[e]) - p0
            continue
        s = int(place_o[e]) - off0
        if s <= 0 or s % isz:
            raise KVABIError(f"{a}: index 1 of the {what} sits {s} bytes from index 0; a "
                             f"layout's strides are positive multiples of the itemsize {isz}")
        strides[a] = s
    plane = p0 + c["layer"] * ps
    pred = off0 + sum(c[arg[a]] * s for a, s in strides.items())
    bad = np.flatnonzero(mine & ((pred != place_o) | (plane != place_p)))
    if len(bad):
        i = int(bad[0])
        raise KVABIError(f"{rows.name(i)} sits at plane {int(place_p[i])}, byte "
                         f"{int(place_o[i])}, but the {what}' strides {strides} (from index 1 "
                         f"of each axis) put it at plane {int(plane[i])}, byte {int(pred[i])}: "
                         f"the placement is not affine, which no layout expresses (a tiled "
                         f"or split axis?)")
    return {"plane": p0, "plane_step": ps, "offset": off0, "strides": strides}


def _steps_of(fit: dict) -> dict:
    return {**fit["strides"], "plane_step": fit["plane_step"]}


def _component_layout(geo: Geometry, fits, plane_nbytes: int) -> Layout:
    """The component layout of keys and values placed each on its own (strides of axes of
    size 1 are irrelevant: one element apart)."""
    isz = itemsize(geo.dtype)
    comps = []
    for name, f in zip(("key", "value"), fits):
        strides = {("E" if a == "D" else a): s for a, s in f["strides"].items()}
        strides.setdefault("B", isz)
        comps.append(Component(name=name, dtype=geo.dtype, count=geo.head_dim,
                               offset=f["offset"], plane=f["plane"], strides=strides,
                               plane_strides={"L": f["plane_step"]} if f["plane_step"]
                               else {}))
    sizes = {"L": geo.num_layers, "B": geo.num_blocks, "N": geo.block_size,
             "H": geo.num_heads}
    try:
        return Layout(sizes=sizes, components=comps, plane_bytes=plane_nbytes)
    except KVABIError as e:
        raise KVABIError(f"keys and values are placed each on its own, but not as a layout "
                         f"can state it: {e}") from None


def _named(layout: Layout, spec, geo: Geometry) -> Layout:
    """The first preset placing every element as ``layout`` does (its plane bytes kept),
    else ``layout``."""
    for name in preset_names(spec):
        try:
            p = Layout.preset(name, spec, geo.num_blocks, geo.num_layers)
        except KVABIError:
            continue
        if p.num_planes == layout.num_planes and p.plane_nbytes <= layout.plane_nbytes \
                and placement_difference(p, layout) is None:
            if p.plane_nbytes == layout.plane_nbytes:
                return p
            return attrs.evolve(p, plane_bytes=layout.plane_nbytes)
    return layout
