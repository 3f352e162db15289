"""The kvabi Layout of the KV cache vLLM hands a connector, one per KV cache group.

vLLM 0.32 allocates every layer of a group in one buffer and gives each layer a strided
``[blocks, kv_heads, block_size, 2 * head_dim]`` view (the ``C`` of its layout names).  The
byte strides of those views, and the distance between the layers' first bytes, give the
outer axes (``L``, ``B``, ``H``) of the layout exactly, whichever of the six names is in
use (cross-layer ``BLHNC`` included).  Inside one block-head the views only say "2 * N * D
elements"; how the kernels split them is the attention backend's business:

- vLLM's own CPU backend (``CPU_ATTN``) views a block-head as ``[2 * block_size, head_dim]``
  and takes the first half as keys, although the allocation's name says ``[N, 2 * D]``; and
  its cache write (ISA ``vec``, checked here) stores the keys transposed, ``[head_dim,
  block_size]``, the values ``[block_size, head_dim]``: one kvabi Layout of two components
  (the key and the value each with its own strides, as the preset ``vllm.cpu``), served as
  the one part ``kv``, so that a relayout moves whole block-heads where it can;
- otherwise the name's meaning, one layout with a ``KV`` axis: each token's key then value
  (``N`` before ``KV``), or a backend's own ``kvabi_kv_interior``.

The connector checks the result against the engine's own cache write once at start
(:func:`verify_part`), so a backend whose kernels write another order is refused before any
byte moves.
"""
from __future__ import annotations

import contextlib
import logging

import numpy as np

from kvabi import Component, KVABIError, KVCache, Layout
from kvabi import tensors as tensors_mod

log = logging.getLogger(__name__)

#: block-head interiors: key then value per token; all keys then all values; CPU_ATTN's
#: transposed keys then values (two parts)
KV_PACKED, KV_SPLIT, KT_V = "kv_packed", "kv_split", "kt_v"
INTERIORS = (KV_PACKED, KV_SPLIT, KT_V)


def interior_of(backend_cls) -> str:
    """How ``backend_cls`` (a vLLM attention backend class) orders a block-head's
    ``2 * N * D`` elements; a class may say so itself with ``kvabi_kv_interior``."""
    own = getattr(backend_cls, "kvabi_kv_interior", None)
    if own in INTERIORS:
        return own
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another platform's build
        CPUAttentionBackend = None
    if CPUAttentionBackend is not None and isinstance(backend_cls, type) and \
            issubclass(backend_cls, CPUAttentionBackend):
        return KT_V
    return KV_PACKED


def _outer(tensors, dtype: str | None = None):
    """(sizes L/B/H/N/D, byte strides of L/B/H/N, itemsize, dtype name) of a group's
    views; ``dtype``: the kvabi dtype of their bytes where the views' own says less (vLLM
    holds fp8 codes as uint8)."""
    if not tensors:
        raise KVABIError("kv_caches: a KV cache group has no layers")
    t0 = tensors[0]
    if t0.dim() != 4:
        raise KVABIError(f"kv_caches: vLLM views are [blocks, heads, block_size, content], "
                         f"got shape {tuple(t0.shape)}")
    nb, nh, bs, c = (int(x) for x in t0.shape)
    if c % 2:
        raise KVABIError(f"kv_caches: content size {c} is not 2 * head_dim (MLA caches "
                         "are not served by this connector)")
    isz = t0.element_size()
    sb, sh, sn, sc = (int(s) * isz for s in t0.stride())
    if sc != isz:
        raise KVABIError(f"kv_caches: a token's {c} elements are not contiguous (strides "
                         f"{tuple(t0.stride())})")
    for i, t in enumerate(tensors[1:], 1):
        if tuple(t.shape) != tuple(t0.shape) or t.stride() != t0.stride() or \
                t.dtype != t0.dtype:
            raise KVABIError(f"kv_caches: layer {i} of the group differs from layer 0 in "
                             f"shape, strides or dtype")
    ptrs = np.array([t.data_ptr() for t in tensors], np.int64)
    steps = np.diff(ptrs)
    if steps.size and (np.any(steps != steps[0]) or steps[0] <= 0):
        raise KVABIError(f"kv_caches: the layers' first bytes are not evenly spaced "
                         f"({steps[:4].tolist()}...)")
    sizes = {"L": len(tensors), "B": nb, "H": nh, "N": bs, "D": c // 2}
    # A group of one layer: its L stride never matters; put it outside everything.
    sl = int(steps[0]) if steps.size else sb * nb + sh * nh
    if dtype is None:
        dtype = tensors_mod.dtype_name(t0)
    elif tensors_mod.torch_dtype(dtype).itemsize != isz:
        raise KVABIError(f"kv_caches: {t0.dtype} views cannot hold {dtype} elements")
    return sizes, {"L": sl, "B": sb, "H": sh, "N": sn}, isz, dtype


def _layout(sizes, strides, dtype, name) -> Layout:
    # Memory order: by stride, outermost first (ties: the canonical axis order).
    canon = ("L", "B", "H", "KV", "N", "D")
    order = sorted(strides, key=lambda a: (-strides[a], canon.index(a)))
    return Layout(order=order, sizes={a: sizes[a] for a in order}, dtype=dtype,
                  strides=strides, name=name)


def group_parts(tensors, *, interior: str = KV_PACKED, name: str = "vllm",
                dtype: str | None = None):
    """The parts of one KV cache group from its layers' vLLM views (in layer order):
    ``[(part, Layout, byte offset of the part's first element from layer 0's first byte)]``
    with part ``"kv"`` (one layout holding keys and values).

    KVABIError naming what does not fit: a view that is not 4-D, an interior that is not
    dense, layers whose first bytes are not evenly spaced, an odd content size.  ``dtype``:
    the kvabi dtype of the views' bytes (default their own; ``float8_*`` for vLLM's fp8)."""
    if interior not in INTERIORS:
        raise KVABIError(f"interior: must be one of {INTERIORS}, got {interior!r}")
    sizes, outer, isz, dtype = _outer(tensors, dtype)
    n, d = sizes["N"], sizes["D"]
    sn = outer.pop("N")
    if interior != KV_PACKED and n > 1 and sn != 2 * d * isz:
        raise KVABIError(f"kv_caches: interior {interior} splits a block-head's {2 * n * d} "
                         f"elements, but its tokens are {sn} bytes apart (not dense)")
    if interior == KT_V:  # keys [D, N] then values [N, D]: two components, one layout
        comps = [Component(name="key", dtype=dtype, count=d,
                           strides={**outer, "N": isz, "E": n * isz}),
                 Component(name="value", dtype=dtype, count=d, offset=n * d * isz,
                           strides={**outer, "N": d * isz, "E": isz})]
        return [("kv", Layout(sizes={a: sizes[a] for a in ("L", "B", "N", "H")},
                              components=comps, name=name), 0)]
    inner = {KV_SPLIT: {"KV": n * d * isz, "N": d * isz, "D": isz},
             KV_PACKED: {"N": sn, "KV": d * isz, "D": isz}}[interior]
    return [("kv", _layout({**sizes, "KV": 2}, {**outer, **inner}, dtype, name), 0)]


def kt_v_halves(tensors, *, name: str = "vllm", dtype: str | None = None):
    """``[("k", Layout, 0), ("v", Layout, offset)]``: the keys and the values of a group of
    vLLM's CPU backend (interior ``kt_v``: keys ``[head_dim, block_size]``, values
    ``[block_size, head_dim]`` in each block-head) as two layouts in the axis form over the
    same bytes as the components of :func:`group_parts`' ``kv`` part (the V layout starts
    ``offset`` bytes after layer 0's first byte).  Plans between shardings and negotiation
    take the axis form, so a tensor-parallel peer reads these."""
    sizes, outer, isz, dtype = _outer(tensors, dtype)
    n, d = sizes["N"], sizes["D"]
    sn = outer.pop("N")
    if n > 1 and sn != 2 * d * isz:
        raise KVABIError(f"kv_caches: interior {KT_V} splits a block-head's {2 * n * d} "
                         f"elements, but its tokens are {sn} bytes apart (not dense)")
    k = _layout(sizes, {**outer, "D": n * isz, "N": isz}, dtype, f"{name}.k")
    v = _layout(sizes, {**outer, "N": d * isz, "D": isz}, dtype, f"{name}.v")
    return [("k", k, 0), ("v", v, n * d * isz)]


IMAGE = "image"


def image_part(tensors, *, interior: str, name: str = "vllm", dtype: str | None = None):
    """``(part, Layout, 0)`` holding each (layer, block, head)'s ``2 * N * D`` elements as
    one opaque run (``N`` = 1, ``D`` = the run), or None where a block-head is not dense
    (token-major names).  Between two caches of the same interior and block size a block
    moves as bytes, in runs as long as the two layouts share (a run of blocks for all layers
    of a cross-layer cache); the part's name carries what must match."""
    sizes, outer, isz, dtype = _outer(tensors, dtype)
    n, d = sizes["N"], sizes["D"]
    sn = outer.pop("N")
    if n > 1 and sn != 2 * d * isz:
        return None
    run = 2 * n * d
    lay = _layout({**sizes, "N": 1, "D": run}, {**outer, "N": run * isz, "D": isz}, dtype,
                  f"{name}.image")
    return (f"{IMAGE}.{interior}.n{n}.d{d}", lay, 0)


def part_cache(tensors, layout: Layout, offset: int) -> KVCache:
    """A KVCache over vLLM's own memory: one plane starting ``offset`` bytes after layer 0's
    first byte."""
    t0 = tensors[0]
    isz = t0.element_size()
    plane = t0.as_strided(layout.plane_shape, layout.plane_strides,
                          t0.storage_offset() + offset // isz)
    dt = tensors_mod.torch_dtype(layout.dtype)
    return KVCache.wrap(layout, [plane if plane.dtype == dt else plane.view(dt)])


def engine_writer(attn_layers, tensors, parts, part: str):
    """``write(layer, slot_mapping, key, value)`` through the engine's own cache write
    (each layer's ``impl.do_kv_cache_update``), numpy in, for verifying ``part``: a K or V
    part's write rewrites the other part's current values (so only its own bytes change)."""
    import torch

    others = {p: c for p, c in parts if p != part and not p.startswith(IMAGE)}

    def current(p, layer, slots):
        view = others[p].kv_view(layer, 0)  # [B, N, H, D]
        bs = others[p].layout.size("N")
        s = torch.from_numpy(np.asarray(slots, np.int64))
        return view[s // bs, s % bs].clone()

    def tensor(x):  # bfloat16 arrives as ml_dtypes, which torch.from_numpy refuses
        return tensors_mod.to_torch(np.ascontiguousarray(x))

    def write(layer, slot_mapping, key, value):
        mod = attn_layers[layer]
        with unit_scales(mod):  # the probe's values land as they are, whatever the scales
            _write(mod, layer, slot_mapping, key, value)

    def _write(mod, layer, slot_mapping, key, value):
        k = tensor(key) if part != "v" else current("k", layer, slot_mapping)
        if part == "kv":
            v = tensor(value)
        elif part == "k":
            v = current("v", layer, slot_mapping)
        else:
            v = tensor(key)  # a part's own elements
        mod.impl.do_kv_cache_update(mod, _widen(k), _widen(v), tensors[layer],
                                    torch.from_numpy(np.asarray(slot_mapping, np.int64)))

    def _widen(t):  # fp8 codes go in as the model's float32 values (scale 1: exact)
        return t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    return write


@contextlib.contextmanager
def unit_scales(layer):
    """vLLM ``layer``'s per-tensor KV scales set to 1.0 for as long as the block runs (an
    fp8 write then stores exact codes unchanged), put back after."""
    names = ("_k_scale_float", "_v_scale_float")
    old = [getattr(layer, n, None) for n in names]
    tensors = [getattr(layer, n, None) for n in ("_k_scale", "_v_scale")]
    saved = [None if t is None else t.clone() for t in tensors]
    try:
        for n, v in zip(names, old):
            if v is not None:
                setattr(layer, n, 1.0)
        for t in tensors:
            if t is not None:
                t.fill_(1.0)
        yield
    finally:
        for n, v in zip(names, old):
            if v is not None:
                setattr(layer, n, v)
        for t, v in zip(tensors, saved):
            if t is not None:
                t.copy_(v)


def verify_part(cache: KVCache, write) -> bool:
    """Check a part's layout against what the engine's write really does (kvabi.probe);
    True when checked, False when this kvabi has no probe.  KVABIError on a mismatch."""
    try:
        from kvabi.probe import verify_layout
    except ImportError:
        log.warning("kvabi.probe is not available: the cache layout %s is not verified "
                    "against the engine's write", cache.layout.name)
        return False
    verify_layout(cache.layout, list(cache), write)
    return True


def kvabi_backend_part(tensors, vllm_config):
    """``("kv", KVCache, write)`` for a group served by the kvabi attention-backend plugin
    (``KVABI_VLLM_BACKEND``): the plugin's own byte-exact layout of vLLM's views, and a
    write through the kvabi backend's ``write_kv`` into that memory (for verification)."""
    import kvabi
    from kvabi.util.tensors import convert

    from .. import layouts as vl
    from ..kv_quant import FP8, quantize_spec
    from ..attention import kvabi_backend

    backend = kvabi_backend()
    cache_dtype = vllm_config.cache_config.cache_dtype
    sizes, _, _, dtype = _outer(tensors, FP8.get(cache_dtype))
    spec = quantize_spec(backend, kvabi.KVSpec(
        kind="full", block_size=sizes["N"], num_kv_heads=sizes["H"], head_dim=sizes["D"],
        dtype=dtype), cache_dtype)
    choice = vl.choose(backend, spec, vllm_name=vllm_config.cache_config
                       .get_resolved_kv_cache_layout().name)
    layout, planes = vl.bind(choice, spec, tensors)
    fw = backend.framework if backend.framework in ("numpy", "torch") else None
    if fw is None:
        raise KVABIError(f"{backend.name}: a {backend.framework} cache cannot live in vLLM's "
                         "torch memory")
    cache = KVCache.wrap(layout, planes)
    own = KVCache.wrap(layout, [tensors_mod.to_numpy(p) for p in planes]) if fw == "numpy" \
        else cache
    bs = spec.block_size

    def write(layer, slot_mapping, key, value):
        slots = np.asarray(slot_mapping, np.int64)
        meta = kvabi.CommonAttentionMetadata.from_lengths(
            query_lens=np.ones(len(slots), np.int64), context_lens=slots % bs,
            block_table=(slots // bs)[:, None], block_size=bs, num_blocks=layout.num_blocks)
        plan = backend.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
        backend.write_kv(plan, own, key=convert(key, fw), value=convert(value, fw),
                         layer=layer)

    return "kv", cache, write


def is_kvabi_backend(backend_cls) -> bool:
    """Whether ``backend_cls`` is the kvabi attention-backend plugin's class."""
    try:
        from ..attention import KvabiAttentionBackend
    except ImportError:
        return False
    return isinstance(backend_cls, type) and issubclass(backend_cls, KvabiAttentionBackend)


def tp_shard_info(vllm_config, num_kv_heads: int | None = None) -> tuple[int, int, int]:
    """(this worker's tensor-parallel rank, the TP size, the model's KV heads) under vLLM's
    split (:meth:`kvabi.Shard.tp`); (0, 1, heads) outside a TP group (tests, tools)."""
    heads = int(num_kv_heads or vllm_config.model_config.get_total_num_kv_heads())
    try:
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(), heads
    except (AssertionError, ImportError, AttributeError):  # no TP group initialized
        return 0, 1, heads
