"""The kernels lower for a real TPU (Pallas -> Mosaic), checked without one.

``jax.export`` for platform ``tpu`` runs the Pallas TPU lowering (not interpret mode): a
kernel using something Mosaic cannot express fails here.  (The final Mosaic compile runs
in the TPU compiler and is not covered.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from tpu_helpers import make_spec

import kvabi
from kvabi_tpu.attention_kernel import paged_attention
from kvabi_tpu.pallas_backend import PallasBackend
from kvabi_tpu.update_kernel import update_slots

CONFIGS = [  # dtype, layout, kv heads, group, head dim, kind, span, block size
    ("float32", "tpu.combined", 2, 2, 128, "full", None, 16),
    ("bfloat16", "tpu.combined", 1, 4, 64, "sliding_window", 21, 16),
    ("bfloat16", "tpu.hidden", 2, 4, 128, "chunked_local", 24, 32),
    ("bfloat16", "tpu.combined", 1, 8, 256, "full", None, 64),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_kernels_lower_for_tpu(config):
    dtype, form, h, g, d, kind, span, bs = config
    spec = make_spec(kind, bs, h, d, dtype, span)
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [35, 1, 0], [5, 20, 3], [[4, 0, 7], [2, 5, 1], [3, 6, 6]], bs, num_blocks=8,
        num_tokens=38)
    layout = kvabi.Layout.preset(form, spec, 8)
    backend = PallasBackend()
    plan = backend.plan(meta, spec, layout, num_q_heads=h * g, softcap=3.0).prepared
    fmt = plan.fmt
    dt = jnp.dtype(dtype)
    planes = tuple(jax.ShapeDtypeStruct(layout.plane_shape, dt)
                   for _ in range(fmt.num_layer_planes))

    def attend(q, planes, *arrays):
        return paged_attention(q, planes, *arrays, fmt=fmt, scale=0.1, softcap=3.0,
                               kind=kind, window=spec.window, chunk=spec.chunk,
                               has_sinks=True, per_block=backend.pages_per_block,
                               interpret=False)

    q = jax.ShapeDtypeStruct((plan.padded_tokens, h * g, d), dt)
    sinks = jax.ShapeDtypeStruct((h * g,), jnp.float32)
    exported = export.export(jax.jit(attend), platforms=("tpu",))(
        q, planes, plan.tile_info, plan.page_table, plan.q_index, plan.out_index, sinks)
    assert "tpu_custom_call" in exported.mlir_module()

    def update(rows, views, slices, count):
        return update_slots(rows, views, slices, count, block_size=bs,
                            per=backend.num_slices_per_block, interpret=False)

    rows = fmt.token_rows(jnp.zeros((plan.padded_tokens, h, d), dt),
                          jnp.zeros((plan.padded_tokens, h, d), dt))
    views = tuple(jax.ShapeDtypeStruct((8, bs) + fmt.write_slot_shape, dt)
                  for _ in range(fmt.num_layer_planes))
    exported = export.export(jax.jit(update), platforms=("tpu",))(
        tuple(jax.ShapeDtypeStruct(r.shape, r.dtype) for r in rows), views,
        *plan.write_args)
    assert "tpu_custom_call" in exported.mlir_module()
