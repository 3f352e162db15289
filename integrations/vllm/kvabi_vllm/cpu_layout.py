"""The byte order vLLM's compiled CPU attention kernels (CPU_ATTN, ISAs ``vec`` and
``vec16``) read from their paged cache, and the copy of a kvabi cache into that order.

vLLM allocates each layer's cache as ``[blocks, kv_heads, block_size, 2 * head_dim]`` and
calls it ``LBHNC``; its kernels view that tensor as ``[blocks, kv_heads, 2 * block_size,
head_dim]`` and split it in two along the third axis. Within the ``block_size * head_dim``
elements of one block and head, the kernels' write (``cpu_attn_reshape_and_cache``) and
read put

- the **keys transposed**: element (token n, dim d) at ``d * block_size + n``;
- the **values** token-major: element (n, d) at ``n * head_dim + d``.

Keys and values of one block and head therefore use different strides for the same logical
axes, which one kvabi ``Layout`` (one stride per axis) cannot state: no preset, nor any
``Layout`` built directly, describes this cache byte for byte. ``cpu.vllm`` keeps K/V in
a kvabi layout and, per layer, copies the blocks a step reads into this order
(:func:`to_kernel_blocks`); ``tests/test_cpu_layout.py`` pins the order against the
kernel's own write.
"""
from __future__ import annotations

#: the ISAs whose tile order is the one above (checked against the kernels' own write)
KERNEL_ISAS = ("vec", "vec16")
#: head sizes the kernels are compiled for (vLLM's CPU_ATTN ``get_supported_head_sizes``)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: every block size must be a multiple of this (``vec16``'s block alignment; ``vec``: 32)
BLOCK_MULTIPLE = 16


def choose_isa(head_dim: int, block_size: int) -> str:
    """vLLM's choice among the two portable ISAs: ``vec`` needs head dims and block sizes
    that are multiples of 32, ``vec16`` multiples of 16 (AMX and the other architectures'
    ISAs are not used: their tile order is not the one this module states)."""
    return "vec" if head_dim % 32 == 0 and block_size % 32 == 0 else "vec16"


def kernel_scratch(torch, entries: int, heads: int, block_size: int, head_dim: int, dtype):
    """An uninitialized ``[entries, heads, 2 * block_size, head_dim]`` cache in kernel
    order, and its (key, value) halves as the kernels take them (4-D, same strides)."""
    s = torch.empty((entries, heads, 2 * block_size, head_dim), dtype=dtype)
    return s, s[:, :, :block_size], s[:, :, block_size:]


def to_kernel_blocks(kview, vview, blocks, key_cache, value_cache, hidden=None) -> None:
    """Copy blocks ``blocks`` (int64 tensor [E]) of a kvabi cache into kernel order.

    ``kview``/``vview``: the layer's strided ``[B, N, H, D]`` views (``KVCache.kv_view``);
    ``key_cache``/``value_cache``: the halves from :func:`kernel_scratch` (E entries).
    ``hidden`` (bool [E, N], optional): rows no query of the step may see; they are zeroed,
    so that NaN or inf there (any bytes: the rows belong to nobody) cannot reach a product.
    """
    e, h, n, d = key_cache.shape
    kt = key_cache.view(e, h, d, n)  # per (entry, head) one [D, N] tile: keys transposed
    kt.copy_(kview.index_select(0, blocks).permute(0, 2, 3, 1))
    value_cache.copy_(vview.index_select(0, blocks).permute(0, 2, 1, 3))
    if hidden is not None:
        kt.masked_fill_(hidden[:, None, None, :], 0)
        value_cache.masked_fill_(hidden[:, None, :, None], 0)


__all__ = ["BLOCK_MULTIPLE", "HEAD_SIZES", "KERNEL_ISAS", "choose_isa", "kernel_scratch",
           "to_kernel_blocks"]
