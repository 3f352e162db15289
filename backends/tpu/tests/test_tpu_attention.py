"""Attention of both TPU backends equals the reference (numpy float64) within tolerance.

Mixed batches (decodes, chunked prefills, prefills, empty requests, padding tokens) over
caches in every TPU layout form; GQA ratios with 1, 2 or 3 KV heads; head dims 64/128/256;
block sizes 16/32/64; sliding windows and attention chunks that cut through blocks; soft
cap; sinks.  Errors: relative L2 over real tokens (fp32 1e-5, bf16 2e-2) and the largest
absolute log-sum-exp difference.  tpu.pallas runs interpreted here, so it gets few examples
(each new shape compiles for seconds); tpu.jax covers the space more densely.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_helpers import (JAX, PALLAS, REFERENCE, TOL, batches, cross_layer_layout,
                         filled_cache, make_spec, rel_l2, to_backend, values)

import kvabi
from kvabi.util.tensors import to_jax, to_numpy


def check_attention(backend, spec, form, meta, group, options, seed, layer=0):
    rng = np.random.default_rng(seed)
    if form.endswith(".cross_layer"):
        layout = cross_layer_layout(spec, meta.num_blocks, 2, form.rsplit(".", 1)[0])
    else:
        layout = kvabi.Layout.preset(form, spec, meta.num_blocks, num_layers=2)
    planes = filled_cache(layout, spec, rng)
    cache = to_backend(backend, planes)
    hq = spec.num_kv_heads * group
    query = values(rng, (meta.num_tokens, hq, spec.head_dim), spec.dtype)
    opts = dict(options)
    if opts.pop("sinks", False):
        opts["sinks"] = rng.uniform(-2, 2, hq).astype(np.float32)
    want, want_lse = REFERENCE.attention(REFERENCE.plan(meta, spec, layout, num_q_heads=hq,
                                                        **opts),
                                         planes, query=query, layer=layer, return_lse=True)
    plan = backend.plan(meta, spec, layout, num_q_heads=hq,
                        **{k: (to_jax(v) if k == "sinks" else v)
                           for k, v in opts.items()})
    out, lse = backend.attention(plan, cache, query=to_jax(query), layer=layer,
                                 return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == (meta.num_tokens, hq, spec.head_dim) and lse.shape == (
        meta.num_tokens, hq)
    n = meta.num_actual_tokens
    err = rel_l2(out[:n], want[:n])
    lerr = float(np.abs(lse[:n].astype(np.float64) - want_lse[:n]).max(initial=0))
    tol = TOL[spec.dtype]
    assert err <= tol, f"relative L2 error {err:.3g} > {tol} ({spec})"
    assert lerr <= 1e-4, f"lse error {lerr:.3g}"
    return err


@st.composite
def attention_cases(draw, block_sizes=(16, 32, 64), head_dims=(64, 128, 256),
                    forms=("tpu.combined", "tpu.hidden")):
    bs = draw(st.sampled_from(block_sizes))
    kind = draw(st.sampled_from(("full", "sliding_window", "chunked_local")))
    span = None
    if kind == "sliding_window":  # windows shorter and longer than a block
        span = draw(st.sampled_from((1, 5, bs - 3, bs + 7)))
    elif kind == "chunked_local":  # chunks cutting blocks, and whole blocks
        span = draw(st.sampled_from((7, bs // 2 + 3, bs, 2 * bs)))
    spec = make_spec(kind, bs, draw(st.sampled_from((1, 2, 3))),
                     draw(st.sampled_from(head_dims)),
                     draw(st.sampled_from(("float32", "bfloat16"))), span)
    meta = draw(batches(bs, max_query=bs + 5, max_context=2))
    group = draw(st.sampled_from((1, 2, 4)))
    options = {}
    if draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from((1.5, 5.0)))
    if draw(st.booleans()):
        options["sinks"] = True
    if draw(st.booleans()):
        options["scale"] = 0.3
    return spec, draw(st.sampled_from(forms)), meta, group, options, draw(
        st.integers(0, 2**16))


@settings(max_examples=5, deadline=None)
@given(attention_cases(forms=("tpu.combined", "tpu.hidden", "tpu.combined.cross_layer")))
def test_pallas_attention_equals_reference(case):
    check_attention(PALLAS, *case)


@settings(max_examples=12, deadline=None)
@given(attention_cases(forms=("tpu.combined", "tpu.hidden", "tpu.combined.cross_layer",
                              "tpu.hidden.cross_layer")), st.integers(0, 1))
def test_jax_attention_equals_reference(case, layer):
    check_attention(JAX, *case, layer=layer)


def test_pallas_fixed_mixed_batch_every_kind():
    """A fixed batch through the kernel for each kind, GQA 4:1 with one KV head, bf16,
    window and chunk cutting through 16-token pages: one compile per kind."""
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [1, 19, 0, 6, 1], [30, 0, 5, 11, 47], [[5, 1, 8, 0], [2, 9, 3, 3], [4, 4, 4, 4],
                                                [7, 6, 4, 4], [10, 11, 12, 13]], 16,
        num_blocks=14, num_tokens=30)
    for kind, span in (("full", None), ("sliding_window", 21), ("chunked_local", 24)):
        spec = make_spec(kind, 16, 1, 64, "bfloat16", span)
        check_attention(PALLAS, spec, "tpu.combined", meta, 4, {"softcap": 5.0}, 3)


def test_backends_agree_with_each_other():
    """tpu.pallas and tpu.jax are independent implementations: they agree closely on fp32."""
    meta = kvabi.CommonAttentionMetadata.from_lengths([9, 1], [16, 40], [[0, 1, 2, 3],
                                                      [4, 5, 6, 7]], 16, num_blocks=8)
    spec = make_spec("sliding_window", 16, 2, 128, "float32", 19)
    layout = kvabi.Layout.preset("tpu.hidden", spec, 8)
    rng = np.random.default_rng(7)
    planes = filled_cache(layout, spec, rng)
    q = values(rng, (meta.num_tokens, 4, 128), "float32")
    outs = []
    for b in (PALLAS, JAX):
        o = b.attention(b.plan(meta, spec, layout, num_q_heads=4), to_backend(b, planes),
                        query=to_jax(q))
        outs.append(to_numpy(o))
    assert rel_l2(outs[0], outs[1]) < 1e-5
