"""Hypothesis strategies for KV specs, layouts, batches and KV-sharing models.

Sizes are small by default (a conformance example must run in milliseconds on the
reference and in seconds on an interpreted kernel).  Choices are ordered so that shrinking
heads towards readable minimal cases: the first kind and dtype, the smallest head dim and
block size, fewer requests, shorter lengths, no padding, block ids in order, preset
layouts before random ones.
"""
from __future__ import annotations

import attrs
import numpy as np
from hypothesis import strategies as st

from ..layout.descriptor import Layout
from ..layout.presets import preset_names
from ..model.model_kv import ModelKV
from ..model.quant import FORMATS, QUANT_MODES, ROUNDINGS
from ..model.spec import KINDS, KVSpec, LayerKV
from ..step.metadata import CommonAttentionMetadata
from ..util.dtypes import DTYPE_BITS, DTYPES, itemsize
from ..util.errors import KVABIError

#: head dims drawn when a backend accepts any
SMALL_HEAD_DIMS = (4, 8, 16, 32)
#: block sizes drawn when a backend accepts any
SMALL_BLOCK_SIZES = (1, 2, 4, 8, 16)
#: KV head counts drawn for non-MLA specs
KV_HEADS = (1, 2, 4)


def _ordered(values, universe=None):
    """A tuple in canonical order (universe order if given, else sorted): shrinks to first."""
    vals = list(dict.fromkeys(values))
    if universe is not None:
        return tuple(sorted(vals, key=lambda v: universe.index(v) if v in universe else 99))
    return tuple(sorted(vals))


def block_size_choices(block_sizes=None, multiple: int = 1) -> tuple[int, ...]:
    """Block sizes to draw from: ``block_sizes`` (or small ones) that are multiples."""
    if block_sizes is not None:
        out = [b for b in block_sizes if b % multiple == 0]
    else:
        out = [b for b in SMALL_BLOCK_SIZES if b % multiple == 0] or [multiple, 2 * multiple]
    return _ordered(out)


@st.composite
def kv_specs(draw, kinds=KINDS, dtypes=DTYPES, head_dims=None, block_sizes=None, *,
             block_size_multiple: int = 1, num_kv_heads=KV_HEADS, page_aligns=(1,),
             max_window: int = 12, chunk_of_blocks: bool | None = None,
             quants=("none",), roundings=("nearest_even",)) -> KVSpec:
    """A :class:`KVSpec` of one of ``kinds`` and ``dtypes``.

    ``head_dims``/``block_sizes`` default to small values; ``chunk_of_blocks`` forces
    (True) or forbids (False) chunks that are a multiple of the block size (None: mostly
    multiples, as real models use).  MLA specs get one latent head and ``head_dim_v <=
    head_dim``.  ``quants``/``roundings``: the quantization granularities and roundings
    drawn where the dtype and kind allow them (``none`` first: it shrinks there).
    """
    kinds = _ordered(kinds, KINDS)
    dtypes = _ordered(dtypes, DTYPES)
    if not kinds or not dtypes:
        raise KVABIError("kinds/dtypes: nothing to draw from")
    dims = _ordered(head_dims if head_dims is not None else SMALL_HEAD_DIMS)
    sizes = block_size_choices(block_sizes, block_size_multiple)
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    bs = draw(st.sampled_from(sizes))
    d = draw(st.sampled_from(dims))
    extra: dict = {}
    if kind == "mla":
        heads = 1
        smaller = [x for x in dims if x <= d]
        extra["head_dim_v"] = draw(st.sampled_from([d] + sorted(smaller, reverse=True)))
    else:
        heads = draw(st.sampled_from(_ordered(num_kv_heads)))
    if kind == "sliding_window":
        extra["window"] = draw(st.integers(1, max_window))
    elif kind == "chunked_local":
        multiple = st.integers(1, 3).map(lambda k: k * bs)
        anything = st.integers(1, max(2, 3 * bs))
        if chunk_of_blocks is True:
            extra["chunk"] = draw(multiple)
        elif chunk_of_blocks is False:
            extra["chunk"] = draw(anything)
        else:
            extra["chunk"] = draw(st.one_of(multiple, anything))
    align = draw(st.sampled_from(_ordered(page_aligns)))
    extra.update(_draw_quant(draw, kind, dtype, quants, roundings))
    return KVSpec(kind, block_size=bs, num_kv_heads=heads, head_dim=d, dtype=dtype,
                  page_align=align, **extra)


def _draw_quant(draw, kind: str, dtype: str, quants, roundings) -> dict:
    """``quant``/``rounding`` keywords of a spec: a granularity of ``quants`` that ``kind``
    and ``dtype`` allow, with a rounding of ``roundings`` defined for the dtype (or none)."""
    if dtype not in FORMATS:
        return {}
    fmt = FORMATS[dtype]
    rounds = [r for r in _ordered(roundings, ROUNDINGS) if r in fmt.roundings]
    modes = [q for q in _ordered(quants, QUANT_MODES) if q == "none" or
             (rounds and not (q == "per_token_head" and kind == "mla"))]
    if not modes:
        return {}  # quant none: a backend that does not claim it drops it (spec filter)
    quant = draw(st.sampled_from(modes))
    if quant == "none":
        return {}
    return {"quant": quant, "rounding": draw(st.sampled_from(rounds))}


def preset_layouts_for(spec: KVSpec, num_blocks: int, num_layers: int = 1,
                       names=None) -> list[Layout]:
    """Every preset (of ``names``, default all) that can hold ``spec``, built."""
    out = []
    for name in (names if names is not None else preset_names(spec)):
        try:
            out.append(Layout.preset(name, spec, num_blocks, num_layers))
        except KVABIError:
            continue
    return out


def _natural_strides(order, extents, isz) -> dict[str, int]:
    strides, s = {}, isz
    for a in reversed(order):
        strides[a] = s
        s *= extents[a]
    return strides


@st.composite
def random_layouts(draw, spec: KVSpec, num_blocks: int, num_layers: int = 1) -> Layout:
    """A random valid :class:`Layout` for ``spec`` built directly (no preset).

    Draws which of L/KV are plane axes, the memory order of the rest, padded extents,
    explicit byte strides with gaps, extra plane bytes, a fold of contiguous axes and a
    packing factor.  Shrinks towards the canonical order L, B, KV, N, H, D unpadded.
    """
    sizes = {"B": num_blocks, "N": spec.block_size, "H": spec.num_kv_heads, "D": spec.head_dim}
    if num_layers > 1 or draw(st.booleans()):
        sizes["L"] = num_layers
    if not spec.is_mla:
        sizes["KV"] = 2
    planes = tuple(a for a in ("L", "KV") if a in sizes and draw(st.booleans()))
    canonical = [a for a in ("L", "B", "KV", "N", "H", "D") if a in sizes and a not in planes]
    order = tuple(draw(st.permutations(canonical)))
    isz = itemsize(spec.dtype)
    extents = {}
    if draw(st.booleans()):
        for a in order:
            pad = draw(st.integers(0, 2))
            if pad:
                extents[a] = sizes[a] + pad
    ext = {a: extents.get(a, sizes[a]) for a in order}
    strides = None
    if draw(st.booleans()):
        strides, s = {}, isz * draw(st.integers(1, 2))
        for a in reversed(order):
            strides[a] = s
            s = s * ext[a] + isz * draw(st.integers(0, 3))
    natural = strides or _natural_strides(order, ext, isz)
    span = sum((ext[a] - 1) * natural[a] for a in order) + isz
    plane_bytes = span + isz * draw(st.integers(1, 4)) if draw(st.booleans()) else None
    # A fold of two or three consecutive axes that are contiguous in memory.
    folds = ()
    candidates = []
    for n in (2, 3):
        for i in range(len(order) - n + 1):
            f = order[i:i + n]
            if all(natural[o] == ext[x] * natural[x] for o, x in zip(f, f[1:])):
                candidates.append(f)
    if candidates and draw(st.booleans()):
        folds = (draw(st.sampled_from(candidates)),)
    packing = 1
    if DTYPE_BITS[spec.dtype] < 32 and draw(st.booleans()):
        hgroup = next((f for f in folds if "H" in f), ("H",))
        e = int(np.prod([ext[a] for a in hgroup]))
        options = [p for p in (2, 4) if p * DTYPE_BITS[spec.dtype] <= 32 and e % p == 0]
        if options:
            packing = draw(st.sampled_from(options))
    try:
        return Layout(order=order, sizes=sizes, dtype=spec.dtype, planes=planes,
                      extents=extents or None, strides=strides, plane_bytes=plane_bytes,
                      folds=folds, packing=packing)
    except KVABIError as e:  # a bug in this strategy, not in the code under test
        raise AssertionError(f"random_layouts built an invalid layout: {e}") from e


def layouts(spec: KVSpec, num_blocks: int = 4, num_layers: int = 1, *, presets=True,
            random=True, names=None):
    """Layouts for ``spec``: every preset of :func:`kvabi.layout.presets.preset_names` that holds
    it (or those of ``names``), and/or :func:`random_layouts`.  Presets shrink first."""
    parts = []
    if presets:
        built = preset_layouts_for(spec, num_blocks, num_layers, names)
        if built:
            parts.append(st.sampled_from(built))
    if random:
        parts.append(random_layouts(spec, num_blocks, num_layers))
    if not parts:
        raise KVABIError(f"layouts: no layout can hold {spec}")
    return st.one_of(*parts)


@attrs.frozen
class RequestShape:
    """Lengths of one drawn request (for readability of failing examples)."""

    query_len: int
    context_len: int


def _request(max_query_len, max_context_len, allow_empty):
    # Order matters for shrinking: decodes are the simplest requests.
    decode = st.integers(1, max_context_len).map(lambda c: RequestShape(1, c))
    fresh = st.integers(1, max_query_len).map(lambda q: RequestShape(q, 0))
    chunked = st.tuples(st.integers(2, max(2, max_query_len)),
                        st.integers(1, max_context_len)).map(lambda t: RequestShape(*t))
    kinds = [decode, fresh, chunked]
    if allow_empty:
        kinds.append(st.just(RequestShape(0, 0)))
    return st.one_of(*kinds)


@st.composite
def batches(draw, spec: KVSpec, *, min_reqs: int = 1, max_reqs: int = 4,
            max_query_len: int = 8, max_context_len: int = 24, padding: bool = True,
            empty_requests: bool = True, shared_prefix: bool | None = None,
            max_spare_blocks: int = 2) -> CommonAttentionMetadata:
    """A consistent batch for ``spec``: decodes, chunked prefills and fresh prefills mixed.

    Returns :class:`~kvabi.CommonAttentionMetadata` with ``num_blocks`` set to the size of
    the block pool it draws from.  Block ids are a shuffled permutation of the pool; with a
    shared prefix (``shared_prefix`` True forces, False forbids, None draws) every request
    with query tokens starts with the same 1-2 full blocks of context, as prefix caching
    shares them.  Requests with no query tokens (``empty_requests``) and trailing padding
    tokens (``padding``) may appear; at least one request has query tokens.
    """
    bs = spec.block_size
    n = draw(st.integers(min_reqs, max_reqs))
    reqs = [draw(_request(max_query_len, max_context_len, empty_requests and i > 0))
            for i in range(n)]
    q = np.array([r.query_len for r in reqs], np.int64)
    c = np.array([r.context_len for r in reqs], np.int64)
    share = draw(st.booleans()) if shared_prefix is None else shared_prefix
    k = draw(st.integers(1, 2)) if share else 0
    active = q > 0
    c = np.where(active, c + k * bs, c)  # the shared blocks precede each request's own
    seq = c + q
    need = -(-seq // bs)
    own = np.where(active, need - k, need)
    spare = draw(st.integers(0, max_spare_blocks))
    num_blocks = max(1, k + int(own.sum()) + spare)
    ids = np.array(draw(st.permutations(range(num_blocks))), np.int64)
    width = int(need.max(initial=0)) + draw(st.integers(0, 1))
    table = np.zeros((n, max(width, 1)), np.int64)
    shared = ids[:k]
    nxt = k
    for r in range(n):  # a loop over a handful of drawn requests
        start = 0
        if active[r] and k:
            table[r, :k] = shared
            start = k
        table[r, start:start + own[r]] = ids[nxt:nxt + own[r]]
        nxt += int(own[r])
    pad = draw(st.integers(0, 3)) if padding else 0
    total = int(q.sum())
    return CommonAttentionMetadata.from_lengths(q, c, table, bs, num_blocks=num_blocks,
                                                num_tokens=total + pad)


@st.composite
def kv_sharing_models(draw, spec: KVSpec | None = None, *, min_layers: int = 2,
                      max_layers: int = 5, min_shared: int = 1, specs=None) -> ModelKV:
    """A :class:`~kvabi.ModelKV` of one spec where some layers read an earlier layer's cache.

    Layer 0 owns its cache; each later layer owns one or shares a random earlier layer
    (chains included, as Gemma 3n's and Hunyuan's cross-layer sharing).  At least
    ``min_shared`` layers share.  ``spec`` defaults to one drawn from ``specs`` (default
    :func:`kv_specs`).
    """
    if spec is None:
        spec = draw(specs if specs is not None else kv_specs())
    n = draw(st.integers(max(min_layers, min_shared + 1), max_layers))
    layers = [LayerKV("layers.0", spec)]
    shared = 0
    for i in range(1, n):
        must = n - i <= min_shared - shared
        if must or draw(st.booleans()):
            j = draw(st.integers(0, i - 1))
            layers.append(LayerKV(f"layers.{i}", spec, shares=f"layers.{j}"))
            shared += 1
        else:
            layers.append(LayerKV(f"layers.{i}", spec))
    return ModelKV(layers)
