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
axes: the component preset ``vllm.cpu`` states this cache byte for byte (a key component
with ``N`` 1 element and ``E`` ``N`` elements apart, a value component ``N * D`` elements
into the tile with ``N`` ``D`` apart and ``E`` 1). ``tests/test_cpu_layout.py`` pins the
order against the kernel's own write.

The attention kernel takes keys and values as two tensors and reads only their block and
head strides (the same for both). So ``cpu.vllm`` reads both in place from a layout whose
key tiles are ``[D, N]`` and value tiles ``[N, D]`` (:func:`values_in_kernel_order`:
``vllm.cpu``, vLLM's own cache), and writes it with the kernels' own write; from a layout
whose key tiles alone are in kernel order (:func:`keys_in_kernel_order`: ``vllm.cpu_kt``,
``[L, B, H, 2, D, N]``) it reads the keys in place and copies only the values of the
step's blocks, token-major, into a scratch with the same strides
(:func:`values_to_kernel_order`). Any other layout has both copied, per entry of the
block table (:func:`to_kernel_blocks`).
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


def _tile(layout, name: str, n_stride: int, e_stride: int):
    """The (B, H) byte strides of component ``name`` when its (N, E) byte strides are
    ``(n_stride, e_stride)`` and it varies along B and H only otherwise (one plane per
    layer or L outermost), else None."""
    if (layout.is_axis_form and layout.packing not in (None, 1)) or \
            name not in layout.component_names:
        return None
    c = layout.component(name)
    st = c.strides
    if st.get("N") != n_stride or st.get("E", c.unit) != e_stride or \
            set(st) - {"L", "B", "H", "N", "E"} or "B" not in st or "H" not in st:
        return None
    return st["B"], st["H"]


def keys_in_kernel_order(layout) -> bool:
    """Whether every key tile of ``layout`` is a contiguous ``[D, N]`` (token fastest) and
    its block and head strides are whole value rows: the kernels can read such keys in
    place."""
    isz, n, d = layout.itemsize, layout.size("N"), layout.size("D")
    bh = _tile(layout, "key", isz, n * isz)
    return bh is not None and all(s % (d * isz) == 0 for s in bh)


def values_in_kernel_order(layout) -> bool:
    """Whether, besides :func:`keys_in_kernel_order`, every value tile is a contiguous
    ``[N, D]`` at the keys' block and head strides: the kernels read both in place (the
    layout is vLLM's own CPU cache, ``vllm.cpu``, or one of its orders)."""
    isz, n, d = layout.itemsize, layout.size("N"), layout.size("D")
    return keys_in_kernel_order(layout) and \
        _tile(layout, "value", d * isz, isz) == _tile(layout, "key", isz, n * isz)


def key_tiles(torch, kview):
    """The kernels' ``key_cache`` over a layout where :func:`keys_in_kernel_order` (or
    ``value_cache`` over the values where :func:`values_in_kernel_order`): the layer's
    ``[B, N, H, D]`` view permuted to ``[B, H, N, D]`` (the kernels use its block and head
    strides and its data pointer; within a tile they address ``[D, N]`` or ``[N, D]``
    themselves)."""
    return kview.permute(0, 2, 1, 3)


def _flat(torch, numel: int, dtype, buffer):
    """``numel`` elements: the start of ``buffer`` (1-D, ``dtype``, large enough), or new."""
    if buffer is None:
        return torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def value_scratch(torch, key_cache, dtype, buffer=None):
    """An uninitialized ``value_cache`` with ``key_cache``'s block and head strides and
    token-major ``[N, D]`` tiles (the kernels read both with the key cache's strides), and
    its buffer as value rows ``[rows, D]``: row ``(b * sB + h * sH) / D + n`` holds token
    n of block b, head h (strides in elements, multiples of D). ``buffer``: reuse the
    start of this 1-D tensor of ``dtype`` (at least :func:`value_scratch_numel`)."""
    b, h, n, d = key_cache.shape
    sb, sh = key_cache.stride(0), key_cache.stride(1)
    buf = _flat(torch, value_scratch_numel(key_cache), dtype, buffer)
    return torch.as_strided(buf, (b, h, n, d), (sb, sh, d, 1)), buf.view(-1, d)


def value_scratch_numel(key_cache) -> int:
    """Elements :func:`value_scratch` spans for ``key_cache``."""
    b, h, n, d = key_cache.shape
    return (b - 1) * key_cache.stride(0) + (h - 1) * key_cache.stride(1) + n * d


def values_to_kernel_order(vview, blocks, value_cache, rows, hidden=None) -> None:
    """Copy the values of cache blocks ``blocks`` (int64 [U], distinct) from the layer's
    ``[B, N, H, D]`` view into ``value_cache`` (from :func:`value_scratch`, with its value
    ``rows``), then zero the rows ``hidden`` (int64 row indices, optional): no query sees
    them, and the kernels multiply every value row of a block by its probability
    (0 * NaN is NaN) while they mask keys by select."""
    vals = vview.permute(0, 2, 3, 1).index_select(0, blocks)  # [U, H, D, N], runs of N
    value_cache[blocks] = vals.transpose(2, 3)  # index_put: ~1.7x faster than index_copy_
    if hidden is not None:
        rows.index_fill_(0, hidden, 0)


def kernel_scratch(torch, entries: int, heads: int, block_size: int, head_dim: int, dtype,
                   buffer=None):
    """An uninitialized ``[entries, heads, 2 * block_size, head_dim]`` cache in kernel
    order, and its (key, value) halves as the kernels take them (4-D, same strides);
    ``buffer``: reuse the start of this 1-D tensor of ``dtype``."""
    shape = (entries, heads, 2 * block_size, head_dim)
    s = _flat(torch, entries * heads * 2 * block_size * head_dim, dtype, buffer).view(shape)
    return s, s[:, :, :block_size], s[:, :, block_size:]


def to_kernel_blocks(kview, vview, blocks, scratch, hidden=None) -> None:
    """Copy blocks ``blocks`` (int64 tensor [E]) of a kvabi cache into kernel order.

    ``kview``/``vview``: the layer's strided ``[B, N, H, D]`` views (``KVCache.kv_view``);
    ``scratch``: ``[E, H, 2N, D]`` from :func:`kernel_scratch`. ``hidden`` (int64 tensor,
    optional): rows ``(entry * H + head) * 2N + N + token`` of the scratch as ``[rows, D]``,
    values no query of the step may see; they are zeroed (the kernels mask keys by select
    but multiply values by a zero probability, and 0 * NaN is NaN: the rows belong to
    nobody and may hold any bytes).
    """
    e, h, n2, d = scratch.shape
    n = n2 // 2
    kt = scratch[:, :, :n].view(e, h, d, n)  # per (entry, head) one [D, N] tile: transposed
    kt.copy_(kview.index_select(0, blocks).permute(0, 2, 3, 1))
    scratch[:, :, n:].copy_(vview.index_select(0, blocks).permute(0, 2, 1, 3))
    if hidden is not None:
        scratch.view(-1, d).index_fill_(0, hidden, 0)


__all__ = ["BLOCK_MULTIPLE", "HEAD_SIZES", "KERNEL_ISAS", "choose_isa", "kernel_scratch",
           "key_tiles", "keys_in_kernel_order", "to_kernel_blocks", "value_scratch", "value_scratch_numel", "values_in_kernel_order",
           "values_to_kernel_order"]
