"""Quantizing backends with one planted mistake each, for the kit's ``quantize`` check
(tests/test_kit_quant_faults.py), importable by name so that a reproducer can rebuild them.

The quantizer here is written from ``specs/semantics.md`` section 11.1 with numpy and
ml_dtypes, not with ``kvabi.model.quant`` (the oracle the kit compares against): ``Correct`` is
that recipe and must pass; every other class overrides one step of it.  The same step
functions serve :mod:`tests.test_kit_quant_faults`' sweep over many seeds.
"""
from __future__ import annotations

import attrs
import ml_dtypes
import numpy as np

import kvabi
from kvabi.backend.reference import ReferenceBackend

F32 = np.float32
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
QMIN = {"int8": -128.0, "float8_e4m3fn": -448.0, "float8_e5m2": -57344.0}
NP = {"int8": np.dtype(np.int8), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
      "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}
MANTISSA = {"float8_e4m3fn": 3, "float8_e5m2": 2}
MIN_NORMAL = {"float8_e4m3fn": 2.0 ** -6, "float8_e5m2": 2.0 ** -14}
EPS = F32(1e-6)


class Recipe:
    """Section 11.1, one overridable step per method (float32 numpy throughout)."""

    def row_scale(self, x, dtype):
        """[T, H] scales of rows x [T, H, D]."""
        amax = np.abs(x).max(axis=-1)
        return self.stored_scale(np.maximum((amax / F32(QMAX[dtype])).astype(F32), EPS))

    def stored_scale(self, s):
        return s.astype(F32)

    def scaled(self, x, s):
        with np.errstate(over="ignore"):
            return (x * (F32(1) / np.asarray(s, F32))).astype(F32)

    def saturate(self, y, dtype):
        return np.clip(y, F32(QMIN[dtype]), F32(QMAX[dtype])).astype(F32)

    def codes(self, y, dtype, rounding):
        y = self.saturate(y, dtype)
        if dtype == "int8":
            z = np.trunc((y + np.copysign(F32(0.5), y)).astype(F32)) if \
                rounding == "nearest_away" else np.rint(y)
            return z.astype(np.int8)
        if rounding == "nearest_even":
            return self.convert(y, dtype)
        return self.truncate(y, dtype)

    def convert(self, y, dtype):
        with np.errstate(invalid="ignore", over="ignore"):
            return y.astype(NP[dtype])

    def truncate(self, y, dtype):
        """toward_zero: the code of largest magnitude not above |y|, sign of y < 0."""
        a = np.abs(y).astype(F32)
        m = F32(MIN_NORMAL[dtype])
        if dtype == "float8_e4m3fn":
            a = self.snap(a, m)
        keep = np.uint32(0xFFFFFFFF ^ ((1 << (23 - MANTISSA[dtype])) - 1))
        t = (a.view(np.uint32) & keep).view(F32)
        step = F32(MIN_NORMAL[dtype] * 2.0 ** -MANTISSA[dtype])
        t = np.where(a < m, np.floor(a / step) * step, t).astype(F32)
        return self.sign(t, y).astype(NP[dtype])

    def snap(self, a, m):
        return np.where(a < m, ((a + m).astype(F32) - m).astype(F32), a)

    def sign(self, t, y):
        return np.where(y < 0, -t, t)


class QuantBackend(ReferenceBackend):
    """The reference whose quantized writes use :attr:`recipe`; it claims ``DTYPES``,
    ``QUANT`` and ``ROUNDINGS`` only (every example of the kit is quantized)."""

    name = "planted.q_correct"
    recipe = Recipe()
    DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
    QUANT = ("per_tensor", "per_token_head")
    ROUNDINGS = ("nearest_even", "nearest_away", "toward_zero")

    def capabilities(self, spec=None):
        caps = super().capabilities(spec)
        quant = tuple(q for q in self.QUANT if q in caps.quant)  # per_token_head: a preset
        return attrs.evolve(caps, dtypes=self.DTYPES, quant=quant, roundings=self.ROUNDINGS)

    def write(self, plan, cache, key, value, layer, scales=None):
        spec = plan.spec
        tokens, blk, off = plan.prepared.write_rows
        k_view, v_view = self._views(cache, plan, layer)
        for kv, (x, view) in enumerate(((key, k_view), (value, v_view))):
            if x is None or (kv == 1 and spec.is_mla):
                continue
            x = np.asarray(x, F32) if tokens is None else np.asarray(x, F32)[tokens]
            codes, s = self.store(x, spec.dtype, spec.quant, spec.rounding,
                                  None if scales is None else scales[kv])
            if s is not None:
                cache.component_view(layer, ("key_scale", "value_scale")[kv])[blk, off, :, 0] = s
            view[blk, off] = codes
        return cache

    def store(self, x, dtype, quant, rounding, static=None):
        """(codes [T, H, D], scales [T, H] or None) this backend stores for rows ``x``."""
        if quant == "per_tensor":
            return self.recipe.codes(self.recipe.scaled(x, F32(static)), dtype, rounding), None
        s = self.recipe.row_scale(x, dtype)
        return self.recipe.codes(self.recipe.scaled(x, s[..., None]), dtype, rounding), s


def planted(name, doc, dtypes, roundings, quant=("per_tensor", "per_token_head"), **steps):
    """A :class:`QuantBackend` named ``planted.NAME`` whose recipe overrides ``steps``."""
    recipe = type(f"Recipe_{name}", (Recipe,), steps)()
    cls = type(name, (QuantBackend,), {"name": f"planted.{name}", "__doc__": doc,
                                       "recipe": recipe, "DTYPES": dtypes,
                                       "ROUNDINGS": roundings, "QUANT": quant})
    cls.__module__ = __name__
    return cls


def _ties_even(self, y, dtype, rounding):
    return Recipe.codes(self, y, dtype, "nearest_even")


def _exact_away(self, y, dtype, rounding):
    y = self.saturate(y, dtype).astype(np.float64)
    return (np.sign(y) * np.floor(np.abs(y) + 0.5)).astype(np.int8)


def _divides(self, x, s):
    with np.errstate(over="ignore"):
        return (x / np.asarray(s, F32)).astype(F32)


def _symmetric(self, y, dtype):
    return np.clip(y, F32(-127), F32(127)).astype(F32)


def _no_saturation(self, y, dtype):
    return y


def _clamp_after_rounding(self, y, dtype, rounding):
    with np.errstate(invalid="ignore", over="ignore"):
        c = y.astype(NP[dtype]).astype(F32)
    return np.clip(c, QMIN[dtype], QMAX[dtype]).astype(NP[dtype])


def _scale_bf16(self, s):
    return s.astype(ml_dtypes.bfloat16).astype(F32)


def _scale_by_reciprocal(self, x, dtype):
    amax = np.abs(x).max(axis=-1)
    return np.maximum((amax * (F32(1) / F32(QMAX[dtype]))).astype(F32), EPS)


def _scale_per_token(self, x, dtype):
    amax = np.abs(x).max(axis=(-2, -1), keepdims=True)[..., 0]
    return np.broadcast_to(np.maximum((amax / F32(QMAX[dtype])).astype(F32), EPS),
                           x.shape[:-1]).astype(F32)


def _eps_on_absmax(self, x, dtype):
    amax = np.maximum(np.abs(x).max(axis=-1), EPS)
    return (amax / F32(QMAX[dtype])).astype(F32)


def _no_snap(self, a, m):
    return a


def _via_bf16(self, y, dtype):
    with np.errstate(invalid="ignore", over="ignore"):
        return y.astype(ml_dtypes.bfloat16).astype(F32).astype(NP[dtype])


def _flush_reciprocal(self, x, s):
    r = (F32(1) / np.asarray(s, F32)).astype(F32)
    r = np.where(np.abs(r) < F32(2.0 ** -126), F32(0), r)
    return (x * r).astype(F32)


def _sign_of_signbit(self, t, y):
    return np.where(np.signbit(y), -t, t)


class DynamicForStatic(QuantBackend):
    """A per-tensor cache written with a scale per (token, head) from its row's absmax,
    as a per-token-head cache (the static scale is ignored)."""

    name = "planted.q_dynamic_for_static"
    DTYPES = ("int8", "float8_e4m3fn")
    QUANT = ("per_tensor",)
    ROUNDINGS = ("nearest_even",)

    def store(self, x, dtype, quant, rounding, static=None):
        s = self.recipe.row_scale(x, dtype)[..., None]
        return self.recipe.codes(self.recipe.scaled(x, s), dtype, rounding), None


INT8, E4M3, FP8 = ("int8",), ("float8_e4m3fn",), ("float8_e4m3fn", "float8_e5m2")
#: (class, the mistake's name in the kit's report, or None when it names none)
FAULTS = [
    (planted("q_ties_even", "Rounds int8 ties to even where nearest_away is claimed.", INT8,
             ("nearest_away",), codes=_ties_even), "rounding nearest_even"),
    (planted("q_exact_away", "Rounds int8 half away from zero exactly, not as vLLM's "
             "float32 addition does.", INT8, ("nearest_away",), codes=_exact_away),
     "half away from zero rounded exactly"),
    (planted("q_divides_int8", "Divides by the scale instead of multiplying by its float32 "
             "reciprocal (int8).", INT8, ("nearest_even", "nearest_away"), scaled=_divides),
     "x / s"),
    (planted("q_divides_e4m3", "Divides by the scale instead of multiplying by its float32 "
             "reciprocal (e4m3).", E4M3, ("nearest_even", "toward_zero"), scaled=_divides),
     "x / s"),
    (planted("q_symmetric_int8", "Saturates int8 to [-127, 127].", INT8, ("nearest_even",),
             quant=("per_tensor",), saturate=_symmetric), "saturation to [-127, 127]"),
    (planted("q_no_saturation", "Converts scaled values to float8 without saturating.", FP8,
             ("nearest_even",), quant=("per_tensor",), saturate=_no_saturation),
     "no saturation"),
    (planted("q_clamp_after_rounding", "Rounds to e4m3 first and saturates after (a value "
             "past 464 is already NaN).", E4M3, ("nearest_even",), quant=("per_tensor",),
             codes=_clamp_after_rounding), "no saturation"),
    (planted("q_scale_bf16", "Stores per-token-head scales rounded to bfloat16.", INT8,
             ("nearest_away",), quant=("per_token_head",), stored_scale=_scale_bf16),
     "stored as bfloat16"),
    (planted("q_scale_by_reciprocal", "Computes a per-token-head scale as absmax * "
             "fl32(1 / QMAX).", E4M3, ("nearest_even",), quant=("per_token_head",),
             row_scale=_scale_by_reciprocal), "the reciprocal of QMAX"),
    (planted("q_scale_per_token", "One scale per token over all its heads, not one per "
             "(token, head).", INT8, ("nearest_away",), quant=("per_token_head",),
             row_scale=_scale_per_token), "one scale per token"),
    (planted("q_eps_on_absmax", "Floors the absmax at 1e-6 instead of the scale.", INT8,
             ("nearest_even",), quant=("per_token_head",), row_scale=_eps_on_absmax),
     "the floor on the absmax"),
    (planted("q_no_snap", "Truncates e4m3 subnormal results without snapping them to "
             "float32's grid first.", E4M3, ("toward_zero",), quant=("per_tensor",),
             snap=_no_snap), "without snapping"),
    (planted("q_via_bf16", "Converts to float8 through bfloat16 (two roundings).", FP8,
             ("nearest_even",), quant=("per_tensor",), convert=_via_bf16),
     "through bfloat16"),
    (planted("q_flush_reciprocal", "Flushes a subnormal reciprocal of the scale to zero.",
             INT8 + E4M3, ("nearest_even",), quant=("per_tensor",),
             scaled=_flush_reciprocal), "flushed to zero"),
    (planted("q_sign_of_zero", "toward_zero gives a negative zero input the code -0.",
             FP8, ("toward_zero",), quant=("per_tensor",), sign=_sign_of_signbit), None),
    (DynamicForStatic, "a scale from the row's absmax"),
]
ALL = (QuantBackend,) + tuple(c for c, _ in FAULTS)
for _cls, _ in FAULTS:
    globals()[_cls.__name__] = _cls


@kvabi.hookimpl
def kvabi_backends():
    return [cls() for cls in ALL]
