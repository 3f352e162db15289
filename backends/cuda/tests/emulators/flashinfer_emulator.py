"""An emulator of FlashInfer's paged-KV API, from its documentation.

Documented semantics emulated here:

- Paged KV as CSR: request b owns pages ``paged_kv_indices[indptr[b]:indptr[b+1]]``; all
  but the last are full; ``1 <= last_page_len[b] <= page_size``, so its kv length is
  ``(num_pages - 1) * page_size + last_page_len`` (a request without pages has none).
- ``kv_layout`` "NHD": K/V caches [pages, page_size, H, D]; "HND": [pages, H, page_size, D].
- ``causal`` (default False) aligns the mask bottom-right: query i of qo_len sees key j
  when ``j <= i + kv_len - qo_len``.  ``window_left`` (-1 = off) additionally keeps
  ``j >= i + kv_len - qo_len - window_left`` (so window_left + 1 keys).
- ``logits_soft_cap`` (None/0 = off): cap * tanh(x / cap) on the scaled logits x;
  ``sm_scale`` defaults to 1/sqrt(head_dim).
- ``run(..., sinks=...)``: a virtual token of logit sinks[h] joins each row's denominator.
- lse is returned base 2 (log2 of the sum of exp of the logits).
- Decode wrapper: one query per request, attending to all of its kv (with the window).
- ``append_paged_kv_cache``: token t goes to request ``batch_indices[t]`` at position
  ``positions[t]`` of its kv: page ``kv_indices[kv_indptr[b] + pos // page_size]``, row
  ``pos % page_size``.
"""
from __future__ import annotations

import math

import torch

from .attention_math import masked_attention

#: the emulator computes in float64: any float dtype and head size
kvabi_capabilities = {"dtypes": ("float32", "float16", "bfloat16"), "head_dims": None}


def _host(x):
    return x.detach().cpu().to(torch.int64) if isinstance(x, torch.Tensor) else \
        torch.as_tensor(x, dtype=torch.int64)


def _check_csr(indptr, indices, last, page_size):
    indptr, indices, last = _host(indptr), _host(indices), _host(last)
    assert indptr.ndim == 1 and int(indptr[0]) == 0, "indptr must start at 0"
    assert bool((indptr[1:] >= indptr[:-1]).all()), "indptr must be non-decreasing"
    assert len(indices) == int(indptr[-1]), "len(indices) must equal indptr[-1]"
    assert last.shape == (len(indptr) - 1,), "last_page_len: one entry per request"
    npages = indptr[1:] - indptr[:-1]
    has = npages > 0
    assert bool(((last[has] >= 1) & (last[has] <= page_size)).all()), \
        f"last_page_len must lie in [1, page_size={page_size}], got {last.tolist()}"
    assert bool((last[~has] == 0).all()), "a request without pages has last_page_len 0"
    kv_len = torch.clamp(npages - 1, min=0) * page_size + last
    return indptr, indices, kv_len


def _gather(cache, pages, kv_len, kv_layout):
    """[kv_len, H, D] keys (or values) of one request from its page list."""
    if kv_layout == "HND":
        cache = cache.permute(0, 2, 1, 3)
    x = cache[pages.to(cache.device)]  # [P, page_size, H, D]
    return x.reshape(-1, *x.shape[2:])[:kv_len]


class _Wrapper:
    def __init__(self, float_workspace_buffer, kv_layout="NHD"):
        assert kv_layout in ("NHD", "HND"), f"kv_layout {kv_layout!r}"
        self._kv_layout = kv_layout
        self._planned = None

    def _attend(self, q, paged_kv_cache, qo_indptr, sinks):
        p = self._planned
        assert p is not None, "plan() must be called before run()"
        k_cache, v_cache = paged_kv_cache
        assert k_cache.stride() == v_cache.stride(), "k/v strides differ"
        assert k_cache.stride(-1) == 1, "head_dim must be contiguous"
        qo = _host(qo_indptr)
        assert q.shape[0] == int(qo[-1]), "q rows must equal qo_indptr[-1]"
        assert q.shape[1] == p["num_qo_heads"], "num_qo_heads mismatch"
        ps = p["page_size"]
        page_dim = 1 if self._kv_layout == "NHD" else 2
        assert k_cache.shape[page_dim] == ps, "page_size mismatch with the cache"
        scale = p["sm_scale"] if p["sm_scale"] is not None else 1 / math.sqrt(q.shape[-1])
        cap = p["logits_soft_cap"] or None
        out = torch.zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
        indptr, indices, kv_len = p["csr"]
        for b in range(len(kv_len)):
            lo, hi = int(qo[b]), int(qo[b + 1])
            n, kl = hi - lo, int(kv_len[b])
            pages = indices[int(indptr[b]):int(indptr[b + 1])]
            k = _gather(k_cache, pages, kl, self._kv_layout)
            v = _gather(v_cache, pages, kl, self._kv_layout)
            i = torch.arange(n)[:, None]
            j = torch.arange(kl)[None, :]
            vis = torch.ones(n, kl, dtype=torch.bool)
            if p["causal"]:
                vis &= j <= i + kl - n
            if p["window_left"] >= 0:
                vis &= j >= i + kl - n - p["window_left"]
            o, l = masked_attention(q[lo:hi].cpu(), k.cpu(), v.cpu(), vis, scale, cap,
                                    None if sinks is None else sinks.cpu())
            out[lo:hi], lse[lo:hi] = o, l
        lse2 = lse / math.log(2.0)
        return out.to(q.dtype).to(q.device), lse2.float().to(q.device)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False,
             pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None,
             window_left=-1, logits_soft_cap=None, rope_scale=None, rope_theta=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking=True):
        assert num_qo_heads % num_kv_heads == 0
        self._qo_indptr = qo_indptr
        self._planned = dict(num_qo_heads=num_qo_heads, page_size=page_size, causal=causal,
                             sm_scale=sm_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap,
                             csr=_check_csr(paged_kv_indptr, paged_kv_indices,
                                            paged_kv_last_page_len, page_size))

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse=False, enable_pdl=None, window_left=None,
            sinks=None):
        assert window_left is None or window_left == self._planned["window_left"]
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],), \
                "sinks: float32, one per query head"
        o, l2 = self._attend(q, paged_kv_cache, self._qo_indptr, sinks)
        return (o, l2) if return_lse else o


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, sm_scale=None,
             non_blocking=True):
        assert num_qo_heads % num_kv_heads == 0
        n = len(_host(indptr)) - 1
        self._qo_indptr = torch.arange(n + 1)
        self._planned = dict(num_qo_heads=num_qo_heads, page_size=page_size, causal=True,
                             sm_scale=sm_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap,
                             csr=_check_csr(indptr, indices, last_page_len, page_size))

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse=False, enable_pdl=None):
        o, l2 = self._attend(q, paged_kv_cache, self._qo_indptr, None)
        return (o, l2) if return_lse else o


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len, kv_layout="NHD"):
    k_cache, v_cache = paged_kv_cache
    page_dim = 1 if kv_layout == "NHD" else 2
    ps = k_cache.shape[page_dim]
    indptr, indices, kv_len = _check_csr(kv_indptr, kv_indices, kv_last_page_len, ps)
    b, pos = _host(batch_indices), _host(positions)
    assert append_key.shape[0] == len(b) == len(pos), "one batch index and position per row"
    assert append_key.dtype == k_cache.dtype, "append_key must have the cache dtype"
    assert bool((pos < kv_len[b]).all()) and bool((pos >= 0).all()), \
        "positions must lie inside the request's kv after the append"
    page = indices[indptr[b] + pos // ps].to(k_cache.device)
    row = (pos % ps).to(k_cache.device)
    for cache, x in ((k_cache, append_key), (v_cache, append_value)):
        view = cache if kv_layout == "NHD" else cache.permute(0, 2, 1, 3)
        view[page, row] = x
