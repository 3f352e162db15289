"""kvabi transforms through the TPU backends at model-like sizes (head dim 128, 16-token
pages): prefill skip for KV-sharing layers, and chunked local attention computed as plain
causal attention over local virtual batches.  The kit checks the same at small sizes."""
from __future__ import annotations

import numpy as np
import pytest

from tpu_helpers import (JAX, PALLAS, REFERENCE, TOL, filled_cache, make_spec, rel_l2,
                         to_backend, values)

import kvabi
from kvabi.util.tensors import to_jax, to_numpy
from kvabi import transforms

META = dict(query_lens=[1, 23, 0, 9], context_lens=[40, 0, 7, 18],
            block_table=[[5, 1, 8, 0], [2, 9, 3, 6], [4, 4, 4, 4], [7, 10, 11, 12]])


def meta_of(block_size=16):
    return kvabi.CommonAttentionMetadata.from_lengths(
        META["query_lens"], META["context_lens"], META["block_table"], block_size,
        num_blocks=13, num_tokens=35)


@pytest.mark.parametrize("backend", [PALLAS, JAX], ids=lambda b: b.name)
def test_prefill_skip_rows_equal_full_attention(backend):
    """A KV-sharing layer runs only each request's last token: its outputs equal the full
    computation's at those tokens (cache already written by the owner layer)."""
    spec = make_spec("full", 16, 2, 128, "bfloat16")
    meta = meta_of()
    layout = kvabi.Layout.preset("tpu.combined", spec, 13)
    rng = np.random.default_rng(0)
    planes = filled_cache(layout, spec, rng)
    q = values(rng, (meta.num_tokens, 8, 128), "bfloat16")
    want = REFERENCE.attention(REFERENCE.plan(meta, spec, layout, num_q_heads=8), planes,
                               query=q)
    short, idx = transforms.prefill_skip(meta)
    cache = to_backend(backend, planes)
    got = backend.attention(backend.plan(short, spec, layout, num_q_heads=8), cache,
                            query=to_jax(q[idx]))
    assert rel_l2(to_numpy(got), want[idx]) <= TOL["bfloat16"]


@pytest.mark.parametrize("backend", [PALLAS, JAX], ids=lambda b: b.name)
def test_local_virtual_batches_equal_chunked_local(backend):
    """Chunked local attention (chunk 32 = two pages) two ways through the backend: directly
    from the spec, and as full attention over local_virtual_batches; both equal the
    reference's chunked local attention."""
    local = make_spec("chunked_local", 16, 1, 128, "float32", 32)
    full = make_spec("full", 16, 1, 128, "float32")
    meta = meta_of()
    layout = kvabi.Layout.preset("tpu.hidden", local, 13)
    rng = np.random.default_rng(1)
    planes = filled_cache(layout, local, rng)
    q = values(rng, (meta.num_tokens, 4, 128), "float32")
    n = meta.num_actual_tokens
    want = REFERENCE.attention(REFERENCE.plan(meta, local, layout, num_q_heads=4), planes,
                               query=q)[:n]
    cache = to_backend(backend, planes)
    direct = backend.attention(backend.plan(meta, local, layout, num_q_heads=4), cache,
                               query=to_jax(q))
    assert rel_l2(to_numpy(direct)[:n], want) <= TOL["float32"]
    virtual, _ = transforms.local_virtual_batches(meta, 32)
    via = backend.attention(backend.plan(virtual, full, layout, num_q_heads=4), cache,
                            query=to_jax(q))
    assert rel_l2(to_numpy(via)[:n], want) <= TOL["float32"]
