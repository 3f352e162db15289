"""Backend ``tpu.jax``: the TPU backends' contract in plain jax.numpy, on any jax device."""
from __future__ import annotations

from .backend_base import TPUBackendBase
from .env import jax_status


class JaxBackend(TPUBackendBase):
    """XLA scatter for cache writes, dense-per-tile softmax for attention (no Pallas)."""

    name = "tpu.jax"
    tile_size = 16
    notes = "plain jax.numpy (XLA) on any jax device; cross-checks tpu.pallas"

    def available(self) -> tuple[bool, str]:
        ok, version, platform = jax_status()
        if not ok:
            return False, version
        return True, f"jax {version} on {platform}"

    def _write(self, rows, slot_planes, plan):
        from .jax_attention import scatter_slots

        return scatter_slots(tuple(rows), tuple(slot_planes), plan.slots, fmt=plan.fmt)

    def _attend(self, query, planes, plan, fmt, sinks):
        from .jax_attention import dense_attention

        return dense_attention(query, planes, plan.tile_info, plan.page_table, plan.q_index,
                               plan.out_index, sinks, fmt=fmt, max_pages=plan.max_tile_pages,
                               **self._attn_options(plan))
