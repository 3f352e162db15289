"""Indices the TPU kernels take are exact for any cache size, and a plan addresses only its
own layout: huge layouts are planned (never allocated here) with exact (block, offset)
write indices; what int32 cannot hold is refused with a KVABIError naming the size; a plan
used with another layout's cache, and block ids outside the layout, are refused before any
kernel runs (the cache is not even consumed)."""
from __future__ import annotations

import numpy as np
import pytest

from tpu_helpers import JAX, PALLAS, make_spec

import kvabi
from kvabi.util.tensors import to_jax, to_numpy
from kvabi import KVABIError
from kvabi.memory.views import allocate_numpy

BACKENDS = [PALLAS, JAX]
ids = lambda b: b.name  # noqa: E731


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_layout_past_2_31_slots_plans_exact_indices(backend):
    """2**32 slots: writes into the last block and into block 2**26 (slot 2**31 exactly)
    keep their block and offset; nothing wraps to another block."""
    spec = make_spec("full", 32, 1, 128, "float32")
    nb = 2**27
    layout = kvabi.Layout.preset("tpu.combined", spec, nb)
    assert kvabi.index_dtype(layout, spec) == np.int64
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 2, 0], [30, 0, 0],
                                                      [[9, nb - 1], [nb // 2, 0], [0, 0]],
                                                      32, num_blocks=nb, num_tokens=7)
    slots = meta.slot_mapping[:5]
    assert slots.max() == 2**32 - 32 and 2**31 in slots  # an int32 slot would wrap
    plan = backend.plan(meta, spec, layout, num_q_heads=1)
    arrays = [np.asarray(a) for a in plan.prepared.write_args]
    if backend is JAX:
        blk, off = (a.astype(np.int64) for a in arrays)
        np.testing.assert_array_equal(blk[:5] * 32 + off[:5], slots)
        assert (blk[5:] == nb).all()  # padding tokens: a block the scatter drops
    else:
        sl, (count,) = arrays
        rows = sl[:, :count].astype(np.int64)  # block, offset, first token, length
        got = np.full(7, -1, np.int64)
        for b, o, t, n in rows.T:
            got[t:t + n] = b * 32 + o + np.arange(n)
        np.testing.assert_array_equal(got, meta.slot_mapping)
    table = np.asarray(plan.prepared.page_table)
    assert table[0, 1] == nb - 1 and table[1, 0] == nb // 2


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_what_int32_cannot_hold_is_refused(backend):
    spec = make_spec("full", 16, 1, 128, "float32")
    nb = 2**31
    layout = kvabi.Layout.preset("tpu.combined", spec, nb)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1], [0], [[nb - 1]], 16,
                                                      num_blocks=nb)
    with pytest.raises(KVABIError, match=f"layout.num_blocks: {nb} blocks"):
        backend.plan(meta, spec, layout, num_q_heads=1)
    bs = 2**16  # a sequence of 2**31 - 1 tokens: positions near int32's end
    spec = make_spec("full", bs, 1, 128, "float32")
    layout = kvabi.Layout.preset("tpu.hidden", spec, 4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1], [2**31 - 2],
                                                      np.zeros((1, 2**15), np.int64), bs,
                                                      num_blocks=4)
    with pytest.raises(KVABIError, match="seq_lens"):
        backend.plan(meta, spec, layout, num_q_heads=1)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_plan_of_another_layout_refused_before_any_kernel(backend):
    """A 16-block plan with a 4-block cache (or a plain list, or numpy planes): refused,
    and the cache is not consumed."""
    spec = make_spec("full", 16, 1, 64, "float32")
    big = kvabi.Layout.preset("tpu.combined", spec, 16)
    small = kvabi.Layout.preset("tpu.combined", spec, 4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 1], [0, 40], [[15, 0, 0],
                                                      [12, 13, 14]], 16, num_blocks=16)
    plan = backend.plan(meta, spec, big, num_q_heads=2)
    cache = backend.allocate(small)
    k = to_jax(np.ones((4, 1, 64), np.float32))
    q = to_jax(np.ones((4, 2, 64), np.float32))
    with pytest.raises(KVABIError, match="cache: its layout .* is not the plan's "
                                         r"\(tpu.combined of 16 blocks"):
        backend.attention(plan, cache, query=q)
    with pytest.raises(KVABIError, match="cache: its layout"):
        backend.write_kv(plan, cache, key=k, value=k)
    with pytest.raises(KVABIError, match="cache: must be a kvabi.KVCache"):
        backend.write_kv(plan, list(backend.allocate(big)), key=k, value=k)
    assert not cache[0].is_deleted()
    with pytest.raises(KVABIError, match="numpy planes"):
        backend.write_kv(plan, kvabi.KVCache.wrap(big, allocate_numpy(big, 0)), key=k, value=k)
    # an equal layout (e.g. from a JSON round trip) is the same layout
    twin = kvabi.Layout.from_json(big.to_json())
    assert twin is not big
    backend.write_kv(plan, backend.allocate(twin), key=k, value=k)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_blocks_outside_the_layout_refused(backend):
    """Block ids past the layout are refused at plan time (tpu.jax's scatter would
    otherwise drop those writes silently)."""
    spec = make_spec("full", 16, 1, 64, "float32")
    layout = kvabi.Layout.preset("tpu.hidden", spec, 4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 1], [0, 16], [[1, 0], [2, 7]],
                                                      16, num_blocks=8)
    with pytest.raises(KVABIError, match="block_table"):
        backend.plan(meta, spec, layout, num_q_heads=1)
