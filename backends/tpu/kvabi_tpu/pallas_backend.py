"""Backend ``tpu.pallas``: the Pallas TPU kernels (natively on a TPU, else TPU interpret)."""
from __future__ import annotations

from kvabi.util.dtypes import tpu_packing

from .backend_base import TPUBackendBase
from .env import interpret_arg, on_tpu, pallas_status


class PallasBackend(TPUBackendBase):
    """Cache update and ragged paged attention as Pallas TPU kernels."""

    name = "tpu.pallas"
    tile_size = 8
    num_slices_per_block = 8
    write_form = "slices"
    #: KV pages fetched per DMA block of the attention kernel
    pages_per_block = 2
    notes = ("Pallas TPU kernels: DMA cache update from kv_update_slices, ragged paged "
             "attention with online softmax; interpret mode without a TPU (slow)")

    def available(self) -> tuple[bool, str]:
        return pallas_status()

    def _block_size_multiple(self, spec) -> int:
        # tpu.combined packs 32/bits values per word along the head axis; pages of a size
        # that is not a multiple of that would split a packed (sublane) tile.
        return tpu_packing(spec.dtype)

    def _cheap_compile(self) -> bool:
        # an interpreted kernel is a simulation: optimizing its host code is wasted time
        return self.fast_compile or not on_tpu()

    def _write_impl(self, plan):
        from .update_kernel import update_slots

        return update_slots, plan.prepared.write_args, (
            ("block_size", plan.spec.block_size), ("interpret", interpret_arg()),
            ("per", self.num_slices_per_block))

    def _attend_impl(self, plan):
        from .attention_kernel import paged_attention

        steps = plan.prepared
        return paged_attention, (steps.tile_info, steps.page_table, steps.q_index,
                                 steps.out_index), (("interpret", interpret_arg()),
                                                    ("per_block", self.pages_per_block))
