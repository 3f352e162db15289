"""example.torch_quant through the kvabi conformance kit, as its author's own test suite.

``BackendConformance`` runs every check over the quantized caches the backend claims (int8
and float8 e4m3, per tensor and per token and head, each rounding): ``quantize`` holds its
codes and scales to ``specs/semantics.md`` 11.1 byte for byte at every boundary of the
recipe, the attention checks compare its output on the dequantized values with the float64
reference.  The probe checks that its writes put codes and scales where the presets it
prefers say.
"""
import torch

import kvabi
from kvabi.probe import backend_writer, verify_quantized
from kvabi.testing import BackendConformance


class TestExampleQuant(BackendConformance):
    backend_name = "example.torch_quant"


def test_its_quantizing_write_puts_codes_and_scales_where_its_layouts_say():
    ours = kvabi.get_backend("example.torch_quant")
    for dtype, rounding in (("int8", "nearest_away"), ("float8_e4m3fn", "toward_zero")):
        spec = kvabi.KVSpec("full", block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype,
                            quant="per_token_head", rounding=rounding)
        (name,) = ours.preferred_layouts(spec)
        layout = kvabi.Layout.preset(name, spec, num_blocks=6, num_layers=2)
        planes, write = backend_writer(ours, layout, spec)
        assert isinstance(planes[0], torch.Tensor)
        got = verify_quantized(layout, planes, write, samples=8)
        assert got["key"] == 8 * 2 * 64 and got["value_scale"] == 8 * 2
