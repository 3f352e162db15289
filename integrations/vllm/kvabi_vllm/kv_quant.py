"""vLLM's quantized KV caches as kvabi specs (``specs/semantics.md`` section 11).

vLLM names a cache's quantization in ``cache_config.cache_dtype``; the fp8 names keep one
static scale per layer for keys and one for values (``layer._k_scale_float``,
``layer._v_scale_float``, 1.0 unless a checkpoint or ``calculate_kv_scales`` sets them),
which the plugin passes to every kvabi ``write_kv`` and ``attention`` of the layer.  vLLM's
CPU writer rounds fp8 codes toward zero; a spec asks the kvabi backend for that rounding
when it has it (so that its cache holds vLLM's own bytes), else for one it has.
"""
from __future__ import annotations

import attrs

import kvabi
from kvabi import UnsupportedError

#: vLLM's fp8 cache dtypes (per-tensor scales) -> kvabi cache dtypes
FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
#: what vLLM's own CPU writer does with fp8 codes
VLLM_ROUNDING = "toward_zero"


def quantize_spec(backend, spec: kvabi.KVSpec, cache_dtype: str) -> kvabi.KVSpec:
    """``spec`` as the cache vLLM's ``cache_dtype`` makes it: unchanged for ``auto``; for an
    fp8 name its kvabi dtype, ``per_tensor``, and vLLM's rounding if ``backend`` claims it
    (else the first it claims).  UnsupportedError naming the value for anything else."""
    if cache_dtype in (None, "auto"):
        return spec
    dtype = FP8.get(cache_dtype)
    if dtype is None:
        raise UnsupportedError(f"{backend.name}: kv_cache_dtype {cache_dtype!r} is not served "
                               f"through kvabi (auto, {', '.join(FP8)})")
    from kvabi.model.quant import quant_format

    caps = backend.capabilities(attrs.evolve(spec, dtype=dtype, quant="per_tensor",
                                             rounding=VLLM_ROUNDING))
    fits = [r for r in quant_format(dtype).roundings if r in caps.roundings]
    rounding = VLLM_ROUNDING if VLLM_ROUNDING in fits else (fits or [VLLM_ROUNDING])[0]
    return attrs.evolve(spec, dtype=dtype, quant="per_tensor", rounding=rounding)


def layer_scales(layer, spec: kvabi.KVSpec) -> dict:
    """The static scales of vLLM ``layer`` as kvabi call keywords ({} unless per-tensor)."""
    if spec.quant != "per_tensor":
        return {}
    return {"k_scale": float(layer._k_scale_float), "v_scale": float(layer._v_scale_float)}


__all__ = ["FP8", "VLLM_ROUNDING", "layer_scales", "quantize_spec"]
