"""kvabi's conformance kit against the CUDA backends.

``cuda.triton`` runs here in Triton's interpreter (few examples: each launch is slow).  The
library adapters need a CUDA device and the libraries: those classes are marked ``gpu``
(skipped without one; the kit also skips an unavailable backend).
"""
import pytest

from kvabi.testing import BackendConformance


class TestTritonConformance(BackendConformance):
    backend_name = "cuda.triton"
    max_examples = 6


@pytest.mark.gpu
class TestFlashInferConformance(BackendConformance):
    backend_name = "cuda.flashinfer"


@pytest.mark.gpu
class TestFlashAttnConformance(BackendConformance):
    backend_name = "cuda.flash_attn"


class TestEmulatedFlashInferConformance(BackendConformance):
    """The whole FlashInfer adapter, with the library replaced by the documented-semantics
    emulator, through the kit on CPU."""

    backend_name = "cuda.flashinfer"
    max_examples = 6

    def make_backend(self):
        from emulators import flashinfer_emulator
        from kvabi_cuda.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(library=flashinfer_emulator, device="cpu")


class TestEmulatedFlashAttnConformance(BackendConformance):
    """The flash-attn adapter with its emulator, through the kit on CPU."""

    backend_name = "cuda.flash_attn"
    max_examples = 6

    def make_backend(self):
        from emulators import flash_attn_emulator
        from kvabi_cuda.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend(library=flash_attn_emulator, device="cpu")
