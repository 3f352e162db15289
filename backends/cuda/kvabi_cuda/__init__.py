"""kvabi attention backends for CUDA: ``cuda.triton`` (this project's Triton kernels,
compiled on a GPU or interpreted on CPU), ``cuda.flashinfer`` and ``cuda.flash_attn``
(adapters onto those libraries' paged APIs).  Registered through the ``kvabi`` entry-point
group by :mod:`kvabi_cuda.plugin`."""

__version__ = "0.1.0"
