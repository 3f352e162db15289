"""``example.torch_quant``: the torch example over quantized caches (int8 and float8 e4m3),
per tensor and per token and head (``specs/semantics.md`` section 11).

It adds two things to :class:`~kvabi_example_torch.backend.TorchSDPABackend`:

- ``write`` quantizes the step's keys and values, in float32, step for step as section 11.1
  states (the conformance kit's ``quantize`` check holds every code and scale to it, byte
  for byte): the scale (per tensor: the caller's ``k_scale``/``v_scale``, which kvabi passes
  as ``scales``; per token and head: ``max(fl32(absmax / QMAX), 1e-6)``, stored in the
  layout's ``key_scale``/``value_scale`` components), its float32 reciprocal, the product,
  saturation, then the spec's rounding;
- ``rows`` dequantizes what attention gathers: codes times their scale (per token and head:
  read through ``cache.component_view(layer, "key_scale")``, the same strided view as
  ``kv_view`` over the scale's bytes).

Attention itself is the parent's.  The caches it prefers: ``flash_attn`` and
``flashinfer.HND`` for a per-tensor cache (codes only: the scales are layer state), vLLM's
``vllm.int8_per_token_head`` / ``vllm.fp8_per_token_head`` (codes and scales interleaved per
token and head) for a per-token-head one.
"""
from __future__ import annotations

import torch

import kvabi

from .backend import KINDS, TorchSDPABackend

#: saturation bounds of each code format (semantics 11.1, step 4)
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
QMIN = {"int8": -128.0, "float8_e4m3fn": -448.0}
#: vLLM's floor on a per-token-head scale (an all-zero row gets it, and zero codes)
EPSILON = 1e-6
#: e4m3's smallest normal magnitude and its subnormal step
E4M3_MIN_NORMAL, E4M3_STEP = 2.0 ** -6, 2.0 ** -9
SCALES = ("key_scale", "value_scale")


def to_codes(y: torch.Tensor, dtype: str, rounding: str) -> torch.Tensor:
    """Scaled float32 values ``y`` saturated and rounded to codes (semantics 11.1, steps 4
    and 5)."""
    y = y.clamp(QMIN[dtype], QMAX[dtype])
    if dtype == "int8":
        if rounding == "nearest_away":  # vLLM's: trunc(fl32(y + copysign(0.5, y)))
            y = torch.trunc(y + torch.copysign(torch.full_like(y, 0.5), y))
        else:
            y = torch.round(y)  # half to even
        return y.to(torch.int8)
    if rounding == "nearest_even":
        return y.to(torch.float8_e4m3fn)  # torch's conversion rounds to nearest even
    # toward_zero (vLLM's CPU writer): a subnormal result is first snapped to float32's grid
    # of [2**-6, 2**-5) by adding and subtracting 2**-6, then truncated
    a = y.abs()
    a = torch.where(a < E4M3_MIN_NORMAL, (a + E4M3_MIN_NORMAL) - E4M3_MIN_NORMAL, a)
    t = (a.view(torch.int32) & -(1 << 20)).view(torch.float32)  # keep 3 mantissa bits
    t = torch.where(a < E4M3_MIN_NORMAL, torch.floor(a / E4M3_STEP) * E4M3_STEP, t)
    return torch.where(y < 0, -t, t).to(torch.float8_e4m3fn)


class TorchQuantBackend(TorchSDPABackend):
    """The torch example over int8 and float8 e4m3 caches, per tensor and per token and
    head, with every rounding section 11 defines for them."""

    name = "example.torch_quant"

    def capabilities(self, spec=None):
        return kvabi.Capabilities(kinds=KINDS, dtypes=("int8", "float8_e4m3fn"), softcap=True,
                                  sinks=True, quant=("per_tensor", "per_token_head"),
                                  roundings=("nearest_even", "nearest_away", "toward_zero"),
                                  layouts=self.preferred_layouts(spec) if spec else (),
                                  notes="plain torch on CPU; quantizes in float32, attends "
                                        "on dequantized float32")

    def preferred_layouts(self, spec):
        if spec.quant == "per_token_head":
            return ("vllm.int8_per_token_head",) if spec.dtype == "int8" else \
                ("vllm.fp8_per_token_head",)
        return ("flash_attn", "flashinfer.HND")

    def write(self, plan, cache, key, value, layer, scales=None):
        spec, p = plan.spec, plan.prepared
        tok, blk, off = p.write_tokens, p.write_blocks, p.write_offsets
        for kv, x in ((0, key), (1, value)):
            x = x[tok].float()  # float16/bfloat16 inputs are exact in float32
            if spec.quant == "per_token_head":
                s = torch.clamp_min(x.abs().amax(dim=-1) / QMAX[spec.dtype], EPSILON)
                cache.component_view(layer, SCALES[kv])[blk, off, :, 0] = s
                r = (1.0 / s)[..., None]  # the float32 reciprocal, then a product
            else:
                r = 1.0 / torch.tensor(scales[kv], dtype=torch.float32)
            view = cache.kv_view(layer, kv)[..., :x.shape[-1]]
            view[blk, off] = to_codes(x * r, spec.dtype, spec.rounding)
        return cache

    def rows(self, plan, cache, layer, kv, blocks, dim, scales):
        x = cache.kv_view(layer, kv).index_select(0, blocks)[..., :dim].float()
        if plan.spec.quant == "per_token_head":  # [blocks, N, H, 1]: a scale per row
            return x * cache.component_view(layer, SCALES[kv]).index_select(0, blocks)
        return x * scales[kv]
