"""``verify_quantized``: a few crafted writes prove (or refute) that a *quantizing* cache
write puts every value and every scale where a layout says (``specs/layout.md``,
*Inference and verification*).

A writer that quantizes converts what it is given, so the probe's markers cannot pass
through it; instead each (token, head) row is built so that an absmax quantizer (``scale =
max |x| / qmax``, ``q = x / scale`` rounded and saturated: vLLM's per-token-head writers,
``qmax`` 127 for int8, 448 for float8_e4m3fn) reproduces it exactly: the row is ``q * s``
with ``q`` on the quantized grid, its first element ``qmax``, and ``s`` a scale of few
significant bits (``q * s`` and ``qmax * s / qmax`` are exact in float32).  Every ``s`` is
distinct, so each scale's bytes name their (layer, block, token, head, key or value), and
the values carry seeded grid points.  Only the sampled (layer, block) cells are touched:
saved, poisoned, written, compared element by element against the layout, restored.
"""
from __future__ import annotations

import numpy as np

from ..layout.descriptor import Layout, check_layout
from ..layout.regions import block_cells
from ..util.dtypes import numpy_dtype
from ..util.errors import KVABIError
from .marking import Geometry
from .memory import POISON
from .verify import probe_arguments, sample_rows

#: the largest quantized magnitude of each data dtype (absmax maps to it)
QMAX = {"int8": 127, "float8_e4m3fn": 448, "float8_e5m2": 57344}


def _grid(dtype: str, rng, shape) -> np.ndarray:
    """Seeded points of the quantized grid, below qmax in magnitude, never 0 (float32)."""
    if dtype == "int8":
        v = rng.integers(1, QMAX[dtype], shape)
    else:
        dt = numpy_dtype(dtype)
        cand = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
        ok = np.isfinite(cand) & (np.abs(cand) >= 2.0 ** -6) & (np.abs(cand) < QMAX[dtype])
        v = rng.choice(np.abs(cand[ok]), shape)
    return (v * rng.choice([-1, 1], shape)).astype(np.float32)


def _scales(n: int) -> np.ndarray:
    """``n`` distinct float32 scales of 3 significant bits: ``q * s`` and ``qmax * s``
    stay exact in float32, and ``qmax * s / qmax`` is ``s`` again."""
    k = np.arange(n)
    mant = 1 + (k % 8) / 8.0
    exp = -20 + (k // 8) % 30
    if n > 240:
        raise KVABIError(f"samples: at most 240 scales can be told apart, {n} asked")
    return (mant * np.exp2(exp)).astype(np.float32)


def verify_quantized(layout: Layout, planes, write, *, samples: int = 8,
                     seed: int = 0) -> dict:
    """Check that the engine's quantizing ``write`` puts every value and every scale of the
    sampled tokens where ``layout`` says.

    ``layout``: keys and values (or a latent) of int8, float8_e4m3fn or float8_e5m2 with one
    float32 scale per (token, head) each (``key_scale``, ``value_scale``: vLLM's per-token-
    head caches, FlashInfer's scale proposals).  ``write(layer, slot_mapping, key, value)``
    gets float32 ``[tokens, heads, dim]``.  Returns ``{component: elements checked}`` (the
    components found where the layout puts them); raises KVABIError naming the first value
    or scale that is not there, with where its bytes were found for a scale, or bytes
    written where the layout has padding.
    """
    check_layout(layout)
    samples, seed, mem = probe_arguments(planes, write, samples, seed)
    data = ("key", "value") if layout.has_kv else ("latent",)
    dt = layout.component(data[0]).dtype
    if dt not in QMAX:
        raise KVABIError(f"layout: its {data[0]} is {dt}; verify_quantized takes int8 or "
                         f"float8 data (verify_layout checks the others)")
    for n in data:
        s = layout._chk.by_name.get(f"{n}_scale")
        if s is None or s.dtype != "float32" or s.count != 1 or not s.varies("N"):
            raise KVABIError(f"layout: verify_quantized checks one float32 scale per "
                             f"(token, head) of {n}; the layout has "
                             f"{'none' if s is None else f'{s.count} x {s.dtype}'}")
    if len(mem) != layout.num_planes:
        raise KVABIError(f"planes: {layout.name or 'the layout'} has {layout.num_planes} "
                         f"planes, got {len(mem)} tensors")
    geo = Geometry.of_layout(layout)
    rows = sample_rows(geo, samples, seed)
    nr, h, d = len(rows.layer), geo.num_heads, geo.head_dim
    rng = np.random.default_rng(seed)
    q = _grid(dt, rng, (nr, len(data), h, d))
    q[..., 0] = QMAX[dt]  # the absmax of every row: the scale comes out exactly s
    s = _scales(nr * len(data) * h).reshape(nr, len(data), h)
    x = q * s[..., None]
    cells = block_cells(layout, zip(rows.layer.tolist(), rows.block.tolist()))
    saved = [mem[p].read(lo, hi) for p, lo, hi in cells]
    try:
        for p, lo, hi in cells:
            mem[p].fill(lo, hi)
        for layer in np.unique(rows.layer):
            sel = np.flatnonzero(rows.layer == layer)
            slots = (rows.block[sel] * geo.block_size + rows.token[sel]).astype(np.int64)
            write(int(layer), slots, np.ascontiguousarray(x[sel, 0]),
                  np.ascontiguousarray(x[sel, 1]) if len(data) == 2 else None)
        return _check(layout, mem, rows, data, q, s, cells)
    finally:
        for (p, lo, _), old in zip(cells, saved):
            mem[p].write(lo, old)


def _check(layout, mem, rows, data, q, s, cells) -> dict:
    nr, h, d = q.shape[0], q.shape[2], q.shape[3]
    r, hh, dd = (a.ravel() for a in np.meshgrid(np.arange(nr), np.arange(h), np.arange(d),
                                                indexing="ij"))
    done, covered = {}, []  # (planes, first bytes, bytes each) of every element checked

    def cover(p, o, n):
        covered.append((np.ravel(p), np.ravel(o), n))

    for k, name in enumerate(data):
        c = layout.component(name)
        want = q[:, k].astype(numpy_dtype(c.dtype)).view(np.uint8) if c.dtype != "int8" \
            else q[:, k].astype(np.int8).view(np.uint8)
        p, o = layout.element_offset(name, layer=rows.layer[r], block=rows.block[r],
                                     token=rows.token[r], head=hh, index=dd)
        got = _bytes(mem, p, o)
        bad = np.flatnonzero(got != want[r, hh, dd])
        if bad.size:
            i = int(bad[0])
            raise KVABIError(f"{_name(rows, r[i], name)}, head {int(hh[i])}, dim "
                             f"{int(dd[i])}: byte {int(got[i])} at plane {int(p[i])}, byte {int(o[i])}, where "
                             f"{layout.name or 'the layout'} puts it, not the value written "
                             f"({int(want[r[i], hh[i], dd[i]])})")
        cover(p, o, 1)
        done[name] = int(r.size)
        sname = f"{name}_scale"
        sc = layout.component(sname)
        rs, hs = (a.ravel() for a in np.meshgrid(np.arange(nr), np.arange(h), indexing="ij"))
        p, o = layout.element_offset(sname, layer=rows.layer[rs], block=rows.block[rs],
                                     token=rows.token[rs], head=hs)
        words = np.stack([_bytes(mem, p, o + b) for b in range(4)], 1).copy().view(np.float32)
        wanted = s[rs, k, hs]
        bad = np.flatnonzero(words.ravel() != wanted)
        if bad.size:
            i = int(bad[0])
            where = _find(mem, cells, wanted[i])
            raise KVABIError(f"{_name(rows, rs[i], sname)}, head {int(hs[i])}: the scale "
                             f"{float(wanted[i])!r} is not at "
                             f"plane {int(p[i])}, byte {int(o[i])}, where "
                             f"{layout.name or 'the layout'} puts it ({where})")
        cover(p, o, sc.unit)
        done[sname] = int(rs.size)
    for pp, lo, hi in cells:  # nothing written where the layout has padding
        raw = mem[pp].read(lo, hi)
        mine = np.zeros(hi - lo, bool)
        for p, o, n in covered:
            at = (o[(p == pp) & (o >= lo) & (o < hi)] - lo)[:, None] + np.arange(n)
            mine[at[at < hi - lo]] = True
        extra = np.flatnonzero(~mine & (raw != POISON))
        if extra.size:
            raise KVABIError(f"plane {pp}, byte {lo + int(extra[0])} was written, but "
                             f"{layout.name or 'the layout'} has padding there")
    return done


def _bytes(mem, plane, off) -> np.ndarray:
    out = np.zeros(np.shape(off), np.uint8)
    for p in np.unique(plane):
        sel = np.flatnonzero(plane == p)
        out[sel] = mem[int(p)].words(off[sel], 1)
    return out


def _find(mem, cells, value) -> str:
    pattern = np.float32(value).tobytes()
    for p, lo, hi in cells:
        raw = mem[p].read(lo, hi).tobytes()
        at = raw.find(pattern)
        if at >= 0:
            return f"its bytes are at plane {p}, byte {lo + at}"
    return "its bytes are nowhere in the sampled blocks"


def _name(rows, i, name) -> str:
    return (f"{name} of layer {int(rows.layer[i])}, block {int(rows.block[i])}, token "
            f"{int(rows.token[i])}")
