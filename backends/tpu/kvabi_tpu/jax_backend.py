"""Backend ``tpu.jax``: the TPU backends' contract in plain jax.numpy, on any jax device."""
from __future__ import annotations

from .backend_base import TPUBackendBase
from .env import jax_status


class JaxBackend(TPUBackendBase):
    """XLA scatter for cache writes, chunked softmax per query tile for attention (no Pallas)."""

    name = "tpu.jax"
    tile_size = 16
    write_form = "slots"
    #: query tokens per tile of requests with more than one query (decodes: one-row tiles)
    prefill_rows = 32
    #: keys per softmax chunk (rounded to whole pages), of prefill tiles and of decodes
    chunk_tokens = 512
    decode_chunk_tokens = 512
    tail_chunk_tokens = 64
    notes = "plain jax.numpy (XLA) on any jax device; cross-checks tpu.pallas"

    def available(self) -> tuple[bool, str]:
        ok, version, platform = jax_status()
        if not ok:
            return False, version
        return True, f"jax {version} on {platform}"

    def _write_impl(self, plan):
        from .jax_attention import scatter_slots

        return scatter_slots, plan.prepared.write_args, ()

    def _attend_impl(self, plan):
        from .jax_attention import attend_impl

        return attend_impl(plan, self)
