"""Triton kernel: write new K (and V) into a paged cache by slot mapping.

Each program writes a run of tokens.  The destination is any strided [B, N, H, D] view
(what :meth:`kvabi.Layout.kv_view` gives for every layout), so one kernel serves every
layout; Triton specializes the usual D stride of 1 at compile time.  Slot -1 (padding) is
masked out: never written.  Offsets are int32 products or, when the plan found an offset
past int32 (:mod:`kvabi_cuda.index_width`), int64 ones (``IDX64``).
"""
from __future__ import annotations

from .runtime import pow2, triton_mode

triton_mode()  # must run before the kernel below is decorated: it may enable the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _write_kv_kernel(
    k_src, v_src, k_dst, v_dst, slots, num_tokens,
    sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,  # element strides of the new K/V [T, H, D]
    dk_b, dk_n, dk_h, dk_d, dv_b, dv_n, dv_h, dv_d,  # strides of the cache views [B, N, H, D]
    block_size, num_heads, head_dim, head_dim_v,
    HAS_V: tl.constexpr, IDX64: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Rows are (token, head) pairs of BLOCK_T consecutive tokens.
    r = tl.arange(0, BLOCK_T * BLOCK_H)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + r // BLOCK_H
    h = r % BLOCK_H
    row_ok = (t < num_tokens) & (h < num_heads)
    slot = tl.load(slots + t, mask=row_ok, other=-1)  # int64
    row_ok = row_ok & (slot >= 0)  # slot -1: padding, never written
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, BLOCK_D)
    if IDX64:
        h = h.to(tl.int64)
        d = d.to(tl.int64)
    else:
        # Every offset into the layout fits in int32 (the plan checked): cheaper products.
        blk = blk.to(tl.int32)
        off = off.to(tl.int32)
    mask = row_ok[:, None] & (d[None, :] < head_dim)
    x = tl.load(k_src + t[:, None] * sk_t + h[:, None] * sk_h + d[None, :] * sk_d, mask=mask)
    dst = (k_dst + blk[:, None] * dk_b + off[:, None] * dk_n + h[:, None] * dk_h
           + d[None, :] * dk_d)
    tl.store(dst, x.to(k_dst.dtype.element_ty), mask=mask)
    if HAS_V:
        dv = tl.arange(0, BLOCK_DV)
        if IDX64:
            dv = dv.to(tl.int64)
        mask_v = row_ok[:, None] & (dv[None, :] < head_dim_v)
        y = tl.load(v_src + t[:, None] * sv_t + h[:, None] * sv_h + dv[None, :] * sv_d,
                    mask=mask_v)
        dst_v = (v_dst + blk[:, None] * dv_b + off[:, None] * dv_n + h[:, None] * dv_h
                 + dv[None, :] * dv_d)
        tl.store(dst_v, y.to(v_dst.dtype.element_ty), mask=mask_v)


def tokens_per_program(num_heads: int, head_dim: int, interpret: bool) -> int:
    """Tokens one program writes: about 4K elements per tile when compiled; the interpreter
    pays per program and per operation, so it gets much bigger tiles."""
    per_token = pow2(num_heads) * pow2(head_dim)
    budget = (1 << 16) if interpret else (1 << 12)
    return max(1, min(256, pow2(max(1, budget // per_token))))


def write_kv(key, value, k_view, v_view, slots, block_size: int, *,
             interpret: bool = False, idx64: bool = True) -> None:
    """Scatter ``key`` [T, H, D] (and ``value`` [T, H, Dv], or None) into the cache views
    at ``slots`` [T] (int64; -1 skipped).  Tensors on the kernel's device, any strides.
    ``idx64=False`` only where every offset into the views fits in int32."""
    t, h, d = key.shape
    if t == 0:
        return
    has_v = value is not None
    if has_v:
        dvh = value.shape[2]
    else:
        value, v_view, dvh = key, k_view, d  # unused: HAS_V is off
    bt = tokens_per_program(h, max(d, dvh), interpret)
    _write_kv_kernel[(-(-t // bt),)](
        key, value, k_view, v_view, slots, t,
        *key.stride(), *value.stride(), *k_view.stride(), *v_view.stride(),
        block_size, h, d, dvh,
        HAS_V=has_v, IDX64=bool(idx64), BLOCK_T=bt, BLOCK_H=pow2(h),
        BLOCK_D=pow2(d), BLOCK_DV=pow2(dvh),
    )
