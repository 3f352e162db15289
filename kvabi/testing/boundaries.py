"""Values on every boundary of a quantizing write (``specs/semantics.md`` section 11.1).

A random value almost never lands where two roundings, or two ways of scaling, disagree: a
quantizer that rounds ties the wrong way or divides by the scale instead of multiplying by
its float32 reciprocal passes any number of random examples.  The values here are built to
land there, for one code format and rounding:

- **targets**: scaled values ``y`` (what ``fl32(x * fl32(1 / s))`` is) on every boundary of
  the codes: exact ties between two codes and one float32 ulp either side of each, exact
  codes and one ulp either side, ``0.5 - 2**-25`` (which vLLM's float32 half-away addition
  takes to 1), float8 subnormal codes and e4m3's snapping grid, the saturation bounds, the
  tie past them and far beyond, signed zeros and tiny values (:func:`targets`);
- **inputs** solved for each target under a scale (:func:`solve`): the float32 ``x`` whose
  ``fl32(x * r)`` is the target where one exists, and beside it the nearest ``x`` whose code
  differs when the row is divided by ``s`` instead (``fl32(x / s)``): a value where
  ``fl32(1 / s)`` and ``1 / s`` give different codes;
- **per-token-head rows** whose absmax puts the scale itself on a boundary
  (:func:`row_maxima`): ``fl32(A / QMAX)`` unlike ``fl32(A * fl32(1 / QMAX))``,
  ``fl32(A * r)`` below, at and above ``QMAX``, the ``1e-6`` floor (all-zero rows, rows just
  under and over ``QMAX * 1e-6``, subnormal rows), huge rows;
- **per-tensor scales** (:func:`tensor_scales`): generic ones whose reciprocal has a
  significand near 2 (every target reachable exactly), the smallest normal float32, and
  ones whose reciprocal is subnormal.

Everything is float32 arithmetic as the recipe states it, seeded by a numpy generator.
"""
from __future__ import annotations

import numpy as np

from ..util.dtypes import numpy_dtype
from ..model.quant import FORMATS, SCALE_EPSILON, round_codes

F32 = np.float32
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
#: float32 steps tried either side of a target's quotient when solving for an input
SEARCH = 8


def _next(x, direction) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.nextafter(np.asarray(x, F32), F32(direction))


def _around(values) -> np.ndarray:
    """``values`` and one float32 ulp either side of each."""
    v = np.asarray(values, F32)
    return np.concatenate([v, _next(v, np.inf), _next(v, -np.inf)])


def positive_codes(dtype: str) -> np.ndarray:
    """Every positive finite value of a code format, ascending (float64)."""
    if dtype == "int8":
        return np.arange(1, 128, dtype=np.float64)
    c = np.arange(256, dtype=np.uint8).view(numpy_dtype(dtype)).astype(np.float64)
    return np.unique(c[np.isfinite(c) & (c > 0)])


def targets(dtype: str, rounding: str, rng: np.random.Generator, *,
            codes: int = 8) -> np.ndarray:
    """float32 scaled values on the boundaries of ``dtype``'s codes under ``rounding`` (see
    the module docstring); ``codes`` random codes besides the fixed ones (the extremes, the
    subnormal and normal edges) get their ties and neighbours.  Signs are mixed, both
    signs of every tie kind present."""
    fmt = FORMATS[dtype]
    pos = positive_codes(dtype)
    if fmt.mantissa_bits is None:
        fixed = [0, 1, 2, 3, 62, 63, 125, 126]  # ties k + 0.5 between k and k + 1
        ks = np.unique(np.concatenate([fixed, rng.integers(0, 127, codes)]))
        ties = ks + 0.5
        cs = np.unique(np.concatenate([[1, 2, 126, 127], rng.integers(1, 128, codes)]))
        special = [np.nextafter(F32(0.5), F32(0)), 0.5, 1.5 - 2.0 ** -23]
        beyond = [127.0, 127.5, 128.0, 200.0, 1e6, 3e38]
        low = [-128.0, -128.5, -129.0, -1e6, -3e38]
    else:
        n = len(pos)
        sub = int(np.sum(pos < fmt.min_normal))
        fixed = [0, sub - 1, sub, sub + 1, n - 2]  # the subnormal/normal edge, the top
        idx = np.unique(np.concatenate([fixed, rng.integers(0, n - 1, codes)]))
        ties = (pos[idx] + pos[idx + 1]) / 2
        cs = pos[np.unique(np.concatenate([idx, [n - 1]]))]
        step = pos[-1] - pos[-2]
        special = [pos[0] / 2]  # the tie between 0 and the smallest code
        if fmt.snap_subnormals:  # e4m3's toward_zero snaps below 2**-6 to a 2**-29 grid
            grid = (np.arange(1, sub + 2) * pos[0])[:, None]
            snap = (grid - np.array([2.0 ** -29, 2.0 ** -30, 2.0 ** -31])).ravel()
        beyond = [fmt.qmax, fmt.qmax + step / 2, fmt.qmax + step, 2 * fmt.qmax, 1e30]
        low = [-v for v in beyond]
    tie_vals = _around(ties)
    signs = np.where(rng.random(tie_vals.size) < 0.5, -1, 1).astype(F32)
    tie_vals = np.concatenate([tie_vals * signs, -tie_vals[:2], tie_vals[:2]])
    code_vals = _around(cs) * np.where(rng.random(3 * cs.size) < 0.5, -1, 1).astype(F32)
    spec = _around(special)
    if fmt.mantissa_bits is not None and fmt.snap_subnormals:
        spec = np.concatenate([spec, snap.astype(F32)])
    spec = np.concatenate([spec, -spec])
    sat = np.concatenate([_around(beyond), _around(low)])
    zeros = np.array([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45], F32)
    del rounding  # every format's boundaries serve every rounding (the others are faults)
    with np.errstate(over="ignore"):
        out = np.concatenate([tie_vals, code_vals, spec.astype(F32), sat, zeros]).astype(F32)
    return out[np.isfinite(out)]


def reciprocal(s) -> np.ndarray:
    """``fl32(1 / s)`` (float32 division, correctly rounded)."""
    with np.errstate(over="ignore", divide="ignore"):
        return (F32(1) / np.asarray(s, F32)).astype(F32)


def solve(y, s, dtype: str, rounding: str, search: int = SEARCH):
    """Inputs for scaled targets ``y`` under scales ``s`` (broadcasting): ``(hit, split)``.

    ``hit``: per target, the float32 ``x`` nearest ``y / r`` with ``fl32(x * r) == y``
    (``r = fl32(1 / s)``), else the one whose product is closest.  ``split``: per target,
    the ``x`` nearest ``y / r`` whose code under the recipe differs from its code when
    divided (``fl32(x / s)``), NaN where none is within ``search`` ulps."""
    y = np.asarray(y, F32)
    s = np.broadcast_to(np.asarray(s, F32), y.shape)
    r = reciprocal(s)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        x0 = np.clip(y.astype(np.float64) / r.astype(np.float64), -F32_MAX, F32_MAX)
    x0 = np.where(np.isfinite(x0), x0, 0.0).astype(F32)
    steps = [x0]
    up = down = x0
    for _ in range(search):
        up, down = _next(up, np.inf), _next(down, -np.inf)
        steps += [up, down]
    c = np.stack(steps)  # [2 * search + 1, n], nearest first
    c = np.clip(c, -F32_MAX, F32_MAX).astype(F32)
    with np.errstate(over="ignore", invalid="ignore"):
        prod = (c * r).astype(F32)
        div = (c / s).astype(F32)
    exact = prod == y
    first = np.argmax(exact, axis=0)
    close = np.argmin(np.abs(prod.astype(np.float64) - y.astype(np.float64)), axis=0)
    cols = np.arange(y.size)
    hit = c[np.where(exact.any(axis=0), first, close), cols]
    code = round_codes(np.nan_to_num(prod), dtype, rounding)
    code_div = round_codes(np.nan_to_num(div), dtype, rounding)
    differs = _bits(code) != _bits(code_div)
    pick = np.argmax(differs, axis=0)
    split = np.where(differs.any(axis=0), c[pick, cols], np.nan).astype(F32)
    return hit, split


def _bits(codes) -> np.ndarray:
    return np.ascontiguousarray(codes).view(np.uint8)


def row_scale(amax, dtype: str) -> np.ndarray:
    """A per-token-head scale: ``max(fl32(amax / QMAX), 1e-6)`` (float32)."""
    qmax = F32(FORMATS[dtype].qmax)
    return np.maximum((np.asarray(amax, F32) / qmax).astype(F32), SCALE_EPSILON).astype(F32)


def row_maxima(dtype: str, rng: np.random.Generator, typical: int = 4) -> np.ndarray:
    """Row absmaxes ``A`` that put a per-token-head scale on its boundaries (module
    docstring), and ``typical`` generic ones in [0.3, 3]."""
    qmax = F32(FORMATS[dtype].qmax)
    cand = rng.uniform(0.3, 3.0, 512).astype(F32)
    s = row_scale(cand, dtype)
    via_reciprocal = (cand * (F32(1) / qmax)).astype(F32) != s  # the scale's own rounding
    top = (cand * reciprocal(s)).astype(F32)
    picks = [cand[:typical]]
    for mask in (via_reciprocal, top < qmax, top > qmax, top == qmax):
        picks.append(cand[mask][:2])
    floor = F32(float(SCALE_EPSILON) * float(qmax))  # A / QMAX near the 1e-6 floor
    near = _around([floor])
    picks += [near, np.array([0.0, 1e-40, 1e-5, 1e-30, 3e38, 1e30], F32)]
    return np.concatenate(picks).astype(F32)


def tensor_scales(dtype: str, rounding: str, rng: np.random.Generator, tries: int = 24
                  ) -> list[float]:
    """Static scales to write a per-tensor cache under: two generic ones about ``4 / QMAX``
    (of ``tries`` candidates, the one under which most targets code differently when
    divided, and one whose reciprocal's significand is near 2, so that every target is
    reachable exactly), the smallest normal float32, and one whose reciprocal is
    subnormal."""
    qmax = FORMATS[dtype].qmax
    y = targets(dtype, rounding, rng)
    cand = (rng.uniform(0.5, 2.0, tries) * 4 / qmax).astype(F32)
    _, sp = solve(np.tile(y, tries), np.repeat(cand, y.size), dtype, rounding)
    split = cand[int(np.argmax(np.isfinite(sp.reshape(tries, y.size)).sum(axis=1)))]
    mant = np.frexp(reciprocal(cand))[0] * 2  # significands in [1, 2)
    reach = cand[int(np.argmax(mant))]
    big = F32(rng.uniform(1.2, 1.9) * 2.0 ** 127)  # 1 / big is below 2**-126
    return [float(split), float(reach), F32_TINY, float(big)]


def tensor_values(dtype: str, rounding: str, scale: float, rng: np.random.Generator
                  ) -> np.ndarray:
    """float32 inputs on every boundary under a static ``scale``: each target's solved input
    and, where one exists, the input that dividing by the scale codes differently; shuffled."""
    y = targets(dtype, rounding, rng)
    hit, split = solve(y, F32(scale), dtype, rounding)
    x = np.concatenate([hit, split[np.isfinite(split)]])
    return x[rng.permutation(x.size)]


def head_rows(dtype: str, rounding: str, width: int, rng: np.random.Generator,
              tries: int = 12) -> np.ndarray:
    """float32 rows ``[R, width]`` for a per-token-head cache: one per boundary absmax of
    :func:`row_maxima`, then rows of generic absmax (of ``tries`` candidates, the one under
    which most of the row's targets code differently when divided) until every target
    below ``QMAX`` has a place; each target's solved input and its split input beside it,
    the absmax at a random place and sign, random smaller values in the places left."""
    qmax = FORMATS[dtype].qmax
    y = targets(dtype, rounding, rng)
    pending = y[np.abs(y) < qmax]
    per = max(1, (width - 1) // 2)
    maxima = row_maxima(dtype, rng)
    s = row_scale(maxima, dtype)
    tops = np.where(maxima > 0, (maxima * reciprocal(s)).astype(F32), 0)
    owner, taken = [], np.zeros(pending.size, bool)
    for i, top in enumerate(tops):  # a few boundary rows, each takes what fits under it
        fit = np.flatnonzero(~taken & (np.abs(pending) < top))[:per]
        taken[fit] = True
        owner += [(i, j) for j in fit]
    rest = np.flatnonzero(~taken)
    n = -(-rest.size // per)
    if n:  # generic rows: the absmax of ``tries`` under which most targets split
        chunk = np.resize(rest, n * per).reshape(n, per)
        cand = rng.uniform(0.3, 3.0, (n, tries)).astype(F32)
        ys = np.broadcast_to(pending[chunk][:, None, :], (n, tries, per))
        sc = np.broadcast_to(row_scale(cand, dtype)[:, :, None], (n, tries, per))
        _, sp = solve(ys.ravel(), sc.ravel(), dtype, rounding)
        best = np.argmax(np.isfinite(sp.reshape(n, tries, per)).sum(axis=2), axis=1)
        maxima = np.concatenate([maxima, cand[np.arange(n), best]])
        owner += [(len(tops) + k, int(j)) for k in range(n) for j in
                  dict.fromkeys(chunk[k].tolist())]
    rows_of = np.array([o for o, _ in owner], np.int64)
    ys = pending[np.array([j for _, j in owner], np.int64)] if owner else np.zeros(0, F32)
    a = maxima[rows_of] if owner else np.zeros(0, F32)
    hit, split = solve(ys, row_scale(a, dtype), dtype, rounding)
    vals: list[list] = [[] for _ in maxima]
    for r, h, sp, lim in zip(rows_of.tolist(), hit, split, a):
        vals[r] += [v for v in (h, sp) if np.isfinite(v) and abs(float(v)) < lim]
    out = np.zeros((len(maxima), width), F32)
    for r, amax in enumerate(maxima):
        at = int(rng.integers(width))
        out[r, at] = amax * (F32(-1) if rng.random() < 0.5 else F32(1))
        free = [i for i in range(width) if i != at]
        if amax <= 0 or not free:
            continue
        v = vals[r][:len(free)]
        v += list(rng.uniform(-1, 1, len(free) - len(v)).astype(F32) * amax)
        out[r, free] = np.asarray(v, F32)[rng.permutation(len(free))]
    return out


# -- what a mistaken recipe stores: names for a wrong code or scale in a failure ---------
def _truncate(y, fmt) -> np.ndarray:
    """float8 codes of ``y`` truncated toward zero with no snapping of subnormals."""
    a = np.minimum(np.abs(np.asarray(y, F32)), F32(fmt.qmax))
    cut = np.uint32((1 << (23 - fmt.mantissa_bits)) - 1)
    t = (a.view(np.uint32) & ~cut).view(F32)
    step = fmt.min_normal * 2.0 ** -fmt.mantissa_bits
    t = np.where(a < fmt.min_normal, np.floor(a / step) * step, t).astype(F32)
    return np.where(np.asarray(y) < 0, -t, t).astype(numpy_dtype(fmt.dtype))


def code_alternatives(x, s, dtype: str, rounding: str, row=None) -> dict:
    """{mistake: code} for one input ``x`` under scale ``s``: what recipes that differ from
    ``specs/semantics.md`` 11.1 in one step store (``row``: the input's row, for a scale
    computed from it).  Used to name a wrong code in a failure, never to draw values."""
    fmt = FORMATS[dtype]
    x, s = F32(x), F32(s)
    y = np.array([x * reciprocal(s)], F32)
    out = {}
    with np.errstate(all="ignore"):
        out["x / s (a division, not x * fl32(1 / s))"] = round_codes(
            np.nan_to_num(np.array([x / s], F32)), dtype, rounding)
        for other in fmt.roundings:
            if other != rounding:
                out[f"rounding {other}"] = round_codes(y, dtype, other)
        if fmt.mantissa_bits is None:
            exact = np.clip(np.sign(y) * np.floor(np.abs(y.astype(np.float64)) + 0.5),
                            fmt.qmin, fmt.qmax).astype(np.int8)
            out["half away from zero rounded exactly (not fl32(y + copysign(0.5, y)))"] = exact
            out["saturation to [-127, 127]"] = np.clip(round_codes(y, dtype, rounding),
                                                      -127, 127).astype(np.int8)
            out["no saturation"] = np.rint(y.astype(np.float64)).astype(np.int64).astype(
                np.int8)
        else:
            dt = numpy_dtype(dtype)
            for via in ("bfloat16", "float16"):
                mid = y.astype(numpy_dtype(via)).astype(F32)
                out[f"rounded through {via} first"] = round_codes(mid, dtype, rounding)
            if fmt.snap_subnormals and rounding == "toward_zero":
                out["toward_zero without snapping subnormal results"] = _truncate(y, fmt)
            out["no saturation"] = y.astype(dt)
        tiny = reciprocal(s) < F32_TINY
        if tiny:
            out["a subnormal reciprocal flushed to zero"] = round_codes(
                np.array([x * F32(0)], F32), dtype, rounding)
        if row is not None:
            dyn = row_scale(np.max(np.abs(np.asarray(row, F32))), dtype)
            out["a scale from the row's absmax (per token and head), not the given one"] = \
                round_codes(np.array([x * reciprocal(dyn)], F32), dtype, rounding)
    return {k: v.reshape(-1)[:1] for k, v in out.items()}


def scale_alternatives(row, dtype: str, token_rows=None) -> dict:
    """{mistake: scale} for one per-token-head row ``x`` (``token_rows``: every head's row
    of the token, for a scale per token)."""
    fmt = FORMATS[dtype]
    qmax = F32(fmt.qmax)
    a = np.max(np.abs(np.asarray(row, F32)))
    want = row_scale(a, dtype)
    out = {"fl32(absmax * fl32(1 / QMAX)) (the reciprocal of QMAX)":
           np.maximum((a * (F32(1) / qmax)).astype(F32), SCALE_EPSILON),
           "no 1e-6 floor": (a / qmax).astype(F32),
           "the floor on the absmax, max(absmax, 1e-6) / QMAX":
           (np.maximum(a, SCALE_EPSILON) / qmax).astype(F32),
           "stored as bfloat16": want.astype(numpy_dtype("bfloat16")).astype(F32),
           "stored as float16": want.astype(np.float16).astype(F32)}
    if token_rows is not None:
        out["one scale per token (absmax over its heads)"] = row_scale(
            np.max(np.abs(np.asarray(token_rows, F32))), dtype)
    return {k: np.asarray(v, F32).reshape(1) for k, v in out.items()}


def matching(alternatives: dict, got) -> list[str]:
    """The mistakes of ``alternatives`` whose result has the bits of ``got``."""
    g = np.ascontiguousarray(np.asarray(got).reshape(1)).view(np.uint8)
    return [k for k, v in alternatives.items()
            if np.array_equal(np.ascontiguousarray(v).view(np.uint8), g)]


__all__ = ["code_alternatives", "head_rows", "matching", "positive_codes", "reciprocal",
           "row_maxima", "row_scale", "scale_alternatives", "solve", "targets",
           "tensor_scales", "tensor_values"]
