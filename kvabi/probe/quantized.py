"""``verify_quantized``: a few crafted writes prove (or refute) that a *quantizing* cache
write puts every code, every scale and every unquantized part where a layout says
(``specs/layout.md``, *Inference and verification*).

A writer that quantizes converts what it is given, so the probe's markers cannot pass
through it.  Instead every group of values that shares a scale (a (token, head) row, or a
tile of it: DeepSeek's ``fp8_ds_mla`` has one float32 scale per 128 latent values) is
``q * 2**e``: ``q`` on the code grid with its first element ``+-QMAX``, ``2**e`` a power of
two of its own (distinct along the row's tiles, heads, K and V, and tokens, repeating every
:data:`EXPONENTS` groups).  Every recipe then stores exactly ``q`` and ``2**e``: the absmax
is ``QMAX * 2**e``, so ``absmax / QMAX`` is ``2**e`` whether divided or multiplied by
``fl32(1 / QMAX)``, above any floor (1e-6, the smallest normal); ``x / s`` and
``x * fl32(1 / s)`` are both ``q``, which every rounding keeps.  The expected codes and
scales are not assumed but computed with :mod:`kvabi.model.quant` (the reference's own recipe),
for every rounding of the format, which must agree: the probe and the oracle share one
recipe.  Unquantized parts (DeepSeek's bfloat16 rope) carry marker values of their dtype.
Only the sampled (layer, block) cells are touched: saved, poisoned, written, compared
element by element against the layout, restored.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..layout.descriptor import Layout, check_layout
from ..layout.regions import block_cells
from ..util.dtypes import numpy_dtype
from ..util.errors import KVABIError
from ..model.quant import FORMATS, quantize_per_token_head
from .markers import Alphabet
from .marking import Geometry, writer_call
from .memory import POISON
from .verify import probe_arguments, sample_rows

#: the exponents of the groups' scales, in turn: ``2**-19`` (above vLLM's 1e-6 floor) to
#: ``2**20`` (values exact in float32 and bfloat16)
EXPONENTS = np.arange(-19, 21)


@attrs.frozen
class Part:
    """One quantized data component: its scale component and the values per scale."""

    data: str
    scale: str
    dtype: str
    count: int
    tile: int
    per_head: bool  # one scale per head (else one per token, shared by its heads)


def quantized_parts(layout: Layout) -> tuple[list[Part], list[str]]:
    """The layout's quantized data components with their scales, and its unquantized ones
    (an MLA rope); KVABIError naming what this probe does not check."""
    names = ("key", "value") if layout.has_kv else ("latent",)
    parts = []
    for name in names:
        c = layout.component(name)
        if c.dtype not in FORMATS:
            raise KVABIError(f"layout: its {name} is {c.dtype}; verify_quantized takes int8 "
                             f"or float8 data (verify_layout checks the others)")
        s = layout._chk.by_name.get(f"{name}_scale")
        if s is None or s.dtype != "float32" or not s.varies("N") or c.count % s.count:
            what = "none" if s is None else f"{s.count} x {s.dtype}" + \
                ("" if s.varies("N") else " per block")
            raise KVABIError(f"layout: verify_quantized checks float32 scales per token of "
                             f"{name}, one per group of its {c.count} values; the layout "
                             f"has {what}")
        parts.append(Part(name, s.name, c.dtype, c.count, c.count // s.count,
                          s.varies("H")))
    plain = [n for n in layout.component_names if n == "rope"]
    return parts, plain


def group_values(part: Part, groups: np.ndarray, rng, lead=None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """float32 values ``[..., count]`` of ``part`` whose every tile is ``q * 2**e`` (``q`` on
    the grid below ``QMAX`` in magnitude, the first element ``+-QMAX`` where ``lead`` [...,
    tiles] holds, default everywhere), and the exponents ``[..., tiles]`` used; ``groups``
    [..., tiles] numbers each scale group (its exponent is ``EXPONENTS[group % len]``).  A
    scale shared by a token's heads is led by one head: the others' values are codes under
    it too, and a writer scaling each head alone codes them differently."""
    fmt = FORMATS[part.dtype]
    shape = groups.shape + (part.tile,)
    if fmt.mantissa_bits is None:
        q = rng.integers(-int(fmt.qmax) + 1, int(fmt.qmax), shape).astype(np.float32)
    else:
        codes = np.arange(256, dtype=np.uint8).view(numpy_dtype(part.dtype)).astype(
            np.float32)
        # no -0: toward_zero stores +0 for it, nearest_even -0
        codes = codes[np.isfinite(codes) & (np.abs(codes) < fmt.qmax) & ~np.signbit(codes)]
        q = rng.choice(codes, shape)
    top = np.where(rng.random(groups.shape) < 0.5, -fmt.qmax, fmt.qmax)
    q[..., 0] = np.where(True if lead is None else lead, top, q[..., 0])
    e = EXPONENTS[groups % len(EXPONENTS)]
    x = (q * np.exp2(e)[..., None]).astype(np.float32)
    return x.reshape(groups.shape[:-1] + (part.count,)), e


def expected(part: Part, x) -> tuple[np.ndarray, np.ndarray]:
    """(code bytes [rows, heads, count], scales [rows, heads, tiles]) of ``x`` [rows, heads,
    count] by :mod:`kvabi.model.quant`, a scale per tile of each head (a scale shared by the
    heads: of each tile over all heads, the same in every head's entry); the same for every
    rounding of the format, else the probe's values are wrong (an AssertionError, a bug of
    this module)."""
    fmt = FORMATS[part.dtype]
    r, h = x.shape[:2]
    tiles = np.asarray(x, np.float32).reshape(r, h, -1, part.tile)
    if not part.per_head:  # [rows, tiles, heads * tile]: one row per shared scale
        tiles = tiles.transpose(0, 2, 1, 3).reshape(r, -1, h * part.tile)
    out = None
    for rounding in fmt.roundings:
        codes, scales = quantize_per_token_head(tiles, part.dtype, rounding)
        if not part.per_head:
            codes = codes.reshape(r, -1, h, part.tile).transpose(0, 2, 1, 3)
            scales = np.broadcast_to(scales[:, None, :], (r, h, scales.shape[1]))
        got = (np.ascontiguousarray(codes).view(np.uint8).reshape(x.shape), scales)
        if out is None:
            out = got
        elif not (np.array_equal(out[0], got[0]) and np.array_equal(out[1], got[1])):
            raise AssertionError(f"verify_quantized: its values code differently under "
                                 f"{rounding}")
    return out


def verify_quantized(layout: Layout, planes, write, *, samples: int = 8,
                     seed: int = 0) -> dict:
    """Check that the engine's quantizing ``write`` puts every code, scale and unquantized
    value of the sampled tokens where ``layout`` says.

    ``layout``: keys and values (or a latent) of int8, float8_e4m3fn or float8_e5m2, each
    with float32 scales per token (``key_scale``, ``value_scale``, ``latent_scale``): one
    per (token, head) (vLLM's per-token-head caches, FlashInfer's scale proposals), one per
    token shared by its heads, or one per tile of ``count / scales`` values (DeepSeek's
    ``fp8_ds_mla``: 4 per 512); an MLA ``rope`` is written as is.  ``write(layer,
    slot_mapping, key, value)`` gets float32 ``[tokens, heads, dim]`` (value None for MLA,
    whose key is the latent followed by the rope).  Returns ``{component: elements
    checked}``; raises KVABIError naming the first code or scale not where the layout puts
    it (with where a scale's bytes were found), or bytes written where it has padding.
    """
    check_layout(layout)
    samples, seed, mem = probe_arguments(planes, write, samples, seed)
    parts, plain = quantized_parts(layout)
    if len(mem) != layout.num_planes:
        raise KVABIError(f"planes: {layout.name or 'the layout'} has {layout.num_planes} "
                         f"planes, got {len(mem)} tensors")
    geo = Geometry.of_layout(layout)
    rows = sample_rows(geo, samples, seed)
    nr, h = len(rows.layer), geo.num_heads
    rng = np.random.default_rng(seed)
    values, want = [], {}
    group = 0
    for k, part in enumerate(parts):
        tiles = part.count // part.tile
        g = np.arange(nr * h * tiles).reshape(nr, h, tiles) + group
        lead = None
        if not part.per_head:  # one scale per token: every head of a tile shares it
            g = np.broadcast_to(g[:, :1], g.shape)
            lead = np.zeros(g.shape, bool)
            lead[np.arange(nr), rng.integers(0, h, nr)] = True  # one head holds the absmax
        group += nr * h * tiles + tiles  # the next part starts at another exponent
        group += group % len(EXPONENTS) == 0
        x, _ = group_values(part, g, rng, lead)
        want[part.data], want[part.scale] = expected(part, x)
        values.append(x)
    for name in plain:  # an unquantized part: distinct markers of its own dtype
        c = layout.component(name)
        ids = np.arange(nr * h * c.count).reshape(nr, h, c.count)
        mark = Alphabet.of(c.dtype).values(ids % Alphabet.of(c.dtype).size)
        want[name] = np.ascontiguousarray(mark).view(np.uint8).reshape(nr, h, -1)
        values[0] = np.concatenate([values[0], mark.astype(np.float32)], axis=-1)
    cells = block_cells(layout, zip(rows.layer.tolist(), rows.block.tolist()))
    saved = [mem[p].read(lo, hi) for p, lo, hi in cells]
    try:
        for p, lo, hi in cells:
            mem[p].fill(lo, hi)
        for layer in np.unique(rows.layer):
            sel = np.flatnonzero(rows.layer == layer)
            slots = (rows.block[sel] * geo.block_size + rows.token[sel]).astype(np.int64)
            writer_call(write, int(layer), slots, np.ascontiguousarray(values[0][sel]),
                        np.ascontiguousarray(values[1][sel]) if len(values) > 1 else None)
        return _check(layout, mem, rows, parts, plain, want, cells)
    finally:
        for (p, lo, _), old in zip(cells, saved):
            mem[p].write(lo, old)


def _check(layout, mem, rows, parts, plain, want, cells) -> dict:
    nr, h = len(rows.layer), layout.size("H")
    label = layout.name or "the layout"
    done, covered = {}, []  # (planes, first bytes, bytes each) of every element checked
    for name in [p.data for p in parts] + plain:
        c = layout.component(name)
        isz = c.unit
        r, hh, dd = (a.ravel() for a in np.meshgrid(np.arange(nr), np.arange(h),
                                                    np.arange(c.count), indexing="ij"))
        p, o = layout.element_offset(name, layer=rows.layer[r], block=rows.block[r],
                                     token=rows.token[r], head=hh, index=dd)
        got = np.stack([_bytes(mem, p, o + b) for b in range(isz)], 1)
        exp = want[name].reshape(nr, h, c.count, isz)[r, hh, dd]
        bad = np.flatnonzero((got != exp).any(axis=1))
        if bad.size:
            i = int(bad[0])
            raise KVABIError(f"{_name(rows, r[i], name)}, head {int(hh[i])}, element "
                             f"{int(dd[i])}: bytes {_hex(got[i])} at plane {int(p[i])}, byte "
                             f"{int(o[i])}, where {label} puts it, not the "
                             f"{'code' if name != 'rope' else 'value'} written "
                             f"({_hex(exp[i])})")
        covered.append((np.ravel(p), np.ravel(o), isz))
        done[name] = int(r.size)
    for part in parts:
        sc = layout.component(part.scale)
        r, hh, tt = (a.ravel() for a in np.meshgrid(np.arange(nr), np.arange(h),
                                                    np.arange(sc.count), indexing="ij"))
        if not part.per_head:
            hh = np.zeros_like(hh)
            keep = np.unique(np.stack([r, tt], 1), axis=0, return_index=True)[1]
            r, hh, tt = r[np.sort(keep)], hh[np.sort(keep)], tt[np.sort(keep)]
        p, o = layout.element_offset(part.scale, layer=rows.layer[r], block=rows.block[r],
                                     token=rows.token[r], head=hh, index=tt)
        words = np.stack([_bytes(mem, p, o + b) for b in range(4)], 1).copy().view(np.float32)
        wanted = want[part.scale][r, hh, tt]
        bad = np.flatnonzero(words.ravel() != wanted)
        if bad.size:
            i = int(bad[0])
            tile = f", tile {int(tt[i])}" if sc.count > 1 else ""
            raise KVABIError(f"{_name(rows, r[i], part.scale)}, head {int(hh[i])}{tile}: the "
                             f"scale {float(wanted[i])!r} is not at plane {int(p[i])}, byte "
                             f"{int(o[i])}, where {label} puts it ({_find(mem, cells, wanted[i])}"
                             f"; found {float(words.ravel()[i])!r})")
        covered.append((p, o, 4))
        done[part.scale] = int(r.size)
    for pp, lo, hi in cells:  # nothing written where the layout has padding
        raw = mem[pp].read(lo, hi)
        mine = np.zeros(hi - lo, bool)
        for p, o, n in covered:
            at = (o[(p == pp) & (o >= lo) & (o < hi)] - lo)[:, None] + np.arange(n)
            mine[at[at < hi - lo]] = True
        extra = np.flatnonzero(~mine & (raw != POISON))
        if extra.size:
            raise KVABIError(f"plane {pp}, byte {lo + int(extra[0])} was written, but "
                             f"{label} has padding there")
    return done


def _hex(b) -> str:
    return " ".join(f"{int(x):02x}" for x in np.ravel(b))


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
