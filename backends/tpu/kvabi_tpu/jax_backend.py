"""Backend ``tpu.jax``: the TPU backends' contract in plain jax.numpy, on any jax device."""
from __future__ import annotations

from .backend_base import TPUBackendBase
from .env import jax_status


class JaxBackend(TPUBackendBase):
    """XLA scatter for cache writes, chunked softmax per query tile for attention (no Pallas)."""

    name = "tpu.jax"
    tile_size = 16
    #: keys per softmax chunk (rounded to whole pages)
    chunk_tokens = 256
    notes = "plain jax.numpy (XLA) on any jax device; cross-checks tpu.pallas"

    def available(self) -> tuple[bool, str]:
        ok, version, platform = jax_status()
        if not ok:
            return False, version
        return True, f"jax {version} on {platform}"

    def _write_impl(self, plan):
        from .jax_attention import scatter_slots

        return scatter_slots, (plan.slots,), {}

    def _attend_impl(self, plan):
        from .jax_attention import paged_attention

        pages = max(1, min(plan.max_tile_pages, self.chunk_tokens // plan.spec.block_size))
        return paged_attention, (plan.tile_info, plan.page_table, plan.q_index,
                                 plan.out_index), dict(chunk_pages=pages)
