"""``cpu.vllm`` (vLLM's compiled CPU attention kernels) through the kvabi conformance kit.

``TestCpuVllm`` runs every check of the kit on what the backend claims. Its block sizes
are the multiples of 16, of which the kit's small draws hold only 16 (the ``vec16`` ISA);
``TestCpuVllmVecBlocks`` runs the checks that reach the kernels again with the backend
narrowed to block sizes 32, 64 and 128, where vLLM selects the ``vec`` ISA; fp8 caches
(per-tensor, vLLM's rounding toward zero) need ``vec`` and are drawn only there."""
import kvabi
from kvabi.testing import BackendConformance
from kvabi.testing.checks import CHECKS

from kvabi_vllm.cpu_backend import CpuVllmBackend


class TestCpuVllm(BackendConformance):
    backend_name = "cpu.vllm"


class _VecBlocks(CpuVllmBackend):
    """cpu.vllm claiming only block sizes that select the ``vec`` ISA."""

    def capabilities(self, spec=None):
        import attrs

        return attrs.evolve(super().capabilities(spec), block_sizes=(32, 64, 128),
                            head_dims=(32, 64, 128, 256))


# fp8 caches (vec only) are written and laid out here too: write_kv, quantize and layouts
_KERNEL_CHECKS = ("attention", "poisoned_rows", "poisoned_per_query", "kv_sharing", "cascade",
                  "pad", "write_kv", "quantize", "layouts")


class TestCpuVllmVecBlocks(BackendConformance):
    backend_name = "cpu.vllm"
    # The layout, refusal and metadata-only checks do not depend on the ISA: run above.
    skip_checks = tuple(c.name for c in CHECKS if c.name not in _KERNEL_CHECKS)

    def make_backend(self):
        return _VecBlocks()


def test_vec_blocks_claim_a_subset():
    """The narrowed backend claims nothing the real one does not."""
    spec = kvabi.KVSpec("full", block_size=32, num_kv_heads=2, head_dim=64, dtype="float32")
    assert _VecBlocks().capabilities(spec).refusals(spec) == ()
    assert CpuVllmBackend().capabilities(spec).refusals(spec) == ()


class TestCpuVllmFp8(BackendConformance):
    """fp8 caches only (per-tensor scales drawn per layer, rounding toward zero), on the
    ``vec`` block sizes: every written code byte for byte (``quantize``: at every boundary
    of the recipe, under extreme scales too), attention within tolerance."""

    backend_name = "cpu.vllm"
    dtypes = ("float8_e4m3fn", "float8_e5m2")
    skip_checks = tuple(c.name for c in CHECKS if c.name not in
                        ("write_kv", "quantize", "attention", "poisoned_rows", "layouts"))

    def make_backend(self):
        return _VecBlocks()
