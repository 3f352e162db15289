"""Shared pieces of the kvabi-cuda tests: Hypothesis steps, running a step through a
backend, and the comparison with kvabi's reference backend (the float64 oracle)."""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

import kvabi
from kvabi import CommonAttentionMetadata, KVSpec, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.util.tensors import convert, to_numpy


@attrs.frozen
class Step:
    """One attention step: spec, layout name, metadata, options and the data to feed."""

    spec: KVSpec
    layout_name: object  # a preset name, or a callable (spec, num_blocks, num_layers)
    meta: CommonAttentionMetadata
    hist: CommonAttentionMetadata  # writes every context token (positions 0..c-1)
    num_q_heads: int
    softcap: float | None
    sinks: np.ndarray | None
    seed: int

    def layout(self, num_layers=2) -> Layout:
        if callable(self.layout_name):
            return self.layout_name(self.spec, self.meta_blocks, num_layers)
        return Layout.preset(self.layout_name, self.spec, self.meta_blocks, num_layers)

    @property
    def meta_blocks(self) -> int:
        return int(self.meta.num_blocks)


def make_step(kind="full", *, query_lens, context_lens, block_size=4, num_kv_heads=2,
              group=2, head_dim=8, dtype="float32", window=None, chunk=None,
              layout="flash_attn", padding=0, softcap=None, sinks=False, seed=0,
              spare_blocks=3) -> Step:
    """A step whose block table is a random permutation of the cache's blocks."""
    rng = np.random.default_rng(seed)
    q = np.asarray(query_lens, np.int64)
    c = np.asarray(context_lens, np.int64)
    need = -(-(q + c) // block_size)
    width = max(1, int(need.max(initial=0)))
    nb = int(need.sum()) + spare_blocks
    perm = rng.permutation(nb)
    bt = np.zeros((len(q), width), np.int64)
    used = np.arange(width)[None, :] < need[:, None]
    bt[used] = perm[:int(need.sum())]
    kw = {}
    if kind == "sliding_window":
        kw["window"] = window
    if kind == "chunked_local":
        kw["chunk"] = chunk
    if kind == "mla":
        kw["head_dim_v"] = max(1, head_dim // 2)
        num_kv_heads = 1
    spec = KVSpec(kind, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  dtype=dtype, **kw)
    meta = CommonAttentionMetadata.from_lengths(q, c, bt, block_size, num_blocks=nb,
                                                num_tokens=int(q.sum()) + padding)
    hist = CommonAttentionMetadata.from_lengths(c, np.zeros_like(c), bt, block_size,
                                                num_blocks=nb)
    hq = num_kv_heads * group
    sk = rng.normal(size=hq) if sinks else None
    return Step(spec, layout, meta, hist, hq, softcap, sk, seed)


@st.composite
def steps(draw, kinds=("full", "sliding_window", "chunked_local"), dtypes=("float32",),
          layouts=("flash_attn",), block_sizes=(2, 4), max_reqs=3, max_ctx=10, max_q=5,
          group_max=3, allow_sinks=True, head_dims=(4, 8)):
    """Small random steps: mixed decode/prefill requests, padding, GQA, options."""
    n = draw(st.integers(1, max_reqs))
    q = draw(st.lists(st.integers(0, max_q), min_size=n, max_size=n))
    if sum(q) == 0:
        q[0] = 1
    c = draw(st.lists(st.integers(0, max_ctx), min_size=n, max_size=n))
    bs = draw(st.sampled_from(block_sizes))
    kind = draw(st.sampled_from(kinds))
    window = draw(st.integers(1, 6)) if kind == "sliding_window" else None
    chunk = bs * draw(st.integers(1, 3)) if kind == "chunked_local" else None
    return make_step(
        kind, query_lens=q, context_lens=c, block_size=bs,
        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.integers(1, group_max)),
        head_dim=draw(st.sampled_from(head_dims)), dtype=draw(st.sampled_from(dtypes)),
        window=window, chunk=chunk, layout=draw(st.sampled_from(layouts)),
        padding=draw(st.integers(0, 2)),
        softcap=draw(st.sampled_from([None, None, 2.0])),
        sinks=allow_sinks and draw(st.booleans()),
        seed=draw(st.integers(0, 2 ** 16)))


def step_data(step: Step, layer: int = 1):
    """(history K, history V, step K, step V, query) as float64 arrays whose values are
    exact in the cache dtype, so every backend sees the same numbers (other numbers for
    another layer)."""
    rng = np.random.default_rng([step.seed + 1, layer])
    spec = step.spec
    dt = numpy_dtype(spec.dtype)

    def draw(*shape):
        return rng.normal(size=shape).astype(dt).astype(np.float64)

    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    th, t = step.hist.num_tokens, step.meta.num_tokens
    mla = spec.is_mla
    return (draw(th, h, d), None if mla else draw(th, h, dv), draw(t, h, d),
            None if mla else draw(t, h, dv), draw(t, step.num_q_heads, d))


def arr(backend, x):
    """``x`` (numpy) in ``backend``'s framework on its device (None stays None)."""
    return None if x is None else convert(x, backend.framework, device=backend.device())


def host(x) -> np.ndarray:
    """A float64 numpy copy of a backend's array."""
    return np.asarray(to_numpy(x), dtype=np.float64)


def run_step(backend, step: Step, layer: int = 1, *, scale=None):
    """Write the history and the step's K/V through ``backend``, then attend.

    Returns (out [A, Hq, Dv], lse [A, Hq], cache planes as numpy), float64, real tokens.
    """
    spec, layout = step.spec, step.layout()
    kh, vh, k, v, q = step_data(step, layer)
    cache = backend.allocate(layout)
    if step.hist.num_tokens:
        p0 = backend.plan(step.hist, spec, layout, num_q_heads=step.num_q_heads)
        backend.write_kv(p0, cache, key=arr(backend, kh), value=arr(backend, vh), layer=layer)
    p = backend.plan(step.meta, spec, layout, scale=scale, softcap=step.softcap,
                     sinks=step.sinks, num_q_heads=step.num_q_heads)
    backend.write_kv(p, cache, key=arr(backend, k), value=arr(backend, v), layer=layer)
    qd = q.astype(numpy_dtype(spec.dtype)) if spec.dtype != "float32" else q
    out, lse = backend.attention(p, cache, query=arr(backend, qd), layer=layer, return_lse=True)
    a = step.meta.num_actual_tokens
    planes = [np.asarray(to_numpy(x)) for x in cache]
    return host(out)[:a], host(lse)[:a], planes


def reference():
    return kvabi.get_backend("reference")


#: (atol, rtol) of outputs and lse against the float64 oracle, per cache dtype
TOL = {"float32": (2e-5, 2e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}


def compare(step: Step, got, want) -> None:
    """Assert outputs and lse of the real tokens agree within the dtype's tolerance."""
    atol, rtol = TOL[step.spec.dtype]
    o, l, _ = got
    ro, rl, _ = want
    np.testing.assert_allclose(o, ro, atol=atol, rtol=rtol, err_msg="attention output")
    fin = np.isfinite(rl)
    assert (np.isfinite(l) == fin).all(), "lse finiteness differs"
    np.testing.assert_allclose(l[fin], rl[fin], atol=atol, rtol=rtol, err_msg="lse")


def mismatch(step: Step, backend) -> bool:
    """Whether ``backend`` disagrees with the reference on ``step`` (any error counts)."""
    try:
        compare(step, run_step(backend, step), run_step(reference(), step))
    except AssertionError:
        return True
    return False


def fill_layer(backend, step: Step, cache, layout, layer: int):
    """Write the history and the step's K/V of ``layer`` (its own numbers) into ``cache``
    through ``backend``; returns the step's query (numpy, in the cache dtype)."""
    spec = step.spec
    kh, vh, k, v, q = step_data(step, layer)
    for meta, kk, vv in ((step.hist, kh, vh), (step.meta, k, v)):
        if meta.num_tokens:
            p = backend.plan(meta, spec, layout, num_q_heads=step.num_q_heads)
            backend.write_kv(p, cache, key=arr(backend, kk), value=arr(backend, vv),
                             layer=layer)
    return q.astype(numpy_dtype(spec.dtype))


def reference_layer(step: Step, layer: int, *, sinks=None, layout=None):
    """The oracle's (out, lse) [A, ...] for ``layer``'s numbers, planned with ``sinks``."""
    ref = reference()
    layout = layout or step.layout()
    cache = ref.allocate(layout)
    q = fill_layer(ref, step, cache, layout, layer)
    p = ref.plan(step.meta, step.spec, layout, softcap=step.softcap, sinks=sinks, num_q_heads=step.num_q_heads)
    out, lse = ref.attention(p, cache, query=q, layer=layer, return_lse=True)
    a = step.meta.num_actual_tokens
    return host(out)[:a], host(lse)[:a]


def visible_slots(step: Step) -> np.ndarray:
    """bool [num_blocks * block_size]: slots some real query token may see, from the
    semantics directly (key j of its request with lo(p) <= j <= p; lo 0, p - W + 1 or the
    chunk start)."""
    meta, spec = step.meta, step.spec
    bs = spec.block_size
    seen = np.zeros(meta.num_blocks * bs, bool)
    for r in range(meta.num_reqs):
        for t in range(int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])):
            p = int(meta.positions[t])
            lo = 0
            if spec.kind == "sliding_window":
                lo = max(0, p - spec.window + 1)
            elif spec.kind == "chunked_local":
                lo = p // spec.chunk * spec.chunk
            for j in range(lo, p + 1):
                seen[int(meta.block_table[r, j // bs]) * bs + j % bs] = True
    return seen
