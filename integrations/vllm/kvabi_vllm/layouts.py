"""vLLM's ``KVCacheLayout`` names and the tensors vLLM allocates, as kvabi layouts.

vLLM allocates one byte buffer and hands each attention layer a view ``[B, H, N, C]`` of it
(``C`` = 2 x head_dim) whose strides follow one of six names (memory order of
``[L, B, H, N, C]``).  vLLM itself only relies on where a *block* of a layer lives: its block
manager, prefix cache and hybrid allocator (which overlays KV groups on the same bytes) move
and reuse whole blocks.  Inside the bytes that vLLM gives one block of one layer (one head of
it where ``H`` lies outside the block), the order is the kernel's business: vLLM's own CPU
kernels, for one, read an ``LBHNC`` allocation as ``[B, H, 2, N, D]``.

So a kvabi layout *fits* a vLLM name when it keeps vLLM's order for the axes down to the
block (and for ``H`` where ``H`` splits the block) and permutes only axes inside the dense
run vLLM gives each block.  The component presets ``vllm.cpu`` (and ``.LHBNC``, ``.BLHNC``,
``.BHLNC``) are vLLM's CPU cache itself, keys ``[D, N]`` then values ``[N, D]`` per
block-head: each fits its own name only, and :func:`bind` states it by components over
vLLM's views.  :func:`choose` picks, among a kvabi backend's preferred layouts,
the first that fits one of the names; :func:`bind` describes the views vLLM allocated, byte
for byte, as one kvabi :class:`~kvabi.Layout` whose ``L`` axis selects a layer's plane.
"""
from __future__ import annotations

import attrs

import kvabi
from kvabi import UnsupportedError
from kvabi.util.errors import KVABIError

#: vLLM's ``KVCacheLayout`` names, in vLLM's default preference order (LBNHC first).
VLLM_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")

# Per name: the axes of a layer's view that keep vLLM's strides (outermost first), and the
# dense run inside one block (``C`` is (KV, D): key and value halves of each row).
_OUTER = {
    "LBHNC": ("B",), "LBNHC": ("B",), "BLHNC": ("B",), "BLNHC": ("B",),
    "BHLNC": ("B", "H"), "LHBNC": ("H", "B"),
}
_INNER = {
    "LBHNC": ("H", "N", "KV", "D"), "LBNHC": ("N", "H", "KV", "D"),
    "BLHNC": ("H", "N", "KV", "D"), "BLNHC": ("N", "H", "KV", "D"),
    "BHLNC": ("N", "KV", "D"), "LHBNC": ("N", "KV", "D"),
}
_SIX = frozenset("vllm." + v for v in VLLM_LAYOUTS)
#: component presets that are vLLM's CPU allocation under one of its names
_OWN = {"vllm.cpu": "LBHNC", "vllm.cpu.LHBNC": "LHBNC", "vllm.cpu.BLHNC": "BLHNC",
        "vllm.cpu.BHLNC": "BHLNC"}
# Axis order of the 4-D view vLLM binds to a layer: [B, H, N, C].
_VIEW = ("B", "H", "N", "C")


def preset_of(vllm_name: str) -> str:
    """The kvabi preset with vLLM's own meaning of ``vllm_name`` (``C`` = K then V)."""
    _check_name(vllm_name)
    return "vllm." + vllm_name


def _check_name(vllm_name) -> None:
    if vllm_name not in VLLM_LAYOUTS:
        raise KVABIError(f"vllm_layout: must be one of {', '.join(VLLM_LAYOUTS)}, "
                         f"got {vllm_name!r}")


def fits(layout: kvabi.Layout, vllm_name: str) -> bool:
    """Whether ``layout`` (one layer's worth; ``L`` outermost or a plane axis) can live in
    the bytes vLLM allocates under ``vllm_name``: vLLM's order down to the block, any order
    inside a block's dense run, no padding, packing or K/V planes."""
    _check_name(vllm_name)
    if layout.planes not in ((), ("L",)) or layout.extents or layout.strides \
            or layout.packing or layout.plane_bytes is not None or not layout.has_kv:
        return False
    order = tuple(a for a in layout.order if a != "L")
    if "L" in layout.order and layout.order[0] != "L" and layout.size("L") > 1:
        return False  # a multi-layer template interleaving layers: described by bind()
    outer = _OUTER[vllm_name]
    return order[:len(outer)] == outer and sorted(order[len(outer):]) == \
        sorted(_INNER[vllm_name])


def _template(backend, name: str, spec: kvabi.KVSpec):
    """One-layer, one-block Layout of preset ``name`` for ``spec``, or None."""
    try:
        return kvabi.Layout.preset(name, spec, num_blocks=1)
    except KVABIError:
        return None


def _by_affinity(tpl) -> list[str]:
    """vLLM's names, those ordering H and N as ``tpl`` does first (inside a block any order
    fits; the name then also says which of H and N is outer)."""
    h_first = tpl.order.index("H") < tpl.order.index("N")
    return sorted(VLLM_LAYOUTS, key=lambda v: (v.index("H") < v.index("N")) != h_first)


@attrs.frozen
class Choice:
    """vLLM's ``KVCacheLayout`` name and the kvabi preset whose byte order fills it."""

    vllm_name: str
    preset: str


def choose(backend, spec: kvabi.KVSpec, *, vllm_name: str | None = None) -> Choice:
    """The first of ``backend``'s preferred layouts (then the others its capabilities list)
    that fits one of vLLM's names (``vllm_name`` if given), paired with that name.

    :class:`kvabi.UnsupportedError` (with every candidate and why) when none fits: the
    engine cannot allocate a cache this backend reads."""
    if vllm_name is not None:
        _check_name(vllm_name)
    names = list(backend.preferred_layouts(spec))
    caps = backend.capabilities(spec)
    names += [n for n in getattr(caps, "layouts", ()) or () if n not in names]
    tried = []
    for name in names:
        tpl = _template(backend, name, spec)
        if tpl is None:
            tried.append(f"{name} (not a kvabi preset for this spec)")
            continue
        if name in _OWN:  # vLLM's own CPU cache: exactly its name
            if vllm_name in (None, _OWN[name]):
                return Choice(_OWN[name], name)
            tried.append(f"{name} (vLLM's {_OWN[name]} cache)")
            continue
        if not tpl.is_axis_form:
            tried.append(f"{name} (components no vLLM allocation holds)")
            continue
        for v in ([vllm_name] if vllm_name else _by_affinity(tpl)):
            # One of vLLM's six presets fits only its own name (it *is* that byte order).
            if name in _SIX and name != "vllm." + v:
                continue
            if fits(tpl, v):
                return Choice(v, name)
        tried.append(f"{name} (order {'/'.join(tpl.order)}"
                     f"{', planes ' + '/'.join(tpl.planes) if tpl.planes else ''})")
    want = vllm_name or "any of " + ", ".join(VLLM_LAYOUTS)
    raise UnsupportedError(
        f"{backend.name}: no layout it reads fits vLLM's KV cache allocation ({want}); "
        f"tried {'; '.join(tried) or 'nothing (no preferred layouts)'}")


def bind(choice: Choice, spec: kvabi.KVSpec, views) -> tuple[kvabi.Layout, list]:
    """The kvabi layout of the per-layer views vLLM allocated (``views``: torch tensors
    ``[B, H, N, C]``, one per owning layer, in L order) and the planes to hand a backend.

    The layout takes ``choice.preset``'s axis order, vLLM's byte strides for the axes down
    to the block (a cross-layer ``BL..`` allocation's block stride spans all its layers) and
    dense strides inside a block; ``L`` is the plane axis.  Each plane is a strided view of
    vLLM's own memory (no copy).  KVABIError unless every view has the shape and strides
    vLLM's name implies for ``spec``."""
    if not views:
        raise KVABIError("views: vLLM bound no KV cache to this group's layers")
    tpl = kvabi.Layout.preset(choice.preset, spec, num_blocks=1)
    isz = tpl.itemsize
    v0 = views[0]
    nb = int(v0.shape[0])
    want_shape = (nb, spec.num_kv_heads, spec.block_size, 2 * spec.head_dim)
    for i, v in enumerate(views):
        if tuple(v.shape) != want_shape or v.stride() != v0.stride() or v.dtype != v0.dtype:
            raise KVABIError(f"views[{i}]: vLLM's cache view has shape {tuple(v.shape)}, "
                             f"strides {v.stride()}, dtype {v.dtype}; expected {want_shape} "
                             f"with the strides of views[0] {v0.stride()}")
        if v.stride(3) != 1:
            raise KVABIError(f"views[{i}].stride: C must be contiguous, got {v.stride()}")
    vstride = dict(zip(_VIEW, (s * isz for s in v0.stride())))
    if choice.preset in _OWN:
        return _bind_own(choice, spec, views, vstride, isz)
    return _bind_axes(choice, spec, views, tpl, vstride, isz)


def _typed(planes, spec):
    """vLLM holds fp8 codes as uint8: the same bytes, typed as the spec's dtype."""
    dt = kvabi.tensors.torch_dtype(spec.dtype)
    if planes[0].dtype == dt:
        return planes
    if planes[0].element_size() != kvabi.tensors.torch_dtype(spec.dtype).itemsize:
        raise KVABIError(f"views[0].dtype: {planes[0].dtype} cannot hold {spec.dtype} codes")
    return [p.view(dt) for p in planes]


def _bind_own(choice, spec, views, vstride, isz):
    """vLLM's CPU cache (:data:`_OWN`) by components over its views: per layer a plane
    from its first byte, keys ``[D, N]`` then values ``[N, D]`` per block-head at vLLM's
    block and head strides."""
    import torch

    n, d = spec.block_size, spec.head_dim
    if vstride["N"] != 2 * d * isz:
        raise KVABIError(f"views[0].stride: vLLM layout {choice.vllm_name} should make each "
                         f"block-head one dense [2N, D] tile, but N has byte stride "
                         f"{vstride['N']} (expected {2 * d * isz})")
    outer = {"B": vstride["B"], "H": vstride["H"]}
    one = {"L": 1}  # every layer its own plane (vLLM's view of it)
    comps = [kvabi.Component(name="key", dtype=spec.dtype, count=d,
                             strides={**outer, "N": isz, "E": n * isz}, plane_strides=one),
             kvabi.Component(name="value", dtype=spec.dtype, count=d, offset=n * d * isz,
                             strides={**outer, "N": d * isz, "E": isz}, plane_strides=one)]
    nb, h = int(views[0].shape[0]), spec.num_kv_heads
    span = (nb - 1) * vstride["B"] + (h - 1) * vstride["H"] + 2 * n * d * isz
    layout = kvabi.Layout(sizes={"L": len(views), "B": nb, "N": n, "H": h}, components=comps,
                          plane_bytes=span, name=f"{choice.preset}@vllm.{choice.vllm_name}")
    planes = [torch.as_strided(v, (span // isz,), (1,), v.storage_offset()) for v in views]
    return layout, _typed(planes, spec)


def _bind_axes(choice, spec, views, tpl, vstride, isz):
    """The axis-form layout of vLLM's views for an axis preset (see :func:`bind`)."""
    import torch

    v0 = views[0]
    nb = int(v0.shape[0])
    # vLLM's dense run inside a block must be what the name says: check, don't assume.
    inner = _INNER[choice.vllm_name]
    run = [a if a not in ("KV", "D") else "C" for a in inner]
    run = list(dict.fromkeys(run))
    s = isz
    sizes_v = {"B": nb, "H": spec.num_kv_heads, "N": spec.block_size,
               "C": 2 * spec.head_dim}
    for a in reversed(run):
        if vstride[a] != s:
            raise KVABIError(f"views[0].stride: vLLM layout {choice.vllm_name} should make "
                             f"{'/'.join(run)} one dense run per block, but axis {a} has "
                             f"byte stride {vstride[a]} (expected {s})")
        s *= sizes_v[a]
    order = tuple(a for a in tpl.order if a != "L")
    sizes = {"L": len(views), "B": nb, "KV": 2, "N": spec.block_size,
             "H": spec.num_kv_heads, "D": spec.head_dim}
    strides, s = {}, isz
    for a in reversed(order):
        if a in _OUTER[choice.vllm_name]:
            strides[a] = vstride[a]
        else:
            strides[a] = s
            s *= sizes[a]
    folds = tuple(f for f in tpl.folds if "L" not in f)
    layout = kvabi.Layout(order=order, sizes=sizes, dtype=spec.dtype, planes=("L",),
                          strides=strides, folds=folds,
                          name=f"{choice.preset}@vllm.{choice.vllm_name}")
    planes = [torch.as_strided(v, layout.plane_shape, layout.plane_strides,
                               v.storage_offset()) for v in views]
    return layout, _typed(planes, spec)
