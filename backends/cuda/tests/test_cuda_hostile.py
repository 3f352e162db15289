"""Hostile input on the CUDA backends (specs/security.md): rows no query may see hold NaN
and inf without changing the result, a cache of another layout (or too little memory, or
another framework) is refused before any kernel runs, and index arithmetic is int64
wherever a layout or a step can pass int32 (decided from sizes alone, so tested on layouts
far too large to allocate)."""
import numpy as np
import pytest
import torch

import kvabi
from kvabi import KVABIError, KVSpec, Layout
from kvabi.util.coerce import INT32_MAX

from cuda_testlib import (TOL, arr, compare, fill_layer, host, make_step, reference,
                          reference_layer, run_step, visible_slots)
from emulators import flash_attn_emulator, flashinfer_emulator
from kvabi_cuda import index_width, triton_attention, triton_write
from kvabi_cuda.flash_attn_backend import FlashAttnBackend
from kvabi_cuda.flashinfer_backend import FlashInferBackend

TRITON = kvabi.get_backend("cuda.triton")
BACKENDS = {"triton": lambda: TRITON,
            "flashinfer": lambda: FlashInferBackend(library=flashinfer_emulator, device="cpu"),
            "flash_attn": lambda: FlashAttnBackend(library=flash_attn_emulator, device="cpu")}


def _close(step, got, want, rows=slice(None)):
    atol, rtol = TOL[step.spec.dtype]
    np.testing.assert_allclose(got[rows], want[rows], atol=atol, rtol=rtol)


# -- poisoned invisible rows ------------------------------------------------------------

def _poison(cache, layer, slots, block_size, mla, seed):
    """NaN, +inf and -inf (drawn per element) in K and V at ``slots`` of ``layer``."""
    if not len(slots):
        return
    rng = np.random.default_rng(seed)
    blk = torch.as_tensor(slots // block_size)
    off = torch.as_tensor(slots % block_size)
    for kv in ((0,) if mla else (0, 1)):
        view = cache.kv_view(layer, kv)
        shape = (len(slots),) + tuple(view.shape[2:])
        vals = np.array([np.nan, np.inf, -np.inf])[rng.integers(0, 3, size=shape)]
        view[blk, off] = torch.as_tensor(vals, dtype=view.dtype)


POISON_CASES = {
    # kind, window/chunk, query lens, context lens: each leaves invisible rows in the
    # last block, before the window / in earlier chunks, and in unused blocks
    "full": dict(kind="full", query_lens=[2, 1], context_lens=[3, 6]),
    "window_decode": dict(kind="sliding_window", window=3, query_lens=[1, 1],
                          context_lens=[9, 4]),
    "window_prefill": dict(kind="sliding_window", window=2, query_lens=[4, 1],
                           context_lens=[6, 7]),
    "chunk": dict(kind="chunked_local", chunk=4, query_lens=[3, 1], context_lens=[9, 5]),
    "mla": dict(kind="mla", query_lens=[2, 1], context_lens=[5, 2], layout="vllm.BLNHC"),
}


def _poison_names(backend):
    if backend == "triton":
        return sorted(POISON_CASES)
    # The adapters' libraries mask within a kernel tile and multiply P by V: NaN in a
    # row inside a visible page but outside the window reaches the output through
    # 0 * NaN (README, "Invisible rows").  Whole pages past the window, past seq_len and
    # in other chunks (virtual batches) are never read.
    return ["full", "chunk"]


@pytest.mark.parametrize("backend, name", [(b, n) for b in sorted(BACKENDS)
                                           for n in _poison_names(b)])
def test_poisoned_invisible_rows_change_nothing(backend, name):
    be = BACKENDS[backend]()
    step = make_step(seed=17, group=2, block_size=4, **POISON_CASES[name])
    layout = step.layout()
    cache = be.allocate(layout)
    q = fill_layer(be, step, cache, layout, 1)
    seen = visible_slots(step)
    dirty = np.nonzero(~seen)[0]
    assert len(dirty) > 0
    _poison(cache, 1, dirty, step.spec.block_size, step.spec.is_mla, seed=3)
    _poison(cache, 0, np.arange(len(seen)), step.spec.block_size, step.spec.is_mla, seed=4)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    out, lse = be.attention(plan, cache, query=arr(be, q), layer=1, return_lse=True)
    want_o, want_l = reference_layer(step, 1)  # the clean cache
    a = step.meta.num_actual_tokens
    assert np.isfinite(host(out)[:a]).all()
    _close(step, host(out)[:a], want_o)
    _close(step, host(lse)[:a], want_l)


@pytest.mark.parametrize("kind", ["sliding_window", "chunked_local", "full"])
def test_triton_nonfinite_value_reaches_only_the_rows_that_see_it(kind):
    # One prefill tile holds rows that see key j and rows that may not (causal, window or
    # chunk edge): a NaN / inf value at j makes the first non-finite, the others exact.
    step = make_step(kind, window=3, chunk=4, query_lens=[6], context_lens=[2], group=2,
                     block_size=4, seed=23)
    layout = step.layout()
    ref_o, _ = reference_layer(step, 1)
    for poison in (float("nan"), float("inf"), float("-inf")):
        cache = TRITON.allocate(layout)
        q = fill_layer(TRITON, step, cache, layout, 1)
        j = 3  # the second token of the step: before it, causality hides it
        blk, off = int(step.meta.block_table[0, j // 4]), j % 4
        cache.kv_view(1, 1)[blk, off, :, 0] = poison
        plan = TRITON.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
        out = host(TRITON.attention(plan, cache, query=arr(TRITON, q), layer=1))
        pos = step.meta.positions[:6]
        lo = {"full": 0 * pos, "sliding_window": np.maximum(pos - 2, 0),
              "chunked_local": pos // 4 * 4}[kind]
        sees = (lo <= j) & (j <= pos)
        assert sees.any() and (~sees).any()
        _close(step, out, ref_o, rows=~sees)  # rows that may not see j: exact
        col = out[sees][..., 0]
        if poison != poison:
            assert np.isnan(col).all()
        else:
            assert (col == poison).all()
        assert np.isfinite(out[sees][..., 1:]).all()  # other columns untouched


# -- a cache of another layout is refused before any kernel runs -------------------------

class _NoLibrary:
    """A library whose every call fails the test: nothing may reach it."""

    kvabi_capabilities = flashinfer_emulator.kvabi_capabilities
    __name__ = "no library"

    def __getattr__(self, name):
        raise AssertionError(f"the library was called ({name}) after a refusal")


@pytest.fixture
def no_kernels(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a kernel ran on a refused cache")

    monkeypatch.setattr(triton_attention, "paged_attention", boom)
    monkeypatch.setattr(triton_write, "write_kv", boom)


def _planned(name, step, layout):
    be = BACKENDS[name]()
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    if name != "triton":  # from here on, any library call fails the test
        be._library = _NoLibrary()
    return be, plan


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_cache_of_another_layout_refused_before_any_kernel(name, no_kernels):
    step = make_step(query_lens=[2], context_lens=[3], seed=5, spare_blocks=14)
    big = Layout.preset("flash_attn", step.spec, 16)  # the plan's: 16 blocks
    small = Layout.preset("flash_attn", step.spec, 4)
    assert step.meta.num_blocks == 16
    be, plan = _planned(name, step, big)
    small_cache = kvabi.KVCache.allocate(small, "torch")
    k = arr(be, np.zeros((2, step.spec.num_kv_heads, 8), np.float32))
    q = arr(be, np.zeros((2, step.num_q_heads, 8), np.float32))
    for cache, match in ((small_cache, "cache: its layout"),
                         (list(kvabi.KVCache.allocate(big, "torch")), "must be a kvabi.KVCache"),
                         (kvabi.KVCache.allocate(big, "numpy"), "torch"),
                         ([torch.zeros(1)], "must be a kvabi.KVCache")):
        with pytest.raises(KVABIError, match=match):
            be.write_kv(plan, cache, key=k, value=k)
        with pytest.raises(KVABIError, match=match):
            be.attention(plan, cache, query=q)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_plane_over_too_little_memory_refused(name, no_kernels):
    # Planes padded to a bigger size than their elements span: a plane of the right
    # shape and strides over a buffer one element short of the layout's plane size is
    # refused (the layout addresses those bytes: a copy of the plane reaches them).
    def padded(spec, num_blocks, num_layers):
        natural = num_blocks * spec.block_size * spec.num_kv_heads * spec.head_dim * 4
        return Layout(order=("B", "N", "H", "D"), planes=("L", "KV"),
                      sizes={"L": num_layers, "B": num_blocks, "KV": 2, "N": spec.block_size,
                             "H": spec.num_kv_heads, "D": spec.head_dim},
                      plane_bytes=natural + 64, dtype=spec.dtype)

    step = make_step(query_lens=[1], context_lens=[2], seed=6, layout=padded)
    layout = step.layout()
    be, plan = _planned(name, step, layout)
    n = index_width.plane_elements(layout) - 1
    short = [torch.zeros(n).as_strided(layout.plane_shape, layout.plane_strides)
             for _ in range(layout.num_planes)]
    with pytest.raises(KVABIError, match="memory"):
        kvabi.KVCache.wrap(layout, short)  # where memory enters: no backend sees it
    q = arr(be, np.zeros((1, step.num_q_heads, 8), np.float32))
    with pytest.raises(KVABIError, match="must be a kvabi.KVCache"):
        be.attention(plan, short, query=q)


# -- index width --------------------------------------------------------------------------

def _huge(num_blocks, spec=None, name="flash_attn", layers=1):
    spec = spec or KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128,
                          dtype="float16")
    return Layout.preset(name, spec, num_blocks, layers)


def test_index_width_follows_the_layouts_size():
    spec = KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
    for name, layers, per_block in (("flash_attn", 1, 16 * 8 * 128),  # K or V, one layer
                                    ("vllm.BLHNC", 32, 32 * 2 * 16 * 8 * 128)):  # all
        fits = INT32_MAX // per_block  # the most blocks whose every offset fits in int32
        assert index_width.plane_elements(_huge(fits, spec, name, layers)) <= INT32_MAX
        assert not index_width.needs_int64(_huge(fits, spec, name, layers))
        assert index_width.needs_int64(_huge(fits + 1, spec, name, layers))
    # Positions near int32's limit, token counts and step tensors too.
    small = _huge(4, spec)
    assert index_width.needs_int64(small, max_seq_len=INT32_MAX - 10)
    assert not index_width.needs_int64(small, max_seq_len=1 << 30)
    assert index_width.needs_int64(small, extents=[INT32_MAX + 1])


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer.HND", "vllm.BLHNC",
                                  "vllm.LBNHC"])
def test_every_offset_a_view_forms_is_below_the_plane_size(name):
    # The int32 choice is sound: the furthest element a [B, N, H, D] view of any layer
    # addresses (its base plus its extent) is inside the plane, whose size decided.
    spec = KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
    lay = _huge(1 << 20, spec, name, 4)  # 2**20 blocks: never allocated
    isz = lay.itemsize
    shape = tuple(lay.size(a) for a in "BNHD")
    strides = tuple(lay.stride(a) // isz for a in "BNHD")
    for layer in range(4):
        for kv in (0, 1):
            _, base = lay.byte_offset(layer=layer, kv=kv)
            last = base // isz + index_width.extent(shape, strides) - 1
            assert last < index_width.plane_elements(lay)
            _, far = lay.byte_offset(layer=layer, kv=kv, block=shape[0] - 1,
                                     token=shape[1] - 1, head=shape[2] - 1,
                                     dim=shape[3] - 1)
            assert far // isz == last
    assert index_width.needs_int64(lay)


def test_triton_plan_for_a_huge_layout_indexes_in_int64():
    # Planning needs only the metadata and the layout: no cache is allocated.
    spec = KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype="float16")
    huge = _huge(1 << 20, spec)  # 2**20 blocks * 32768 elements: 2**35 per plane
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [1, 2], [5, 16], [[(1 << 20) - 1, 0], [7, (1 << 20) - 2]], 16, num_blocks=1 << 20)
    plan = TRITON.plan(meta, spec, huge, num_q_heads=16).prepared
    assert plan.idx64 and plan.block_table.dtype == torch.int64
    assert all(t.dtype == torch.int64 for t in plan._tiles[next(iter(plan._tiles))])
    assert plan.block_table[0, 0] == (1 << 20) - 1 and plan.block_table[1, 1] == (1 << 20) - 2
    small = TRITON.plan(meta.__class__.from_lengths([1], [3], [[0]], 16, num_blocks=4), spec,
                        _huge(4, spec), num_q_heads=16).prepared
    assert not small.idx64 and small.block_table.dtype == torch.int32


def test_unused_block_table_entries_are_never_cast_blindly():
    # Garbage past a request's blocks is never read: the plan zeroes it instead of
    # wrapping it into a valid-looking id.
    step = make_step(query_lens=[1, 1], context_lens=[1, 6], block_size=4, seed=2)
    bt = step.meta.block_table.astype(np.int64).copy()
    assert bt.shape[1] == 2
    bt[0, 1] = 3  # request 0 uses one block
    meta = kvabi.CommonAttentionMetadata.from_lengths([1, 1], [1, 6], bt, 4,
                                                      num_blocks=step.meta.num_blocks)
    plan = TRITON.plan(meta, step.spec, step.layout(), num_q_heads=step.num_q_heads).prepared
    assert int(plan.block_table[0, 1]) == 0 and int(plan.block_table[1, 1]) == bt[1, 1]


@pytest.mark.parametrize("kind", ["full", "sliding_window", "chunked_local", "mla"])
def test_triton_int64_kernels_match_the_reference(kind, monkeypatch):
    # The int64 code paths of both kernels, forced on a small layout, give the same bytes
    # and the same attention as the reference.
    from kvabi_cuda import triton_backend

    monkeypatch.setattr(triton_backend, "needs_int64", lambda *a, **k: True)
    step = make_step(kind, window=3, chunk=4, query_lens=[3, 1], context_lens=[4, 6],
                     layout="vllm.BLNHC" if kind == "mla" else "flashinfer.HND", seed=19)
    plan = TRITON.plan(step.meta, step.spec, step.layout(), num_q_heads=step.num_q_heads)
    assert plan.prepared.idx64
    got, want = run_step(TRITON, step), run_step(reference(), step)
    compare(step, got, want)
    for g, w in zip(got[2], want[2]):
        np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint8),
                                      np.ascontiguousarray(w).view(np.uint8))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_issue_10_lengths_never_reach_a_kernel(name, no_kernels):
    # The reproduction of issue 10: context_lens=[2**31 - 1] once wrapped seq_lens and
    # wrote past the cache.  It is refused with a KVABIError naming the length, and a
    # plan cannot be built from it.
    spec = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=8)
    with pytest.raises(KVABIError, match="seq_len|context_lens"):
        meta = kvabi.CommonAttentionMetadata.from_lengths([1], [INT32_MAX], [[0]], 16,
                                                          num_blocks=4)
        BACKENDS[name]().plan(meta, spec, Layout.preset("flash_attn", spec, 4), num_q_heads=2)


def test_library_indices_past_int32_are_refused_not_wrapped():
    # FlashInfer's CSR pages and flash-attn's cumulative key lengths are int32 in the
    # libraries: a value past int32 is an UnsupportedError naming the argument.
    from kvabi import UnsupportedError
    from kvabi_cuda.flash_attn_args import flash_attn_args
    from kvabi_cuda.paged_csr import pages_csr

    with pytest.raises(UnsupportedError, match="paged_kv_indices"):
        pages_csr([16], [[INT32_MAX + 1]], 16)  # a block id of a pool past 2**31 blocks
    with pytest.raises(UnsupportedError, match="paged_kv_indptr"):
        pages_csr([INT32_MAX] * 2, np.zeros((2, 1), np.int64), 1)  # pages in all past int32
    bs = 1 << 20  # two requests of 2**30 + 1 keys: each fits int32, their sum does not
    spec = KVSpec("full", block_size=bs, num_kv_heads=1, head_dim=8, dtype="float16")
    need = -(-((1 << 30) + 1) // bs)
    bt = np.arange(2 * need).reshape(2, need)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1, 1], [1 << 30, 1 << 30], bt, bs,
                                                      num_blocks=2 * need)
    with pytest.raises(UnsupportedError, match="cu_seqlens_k"):
        flash_attn_args(meta, spec, scale=1.0)
    small = kvabi.CommonAttentionMetadata.from_lengths([1], [1 << 30], bt[:1], bs,
                                                       num_blocks=2 * need)
    args = flash_attn_args(small, spec, scale=1.0)
    assert args["cu_seqlens_k"].tolist() == [0, (1 << 30) + 1]
    assert args["block_table"].dtype == np.int32
