"""Quantized KV caches: the formats and the exact oracle of what ``write_kv`` stores
(``specs/semantics.md``, section 11).

A quantized cache holds *codes* (float8 e4m3fn / e5m2 or int8) and float32 *scales*; the
value a code stands for is ``code * scale``.  Two granularities exist:

- ``per_tensor``: one static scale per layer for keys (``k_scale``) and one for values
  (``v_scale``), given by the caller (layer state, not cache bytes);
- ``per_token_head``: one dynamic scale per (token, head) for keys and one for values,
  computed by the write from the row's absolute maximum and stored in the cache.

Every step is float32 arithmetic, each operation correctly rounded, in this order: the
input is rounded to float32; per (token, head) ``s = max(fl32(absmax / QMAX), 1e-6)``
(the static scale is rounded to float32 instead); ``r = fl32(1 / s)``; ``y = fl32(x * r)``;
``y`` is saturated to the format's range and rounded to a code by the spec's rounding:
``nearest_even`` (IEEE), ``nearest_away`` (int8: half away from zero, as
``trunc(fl32(y + copysign(0.5, y)))``) or ``toward_zero`` (float8: magnitudes truncated, the
sign that of ``y < 0``; for e4m3fn a result below the smallest normal is first rounded to
float32's grid of the smallest normal's binade, as the float32 addition of the smallest
normal does).  The last
two are the rounding of vLLM's int8 per-token-head writer and of vLLM's CPU fp8 writer; a
spec states which one its cache was written with, so that a write is checked byte for byte.
"""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..util.coerce import as_float, real_array
from ..util.dtypes import numpy_dtype
from ..util.errors import KVABIError, require

#: how a cache's values are scaled: not at all, one static scale per layer and K/V, or one
#: dynamic scale per (token, head) stored in the cache
QUANT_MODES = ("none", "per_tensor", "per_token_head")
#: how a scaled value becomes a code
ROUNDINGS = ("nearest_even", "nearest_away", "toward_zero")
#: vLLM's floor on a dynamic scale (an all-zero row gets this scale and zero codes)
SCALE_EPSILON = np.float32(1e-6)
#: the dtype of every scale
SCALE_DTYPE = "float32"
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32


@attrs.frozen
class QuantFormat:
    """A code format: its saturation bounds, and for float8 its mantissa bits and smallest
    normal magnitude."""

    dtype: str
    qmax: float
    qmin: float
    mantissa_bits: int | None = None  # None: an integer format
    min_normal: float | None = None
    #: ``toward_zero`` first rounds a result below ``min_normal`` to float32's grid of
    #: ``[min_normal, 2 * min_normal)`` (vLLM's CPU e4m3 conversion does; its e5m2 does not)
    snap_subnormals: bool = False

    @property
    def roundings(self) -> tuple[str, ...]:
        """The roundings defined for this format."""
        return ("nearest_even", "toward_zero") if self.mantissa_bits else \
            ("nearest_even", "nearest_away")


FORMATS = {
    "float8_e4m3fn": QuantFormat("float8_e4m3fn", 448.0, -448.0, 3, 2.0 ** -6, True),
    "float8_e5m2": QuantFormat("float8_e5m2", 57344.0, -57344.0, 2, 2.0 ** -14),
    "int8": QuantFormat("int8", 127.0, -128.0),
}
#: cache dtypes a quantized spec may have
QUANT_DTYPES = tuple(FORMATS)


def quant_format(dtype: str, field: str = "dtype") -> QuantFormat:
    """The code format of cache dtype ``dtype``, or KVABIError naming ``field``."""
    fmt = FORMATS.get(dtype) if isinstance(dtype, str) else None
    if fmt is None:
        raise KVABIError(f"{field}: a quantized cache holds {', '.join(QUANT_DTYPES)}, "
                         f"got {dtype!r}")
    return fmt


def check_quant(quant, rounding, dtype) -> None:
    """KVABIError naming ``quant`` or ``rounding`` unless they are a valid combination for
    a cache of ``dtype`` (``none`` takes any dtype and only ``nearest_even``)."""
    require(isinstance(quant, str) and quant in QUANT_MODES, "quant",
            f"must be one of {', '.join(QUANT_MODES)}", quant)
    require(isinstance(rounding, str) and rounding in ROUNDINGS, "rounding",
            f"must be one of {', '.join(ROUNDINGS)}", rounding)
    if quant == "none":
        require(rounding == "nearest_even", "rounding",
                "only a quantized cache (quant per_tensor or per_token_head) states another "
                "rounding than nearest_even", rounding)
        return
    fmt = quant_format(dtype)
    require(rounding in fmt.roundings, "rounding",
            f"{dtype} codes are rounded {' or '.join(fmt.roundings)}", rounding)


def as_scale(value, field: str) -> float:
    """A static scale as the float32 it is used as (a Python float): a real number whose
    float32 rounding is a positive normal number (so that ``1 / scale`` is finite)."""
    v = as_float(value, field)
    s = float(np.float32(v)) if abs(v) < 3.5e38 else math.inf
    if not (_F32_TINY <= s < math.inf):
        raise KVABIError(f"{field}: must be a positive float32 normal number "
                         f"(>= 2**-126, < 2**128), got {value!r}")
    return s


def check_scales(spec, k_scale, v_scale) -> tuple[float, float] | None:
    """The static scales of one ``write_kv`` or ``attention`` call as float32 values:
    ``(k_scale, v_scale)`` for a ``per_tensor`` spec (each defaults to 1.0), None for any
    other spec, which must be given none (KVABIError naming the field).  An MLA latent
    uses ``k_scale`` only."""
    if spec.quant != "per_tensor":
        if k_scale is None and v_scale is None:  # every unquantized call: no more work
            return None
        for name, v in (("k_scale", k_scale), ("v_scale", v_scale)):
            require(v is None, name, f"static scales are for a per_tensor cache, this spec's "
                    f"quant is {spec.quant!r}", v)
        return None
    if spec.is_mla:
        require(v_scale is None, "v_scale", "an MLA latent has one scale, k_scale", v_scale)
    return (1.0 if k_scale is None else as_scale(k_scale, "k_scale"),
            1.0 if v_scale is None else as_scale(v_scale, "v_scale"))


def check_quant_layout(spec, layout) -> None:
    """KVABIError naming ``layout`` unless its scale components are what ``spec.quant``
    needs: a ``per_token_head`` cache has ``key_scale`` and ``value_scale``, float32, one
    per (token, head) of its data; any other cache has no scale component (a static scale
    is layer state, not cache bytes)."""
    names = layout.component_names
    scales = [n for n in names if n.endswith("_scale")]
    if spec.quant != "per_token_head":
        require(not scales, "layout.components", f"hold scales ({', '.join(scales)}), but "
                f"the spec's quant is {spec.quant!r} (only per_token_head stores scales)")
        return
    for data in ("key", "value"):
        name = f"{data}_scale"
        require(name in names, "layout.components", f"a per_token_head cache needs {name} "
                f"(one float32 per token and head); the layout holds {', '.join(names)}")
        c = layout.component(name)
        require(c.dtype == SCALE_DTYPE and c.count == 1, f"layout.components.{name}",
                f"must be one {SCALE_DTYPE} per token and head, got {c.count} x {c.dtype}")
        require(c.varies("N") and c.varies("H"), f"layout.components.{name}",
                "must vary along N and H (one scale per token and head)")


def finite_float32(x, field: str) -> np.ndarray:
    """``x`` rounded to float32 (round to nearest even), refusing non-finite values: a
    quantized write takes only finite input (``specs/semantics.md`` section 11)."""
    a = real_array(x, field)
    with np.errstate(over="ignore"):
        f = np.asarray(a, np.float32)
    if f.size and not np.isfinite(f).all():
        bad = np.argwhere(~np.isfinite(f))[0]
        raise KVABIError(f"{field}: a quantized cache takes finite values only; element "
                         f"{tuple(int(i) for i in bad)} is {a[tuple(bad)]!r} "
                         f"({f[tuple(bad)]} in float32)")
    return f


def round_codes(y: np.ndarray, dtype: str, rounding: str) -> np.ndarray:
    """Finite float32 ``y`` saturated to ``dtype``'s range and rounded to its codes (an
    array of the cache's numpy dtype)."""
    fmt = quant_format(dtype)
    y = np.asarray(y, np.float32)
    if fmt.mantissa_bits is None:
        if rounding == "nearest_away":
            z = np.trunc(y + np.copysign(np.float32(0.5), y))  # float32, as vLLM computes
        else:
            z = np.rint(y)
        return np.clip(z, fmt.qmin, fmt.qmax).astype(np.int8)
    a = np.minimum(np.abs(y), np.float32(fmt.qmax))
    if rounding == "toward_zero":
        cut = np.uint32((1 << (23 - fmt.mantissa_bits)) - 1)
        t = (a.view(np.uint32) & ~cut).view(np.float32)  # exact for normal results
        sub = a < fmt.min_normal
        if sub.any():  # subnormal results: whole steps of the smallest subnormal
            g = a[sub]
            if fmt.snap_subnormals:
                m = np.float32(fmt.min_normal)
                g = (g + m) - m  # float32: rounds to the grid of [m, 2m); then exact
            step = np.float32(fmt.min_normal * 2.0 ** -fmt.mantissa_bits)
            t[sub] = np.floor(g / step) * step
        # the sign of y < 0: a negative zero input gives +0, a negative value
        # truncated to zero -0 (vLLM's CPU conversion)
        return np.where(y < 0, -t, t).astype(numpy_dtype(dtype))
    return np.copysign(a, y).astype(numpy_dtype(dtype))


def quantize_per_tensor(x, scale: float, dtype: str, rounding: str, field: str = "key"):
    """Codes of ``x`` under static scale ``scale`` (a float32 value, see :func:`as_scale`)."""
    x32 = finite_float32(x, field)
    r = np.float32(1) / np.float32(scale)
    return round_codes(x32 * r, dtype, rounding)


def quantize_per_token_head(x, dtype: str, rounding: str, field: str = "key"):
    """``(codes, scales)`` of ``x`` [..., D]: one float32 scale per row of the last axis,
    ``max(fl32(absmax / QMAX), 1e-6)``, and the row's codes under it."""
    fmt = quant_format(dtype)
    x32 = finite_float32(x, field)
    require(x32.ndim >= 1 and x32.shape[-1] >= 1, field, "needs a non-empty last axis",
            x32.shape)
    amax = np.max(np.abs(x32), axis=-1)
    s = np.maximum(amax / np.float32(fmt.qmax), SCALE_EPSILON).astype(np.float32)
    r = np.float32(1) / s
    return round_codes(x32 * r[..., None], dtype, rounding), s


def dequantize(codes, scale) -> np.ndarray:
    """The float64 values ``codes * scale`` (exact: a code has at most 8 significant bits,
    a float32 scale 24).  ``scale``: a number, or an array broadcasting against ``codes``
    without their last axis (one per row)."""
    c = np.asarray(codes).astype(np.float64)
    s = np.asarray(scale, np.float64)
    return c * (s[..., None] if s.ndim else s)


__all__ = ["FORMATS", "QUANT_DTYPES", "QUANT_MODES", "ROUNDINGS", "SCALE_DTYPE",
           "SCALE_EPSILON", "QuantFormat", "as_scale", "check_quant", "check_quant_layout",
           "check_scales", "dequantize",
           "finite_float32", "quant_format", "quantize_per_tensor", "quantize_per_token_head",
           "round_codes"]
