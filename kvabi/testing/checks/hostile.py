"""Hostile input a backend must refuse with a KVABIError before it writes anything
(``specs/security.md``): caches that are not a checked handle of the plan's layout, and
metadata whose lengths or block ids exceed what the layout can address.

Hostile numpy planes (and torch tensors over them) live at the start of a larger buffer
whose tail, the guard, is not part of the memory they claim: a backend that writes past
the memory it was given writes into the guard, where the check sees it, instead of
corrupting the process.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from ...layout.descriptor import Layout
from ...layout.presets import preset_names
from ...memory.cache import KVCache
from ...step.metadata import CommonAttentionMetadata
from ...util.dtypes import numpy_dtype
from ...util.errors import KVABIError
from ...util.tensors import to_numpy
from ..harness import UINT, Runner, in_framework, step_inputs
from ..measure import ConformanceFailure
from .base import KitOptions, Refused, WithExtra, attention_cases, not_refused


# -- guarded memory ---------------------------------------------------------------------------
class Guarded:
    """numpy planes of ``layout`` over buffers followed by ``guard`` more bytes; the planes'
    memory (as numpy and kvabi see it) ends before the guard."""

    def __init__(self, layout: Layout, guard: int, fill: int = 0x3C):
        isz = layout.itemsize
        visible = -(-layout.plane_nbytes // isz) * isz
        self.buffers, self.planes = [], []
        for _ in range(layout.num_planes):
            buf = np.full(visible + guard + isz, fill, np.uint8)
            head = np.frombuffer(memoryview(buf)[:visible], np.uint8)  # owns no guard
            plane = np.lib.stride_tricks.as_strided(
                head.view(UINT[isz]), layout.plane_shape,
                tuple(s * isz for s in layout.plane_strides)).view(numpy_dtype(layout.dtype))
            self.buffers.append(buf)
            self.planes.append(plane)
        self.before = [b.copy() for b in self.buffers]

    def changed(self) -> str | None:
        """Where the bytes (planes or guard) changed since construction, or None."""
        for i, (a, b) in enumerate(zip(self.buffers, self.before)):
            d = np.nonzero(a != b)[0]
            if len(d):
                return f"plane {i} byte {int(d[0])} ({len(d)} bytes changed)"
        return None


def _fewer_blocks(case) -> int:
    """A block count the step's writes do not fit in (0: none, every write is in block 0)."""
    m = case.meta
    real = m.slot_mapping[m.slot_mapping >= 0]
    return int(real.max()) // case.spec.block_size if len(real) else 0


def _on_host(backend) -> bool:
    """Whether the backend's arrays live in host memory the kit can guard (numpy, CPU
    torch); jax and device arrays are handed as copies and compared after the call."""
    if backend.framework == "numpy":
        return True
    if backend.framework != "torch":
        return False
    dev = backend.device()
    return dev is None or str(dev) == "cpu"


def _other_layout(backend, case) -> Layout | None:
    """Another preset of the case's spec, blocks and layers (dense for jax)."""
    lay = case.layout
    for name in preset_names(case.spec):
        try:
            other = Layout.preset(name, case.spec, lay.num_blocks, lay.num_layers)
        except KVABIError:
            continue
        if other != lay and (backend.framework != "jax" or other.is_c_contiguous):
            return other
    return None


def hostile_variants(backend, case) -> list[str]:
    """The hostile caches that apply to ``case``: ``plain_list`` (the right planes, not a
    checked handle), ``fewer_blocks`` (a handle of a smaller layout than the plan's: the
    step writes past it), ``other_layout`` (a handle of another preset: other offsets)."""
    out = ["plain_list"]
    if case.layout.name and _fewer_blocks(case) >= 1:
        out.append("fewer_blocks")
    if _other_layout(backend, case) is not None:
        out.append("other_layout")
    return out


def _to_framework(backend, arrays):
    """Planes in the backend's framework: over the same (guarded) memory for numpy and
    CPU torch, copies otherwise."""
    if not _on_host(backend):
        return [in_framework(backend, np.array(a)) for a in arrays]
    if backend.framework == "numpy":
        return list(arrays)
    import torch

    from ...util.tensors import torch_dtype

    out = []
    for a in arrays:
        name = str(a.dtype)
        raw = {"bfloat16": np.int16, "float8_e4m3fn": np.uint8,
               "float8_e5m2": np.uint8}.get(name)
        t = torch.from_numpy(a.view(raw) if raw is not None else a)
        out.append(t.view(torch_dtype(name)) if raw is not None else t)
    return out


def _hostile_cache(backend, case, variant):
    """(cache to hand, Guarded, the planes in the backend's framework, description)."""
    lay = case.layout
    if variant == "fewer_blocks":
        m = _fewer_blocks(case)
        lay = Layout.preset(lay.name, case.spec, m, lay.num_layers)
        what = (f"a cache of {m} blocks with a plan made for {case.layout.num_blocks} "
                f"blocks (the step writes block {m})")
    elif variant == "other_layout":
        lay = _other_layout(backend, case)
        what = f"a {lay.name} cache with a plan made for {case.layout.name or 'custom'}"
    else:
        what = "a plain list of the layout's planes (not a kvabi.KVCache)"
    g = Guarded(lay, 2 * lay.plane_nbytes + 64)
    planes = _to_framework(backend, g.planes)
    cache = list(planes) if variant == "plain_list" else KVCache.wrap(lay, planes)
    return cache, g if _on_host(backend) else None, planes, what


def _refused(what: str, call) -> None:
    try:
        call()
    except KVABIError:
        return
    except ConformanceFailure:
        raise
    except Exception as e:  # noqa: BLE001 - a backend must refuse with KVABIError
        raise not_refused(what, e) from e
    raise ConformanceFailure(f"{what}: accepted instead of refused with a KVABIError")


def check_hostile_cache(backend, reference, params, options: KitOptions = KitOptions()
                        ) -> float:
    """A cache that is not a checked handle of the plan's layout (a plain list of planes,
    a handle of fewer blocks, a handle of another layout) is refused by ``write_kv`` and
    ``attention`` with a KVABIError, and no byte of it (or past it) changes.
    ``params.extra["variants"]`` names the hostile caches tried, each in turn (see
    :func:`hostile_variants`)."""
    case = params.case
    variants = params.extra.get("variants")
    if variants is None:
        variants = (params.extra["variant"],)
    if not variants:  # e.g. torch planes of a one-block component layout: none applies
        return 0.0
    return Refused("; ".join(_hostile_step(backend, case, v) for v in variants))


def _hostile_step(backend, case, variant) -> str:
    b = Runner(backend, case, oracle=False)
    plan = b.plan(case.meta)
    cache, guarded, planes, what = _hostile_cache(backend, case, variant)
    k, v, q = step_inputs(case)
    before = None if guarded is not None else [to_numpy(p).copy() for p in planes]
    _refused(f"write_kv with {what}", lambda: backend.write_kv(
        plan, cache, key=in_framework(backend, k), value=in_framework(backend, v),
        layer=case.layer))
    _unchanged(f"write_kv with {what}", guarded, planes, before)
    _refused(f"attention with {what}", lambda: backend.attention(
        plan, cache, query=in_framework(backend, q), layer=case.layer))
    _unchanged(f"attention with {what}", guarded, planes, before)
    return what


def _unchanged(what, guarded, planes, before):
    if guarded is not None:
        d = guarded.changed()
        if d is not None:
            raise ConformanceFailure(f"{what}: refused, but bytes changed first at {d}")
    if before is not None:
        for i, (p, b) in enumerate(zip(planes, before)):
            try:
                now = to_numpy(p)
            except Exception as e:  # noqa: BLE001 - a deleted (donated) jax buffer
                raise ConformanceFailure(f"{what}: refused, but cache plane {i} was consumed "
                                         f"({type(e).__name__}: {e})") from e
            if now.tobytes() != b.tobytes():
                raise ConformanceFailure(f"{what}: refused, but cache plane {i} changed")


@st.composite
def _hostile_params(draw, backend, options):
    case = draw(attention_cases(backend, options, num_layers=(1, 2)))
    return WithExtra(case, {"variants": tuple(hostile_variants(backend, case))})


def hostile_cache_strategy(backend, options):
    return _hostile_params(backend, options)


# -- huge lengths ---------------------------------------------------------------------------
#: context lengths at and past the int32 and int64 limits
HUGE_CONTEXT = (2**31 - 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1)


def huge_meta(case, variant: str, value: int):
    """The case's metadata with one huge field (see :func:`check_huge_lengths`); raises
    KVABIError where kvabi's own constructors refuse it."""
    m, bs = case.meta, case.spec.block_size
    q = m.query_lens.astype(np.int64)
    c = m.context_lens.astype(np.int64).tolist()
    table = m.block_table.astype(np.int64)
    active = np.nonzero(q > 0)[0]
    r = int(active[-1])
    if variant == "context_len":
        c[r] = value
        return CommonAttentionMetadata.from_lengths(q.tolist(), c, table.tolist(), bs,
                                                    num_blocks=m.num_blocks,
                                                    num_tokens=m.num_tokens)
    if variant == "block_id":
        last = int(m.query_start_loc[r + 1]) - 1
        col = int(m.positions[last]) // bs
        table = table.tolist()
        table[r][col] = value
        return CommonAttentionMetadata.from_lengths(q.tolist(), c, table, bs,
                                                    num_tokens=m.num_tokens)
    if variant == "slot":
        last = int(m.query_start_loc[r + 1]) - 1
        slots = m.slot_mapping.astype(object).tolist()
        slots[last] = int(slots[last]) + value
        return CommonAttentionMetadata(m.query_start_loc.tolist(), m.seq_lens.tolist(),
                                       m.context_lens.tolist(), m.positions.tolist(), slots,
                                       m.block_table.tolist(), bs, m.num_blocks)
    if variant == "query_start_loc":
        qsl = m.query_start_loc.astype(object)
        qsl[r + 1:] = qsl[r + 1:] + value
        return CommonAttentionMetadata(qsl.tolist(), m.seq_lens.tolist(),
                                       m.context_lens.tolist(), m.positions.tolist(),
                                       m.slot_mapping.tolist(), m.block_table.tolist(), bs,
                                       m.num_blocks)
    raise ValueError(f"unknown huge_lengths variant {variant!r}")


def huge_values(case, variant: str) -> tuple[int, ...]:
    """Values tried for a variant: past int32/int64, and block ids just past the layout
    or whose slot wraps modulo 2**32 onto a real slot."""
    nb, bs = case.layout.num_blocks, case.spec.block_size
    if variant == "context_len":
        return HUGE_CONTEXT
    if variant == "block_id":
        wrap = (2**32 // bs) if 2**32 % bs == 0 else nb
        return tuple(dict.fromkeys((nb, nb + 1, wrap, 2**31 - 1, 2**32, -1)))
    if variant == "slot":
        return (2**32, 2**31, 2**63 - 1 - int(case.meta.slot_mapping.max(initial=0)))
    return (2**32, 2**31)


def check_huge_lengths(backend, reference, params, options: KitOptions = KitOptions()
                       ) -> float:
    """Metadata whose lengths or block ids exceed what the layout can address (a context
    length near or past 2**31, a block id past the layout's blocks or whose slot wraps
    modulo 2**32 onto a real one, a slot or query start past int32) is refused with a
    KVABIError by ``from_lengths``/the metadata constructor, by ``plan``, or by
    ``write_kv`` and ``attention`` before any write; never a crash or a write.
    ``params.extra["attempts"]`` lists the (variant, value) pairs tried, each in turn."""
    attempts = params.extra.get("attempts") or \
        ((params.extra["variant"], params.extra["value"]),)
    return Refused("; ".join(_huge_step(backend, params.case, v, x) for v, x in attempts))


def _huge_step(backend, case, variant, value) -> str:
    what = f"metadata with {variant} {value}"
    try:
        meta = huge_meta(case, variant, value)
    except KVABIError as e:
        return f"kvabi refused {what}: {e}"
    b = Runner(backend, case, oracle=False)
    try:
        plan = b.plan(meta)
    except KVABIError as e:
        return f"plan refused {what}: {e}"
    except ConformanceFailure:
        raise
    except Exception as e:  # noqa: BLE001
        raise not_refused(f"plan({what})", e) from e
    before = b.planes()
    k, v, q = step_inputs(case)
    _refused(f"write_kv({what})", lambda: b.write(plan, k, v))
    after = b.planes()
    for i, (x, y) in enumerate(zip(after, before)):
        if x.tobytes() != y.tobytes():
            raise ConformanceFailure(f"write_kv({what}): refused, but cache plane {i} "
                                     f"changed")
    _refused(f"attention({what})", lambda: b.attend(plan, q))
    return f"write_kv and attention refused {what}"


@st.composite
def _huge_params(draw, backend, options):
    case = draw(attention_cases(backend, options, num_layers=(1,)))
    attempts = tuple((v, draw(st.sampled_from(huge_values(case, v))))
                     for v in ("block_id", "context_len", "slot", "query_start_loc"))
    return WithExtra(case, {"attempts": attempts})


def huge_lengths_strategy(backend, options):
    return _huge_params(backend, options)
