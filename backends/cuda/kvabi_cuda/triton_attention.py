"""Triton kernel: paged attention for mixed batches (decode and prefill in one launch).

Grid: (query tiles, KV heads).  A tile is up to ``BLOCK_Q`` consecutive query tokens of one
request; its rows are (token, query head of the KV head's GQA group) pairs, so one program
loads each key/value tile once for the whole group.  Keys are gathered through the block
table from any strided [B, N, H, D] cache view (Triton specializes a D stride of 1, the
usual case, at compile time).  Online softmax in
float32; masks follow kvabi's canonical semantics: causal bottom-right (key j <= position
p), sliding window W (j > p - W), chunked local C (j // C == p // C), soft cap
``cap * tanh(x / cap)`` on the scaled logits, and an optional per-query-head sink logit
that joins the softmax denominator only.  Returns natural-log lse.

Masks are applied by select (``tl.where``), never by adding -inf, and values no row may see
are zeroed before P.V: NaN or inf in keys/values outside a row's window or chunk, or past
its sequence, cannot change its output.  Index arithmetic is int32 or, when the plan found
an offset or position past int32 (:mod:`kvabi_cuda.index_width`), int64 (``IDX64``).
"""
from __future__ import annotations

import numpy as np

from .runtime import pow2, triton_mode

triton_mode()  # must run before the kernels below are decorated: it may enable the interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: mask kinds (constexpr MASK)
FULL, WINDOW, CHUNK = 0, 1, 2


@triton.jit
def _tanh(x):
    # tanh from exp (portable across compiled and interpreted Triton); clamped so exp
    # cannot overflow: tanh(15) == 1 in float32.
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    e = tl.exp(2.0 * x)
    return (e - 1.0) / (e + 1.0)


@triton.jit
def _nonfinite_pv(contrib, p, v, DOT_PRECISION: tl.constexpr):
    """P.V where non-finite V entries count only for the rows that see them (p > 0).

    ``contrib`` is P.V with those entries zeroed.  A row whose visible keys hold a NaN (or
    both +inf and -inf) in a column gets NaN there, +inf or -inf alone gives that inf:
    what an exact sum would give, without the 0 * NaN of a plain product poisoning the
    rows that may not see the key."""
    seen = (p > 0).to(v.dtype)
    # counts of 0/1 products: exact in any dot precision
    nan = tl.dot(seen, (v != v).to(v.dtype), input_precision=DOT_PRECISION)
    pinf = tl.dot(seen, (v == float("inf")).to(v.dtype), input_precision=DOT_PRECISION)
    ninf = tl.dot(seen, (v == float("-inf")).to(v.dtype), input_precision=DOT_PRECISION)
    contrib = tl.where(pinf > 0, float("inf"), contrib)
    contrib = tl.where(ninf > 0, float("-inf"), contrib)
    return tl.where((nan > 0) | ((pinf > 0) & (ninf > 0)), float("nan"), contrib)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sink_ptr,
    bt_ptr, ctx_ptr, qsl_ptr, tile_req_ptr, tile_tok_ptr, tile_len_ptr,
    sq_t, sq_h, sq_d,  # query [T, Hq, D] strides
    sk_b, sk_n, sk_h, sk_d, sv_b, sv_n, sv_h, sv_d,  # cache view strides (D: 1 is usual)
    so_t, so_h, so_d,  # output [T, Hq, Dv] strides
    s_bt,  # block table row stride
    num_hq, group, head_dim, head_dim_v, block_size,
    scale, softcap, span,
    MASK: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr, IDX64: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.load(tile_req_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    n = tl.load(tile_len_ptr + tile)
    p0 = tl.load(ctx_ptr + r) + tok0 - tl.load(qsl_ptr + r)  # position of the tile's 1st token

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    m = tl.arange(0, BLOCK_M)
    ti = m // BLOCK_G
    g = m % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    if IDX64:
        # Index products in int64: the plan found an offset or position past int32.
        kvh = kvh.to(tl.int64)
        p0 = p0.to(tl.int64)
        ti = ti.to(tl.int64)
        g = g.to(tl.int64)
        d = d.to(tl.int64)
        dv = dv.to(tl.int64)
    row_ok = (ti < n) & (g < group)
    tok = (tok0 + ti).to(tl.int64)
    qh = kvh * group + g
    pos = p0 + ti

    q = tl.load(q_ptr + tok[:, None] * sq_t + qh[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & (d[None, :] < head_dim), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    # Keys this tile can see: [lo, hi).
    hi = p0 + n
    lo = p0 * 0
    if MASK == 1:
        lo = tl.maximum(p0 - span + 1, 0)
    if MASK == 2:
        lo = (p0 // span) * span

    if HAS_SINKS:
        m_i = tl.load(sink_ptr + qh, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        blk = tl.load(bt_ptr + r.to(tl.int64) * s_bt + j // block_size, mask=j_ok, other=0)
        if IDX64:
            blk = blk.to(tl.int64)
        off = j % block_size
        kt = tl.load(k_ptr + blk[None, :] * sk_b + off[None, :] * sk_n + kvh * sk_h
                     + d[:, None] * sk_d,
                     mask=j_ok[None, :] & (d[:, None] < head_dim), other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        vis = row_ok[:, None] & j_ok[None, :] & (j[None, :] <= pos[:, None])
        if MASK == 1:
            vis = vis & (j[None, :] > pos[:, None] - span)
        if MASK == 2:
            vis = vis & ((j[None, :] // span) == (pos[:, None] // span))
        # Select, never add: a NaN or inf key the row may not see must not reach it.
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + blk[:, None] * sv_b + off[:, None] * sv_n + kvh * sv_h
                    + dv[None, :] * sv_d,
                    mask=j_ok[:, None] & (dv[None, :] < head_dim_v), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        # Values no row of the tile may see are zeroed (0 * NaN would poison P.V) ...
        seen_by_any = tl.max(vis.to(tl.int32), 0) > 0
        v = tl.where(seen_by_any[:, None], v, 0.0)
        bad = (v != v) | (tl.abs(v) == float("inf"))
        v_fin = tl.where(bad, 0.0, v)
        contrib = tl.dot(p.to(v.dtype), v_fin, input_precision=DOT_PRECISION)
        # ... and non-finite values seen by some rows reach only those rows.
        if tl.max(tl.max(bad.to(tl.int32), 1), 0) > 0:
            contrib = _nonfinite_pv(contrib, p, v, DOT_PRECISION)
        acc = acc * alpha[:, None] + contrib
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(o_ptr + tok[:, None] * so_t + qh[:, None] * so_h + dv[None, :] * so_d,
             out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv[None, :] < head_dim_v))
    if STORE_LSE:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + tok * num_hq + qh, lse, mask=row_ok)


def block_sizes(group: int, max_query_len: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_Q, BLOCK_G, BLOCK_N) for a GQA group size and the step's longest query.

    ``tl.dot`` needs every dimension >= 16 when compiled, so BLOCK_Q * BLOCK_G >= 16.
    The interpreter pays per operation, not per element: it gets bigger key tiles.
    """
    bg = pow2(max(group, 1))
    bq_min = max(1, 16 // bg)
    bq = min(max(bq_min, pow2(max(max_query_len, 1))), max(bq_min, 64 // bg))
    bn = 64 if interpret else 32
    return bq, bg, bn


def query_tiles(query_start_loc: np.ndarray, block_q: int, dtype=np.int32):
    """(request, first token, token count) of every query tile, vectorized: requests split
    into runs of ``block_q`` tokens; requests without query tokens get no tile."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    qlen = np.diff(qsl)
    ntile = -(-qlen // block_q)
    req = np.repeat(np.arange(len(qlen), dtype=np.int64), ntile)
    first = np.zeros(len(ntile) + 1, np.int64)
    np.cumsum(ntile, out=first[1:])
    i = np.arange(int(first[-1]), dtype=np.int64) - first[req]
    tok = qsl[req] + i * block_q
    length = np.minimum(block_q, qsl[req + 1] - tok)
    return req.astype(dtype), tok.astype(dtype), length.astype(dtype)


def paged_attention(q, k_view, v_view, out, lse, sinks, block_table, ctx, qsl, tiles, *,
                    group: int, head_dim: int, head_dim_v: int, block_size: int,
                    scale: float, softcap, mask: int, span: int, upcast: bool,
                    block_q: int, block_g: int, block_n: int, idx64: bool) -> None:
    """Launch the kernel: ``out`` [T, Hq, Dv] (any strides) and ``lse`` [T, Hq] (float32,
    contiguous; None: not stored) are written at the real tokens' rows.  ``tiles`` =
    (request, first token, count) device tensors."""
    tile_req, tile_tok, tile_len = tiles
    n_tiles = int(tile_req.shape[0])
    num_kv = int(k_view.shape[2])
    if n_tiles == 0:
        return
    sink_arg = sinks if sinks is not None else ctx  # unused when HAS_SINKS is off
    _paged_attention_kernel[(n_tiles, num_kv)](
        q, k_view, v_view, out, lse if lse is not None else ctx, sink_arg,
        block_table, ctx, qsl, tile_req, tile_tok, tile_len,
        q.stride(0), q.stride(1), q.stride(2),
        *k_view.stride(), *v_view.stride(),
        out.stride(0), out.stride(1), out.stride(2), block_table.stride(0),
        q.shape[1], group, head_dim, head_dim_v, block_size,
        float(scale), float(softcap or 1.0), int(span),
        MASK=mask, SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        STORE_LSE=lse is not None, IDX64=bool(idx64),
        # float32 must not silently drop to TF32 on tensor cores: IEEE products there.
        UPCAST=upcast, DOT_PRECISION="ieee" if upcast else "tf32", BLOCK_Q=block_q,
        BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D=max(16, pow2(head_dim)),
        BLOCK_DV=max(16, pow2(head_dim_v)),
    )
