"""The checks of a step, in one place: attention options, and that metadata, spec, layout
and tensors belong together.  :class:`kvabi.Backend` runs them at its boundary, so every
backend refuses bad input with the same messages."""
from __future__ import annotations

import math

import attrs
import numpy as np

from ..layout.descriptor import check_layout
from ..memory.planes import byte_span, overlaps
from ..model.quant import check_quant_layout
from ..model.spec import KVSpec
from ..util.coerce import INT32_MAX, INT64_MAX, as_float, as_int, real_array
from ..util.errors import KVABIError
from ..util.tensors import framework
from .metadata import CommonAttentionMetadata


def _positive(x, field):
    return None if x is None else as_float(x, field, positive=True)


def check_sinks(sinks, num_q_heads: int | None = None) -> np.ndarray | None:
    """Attention sinks as a read-only float64 copy, one logit per query head
    (``num_q_heads`` when known), or None.  Real numbers only (complex, bool, str refused); NaN and +inf refused (-inf is
    a head without a sink)."""
    if sinks is None:
        return None
    a = real_array(sinks, "sinks")
    if a.ndim != 1:
        raise KVABIError(f"sinks: must be 1-D, one logit per query head, got shape "
                         f"{a.shape}")
    a = np.array(a, np.float64)  # kvabi's own copy: the caller may change its array
    if np.isnan(a).any() or np.isposinf(a).any():
        raise KVABIError("sinks: must not be NaN or +inf")
    if num_q_heads is not None and a.shape != (num_q_heads,):
        raise KVABIError(f"sinks: must have one logit per query head ({num_q_heads}), "
                         f"got shape {a.shape}")
    a.flags.writeable = False
    return a


@attrs.frozen(eq=False)
class AttentionOptions:
    """Validated attention options: ``scale`` (resolved; default ``1/sqrt(head_dim)``),
    ``softcap`` and ``sinks`` (None when off; sinks float64, one logit per query head)."""

    scale: float
    softcap: float | None
    sinks: np.ndarray | None

    @classmethod
    def resolve(cls, spec: KVSpec, scale=None, softcap=None, sinks=None, *,
                num_q_heads: int | None = None) -> "AttentionOptions":
        """Check and resolve the plan-time options (``num_q_heads``, when given, must be a
        positive multiple of the spec's KV heads and fixes the sinks' length)."""
        if num_q_heads is not None:
            num_q_heads = check_num_q_heads(num_q_heads, spec)
        scale = 1.0 / math.sqrt(spec.head_dim) if scale is None else _positive(scale, "scale")
        softcap = _positive(softcap, "softcap")
        return cls(scale, softcap, check_sinks(sinks, num_q_heads))


def check_num_q_heads(num_q_heads, spec: KVSpec) -> int:
    """``num_q_heads`` (``plan``'s keyword): a positive multiple of the KV heads."""
    hq = as_int(num_q_heads, "num_q_heads", lo=1, hi=INT32_MAX)
    if hq % spec.num_kv_heads:
        raise KVABIError(f"num_q_heads: must be a positive multiple of the "
                         f"{spec.num_kv_heads} KV heads, got {hq}")
    return hq


def index_dtype(layout, spec: KVSpec | None = None) -> np.dtype:
    """The narrowest index dtype holding every slot of ``layout`` (``num_blocks *
    block_size``) and every token count: int32 when the slots stay below 2**31, int64
    otherwise.  Backends that index in 32 bits use this, never a silent cast."""
    bs = layout.size("N") if spec is None else spec.block_size
    return np.dtype(np.int32) if layout.num_blocks * bs <= INT32_MAX + 1 else \
        np.dtype(np.int64)


def check_step(meta, spec, layout) -> None:
    """Metadata, spec and layout belong together: types, block size, dtype, heads, head dim
    (the layout's ``D`` is the spec's), and block ids inside the layout's blocks.

    What a backend may rely on after it (before any kernel runs): every used block id is in
    ``[0, layout.num_blocks)``, so every real token's slot is in ``[0, layout.num_blocks *
    block_size)`` and fits the dtype :func:`index_dtype` gives (int64 always; int32 when
    that says so); ``seq_lens``, ``context_lens``, ``query_start_loc`` and ``num_tokens``
    fit in int32 (the metadata refuses longer ones when built).  The slot mapping itself is
    checked against the layout too (``-1`` or inside it).  Cheap: it runs per plan, in
    O(block table + tokens) vectorized work with no per-request loop.
    """
    if not isinstance(meta, CommonAttentionMetadata):
        raise KVABIError(f"meta: must be a CommonAttentionMetadata, got {type(meta).__name__}")
    if not isinstance(spec, KVSpec):
        raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
    if meta.block_size != spec.block_size:
        raise KVABIError(f"meta.block_size: must equal spec.block_size {spec.block_size}, "
                         f"got {meta.block_size}")
    check_layout(layout)
    if layout.dtype != spec.dtype:
        raise KVABIError(f"layout.dtype: must equal spec.dtype {spec.dtype!r}, got "
                         f"{layout.dtype!r}")
    check_quant_layout(spec, layout)  # scale components exactly when the spec stores them
    for axis, want in (("N", spec.block_size), ("H", spec.num_kv_heads)):
        if layout.size(axis) != want:
            raise KVABIError(f"layout.sizes.{axis}: must be {want} for this spec, got "
                             f"{layout.size(axis)}")
    if layout.size("D") != spec.head_dim:
        raise KVABIError(f"layout.sizes.D: must equal spec.head_dim {spec.head_dim}, got "
                         f"{layout.size('D')}")
    n = layout.num_blocks
    if n * spec.block_size - 1 > INT64_MAX:
        raise KVABIError(f"layout.num_blocks: {n} blocks of {spec.block_size} slots cannot "
                         f"be indexed in int64")
    if meta.num_tokens > INT32_MAX:
        raise KVABIError(f"meta.num_tokens: must fit in int32, got {meta.num_tokens}")
    bt = meta.block_table
    if bt.size:
        _check_block_ids(bt, meta, spec, n)
    slots = meta.slot_mapping
    if len(slots):
        # Consistent metadata has its slots in its blocks; checking them too costs two
        # reductions and keeps the guarantee if an array was changed after validation.
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= n * spec.block_size:
            t = int(np.argmax((slots < -1) | (slots >= n * spec.block_size)))
            raise KVABIError(f"slot_mapping: token {t} has slot {int(slots[t])}, outside the "
                             f"layout's {n} blocks of {spec.block_size} slots")


def _check_block_ids(bt, meta, spec, n) -> None:
    """Every used block table entry in ``[0, n)``.  Fast path without the used-columns
    mask: as unsigned, an id is >= n exactly when it is negative or too large; only then
    find whether a used entry is the culprit."""
    if bool((bt.view(np.uint32) >= min(n, 1 << 31)).any()):
        need = -(-meta.seq_lens.astype(np.int64) // spec.block_size)
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        bad = used & ((bt < 0) | (bt >= n))
        if bad.any():
            r, c = (int(x[0]) for x in np.nonzero(bad))
            raise KVABIError(f"block_table: entry [{r}, {c}] = {int(bt[r, c])} is "
                             f"outside the layout's {n} blocks")


# dtype -> "float", "real" (integers) or "other": str() of a numpy dtype costs microseconds,
# and a step's few dtypes are classified once
_DTYPE_CLASS: dict = {}


def dtype_class(dt) -> str:
    """``"float"``, ``"real"`` (integers) or ``"other"`` for a numpy, torch or jax dtype."""
    try:
        return _DTYPE_CLASS[dt]
    except (KeyError, TypeError):
        pass
    name = str(dt).replace("torch.", "")
    if getattr(dt, "kind", None) in ("c", "b", "U", "S", "O") or "complex" in name or \
            name.endswith("bool"):
        c = "other"
    else:
        c = "float" if name.startswith(("float", "bfloat")) else "real"
    try:
        if len(_DTYPE_CLASS) < 256:
            _DTYPE_CLASS[dt] = c
    except TypeError:  # an unhashable dtype-like object: classified every time
        pass
    return c


def real_dtype(x, field: str) -> None:
    """``x`` holds real numbers (any framework): complex, bool, string and object arrays
    would lose data or fail deep inside a kernel."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        raise KVABIError(f"{field}: must be an array, got {type(x).__name__}")
    if dtype_class(dt) == "other":
        raise KVABIError(f"{field}: must hold real numbers, got dtype {dt}")


def check_query(query, meta, spec) -> int:
    """Check a query tensor [T, Hq, D] (any framework; a floating dtype, which the output
    takes); returns Hq."""
    dt = getattr(query, "dtype", None)
    if dt is None or dtype_class(dt) != "float":
        real_dtype(query, "query")
        raise KVABIError(f"query.dtype: must be a floating-point dtype (the output has the "
                         f"query's), got {_dtype(query)}")
    t, h = meta.num_tokens, spec.num_kv_heads
    shape = tuple(query.shape)
    if len(shape) != 3 or shape[0] != t or shape[2] != spec.head_dim:
        raise KVABIError(f"query: must be [{t}, Hq, {spec.head_dim}], got {shape}")
    hq = shape[1]
    if hq <= 0 or hq % h:
        raise KVABIError(f"query: query heads must be a positive multiple of the {h} KV "
                         f"heads, got {hq}")
    return hq


def check_kv(key, value, meta, spec) -> None:
    """Check new K/V tensors [T, H, D] / [T, H, Dv] (value None for MLA; real dtypes)."""
    real_dtype(key, "key")
    if value is not None:
        real_dtype(value, "value")
    t, h = meta.num_tokens, spec.num_kv_heads
    if tuple(key.shape) != (t, h, spec.head_dim):
        raise KVABIError(f"key: must be [{t}, {h}, {spec.head_dim}], got {tuple(key.shape)}")
    if spec.is_mla:
        if value is not None:
            raise KVABIError(f"value: must be None for MLA (the latent is the key), got "
                             f"{type(value).__name__}")
    elif value is None or tuple(value.shape) != (t, h, spec.head_dim_v):
        got = None if value is None else tuple(value.shape)
        raise KVABIError(f"value: must be [{t}, {h}, {spec.head_dim_v}], got {got}")


def check_out(out, shape: tuple, query, fw: str, avoid=()) -> None:
    """``out=``: an array of the backend's framework ``fw``, of ``shape``, of the query's
    dtype (and device), writable, sharing no byte with the query nor with the spans in
    ``avoid`` (:meth:`kvabi.KVCache.layer_spans`: a kernel writing its output over the
    cache it reads would compute from its own output).  A jax ``out`` is only checked for
    shape and dtype: jax writes nothing in place."""
    if framework(out) != fw:
        raise KVABIError(f"out: must be a {fw} array (the backend's framework), got "
                         f"{type(out).__name__}")
    if tuple(out.shape) != shape:
        raise KVABIError(f"out.shape: must be {list(shape)}, got {list(out.shape)}")
    if out.dtype != query.dtype:
        raise KVABIError(f"out.dtype: must be the query's {_dtype(query)}, got {_dtype(out)}")
    if fw == "jax":
        return
    if fw == "numpy" and not out.flags.writeable:
        raise KVABIError("out: must be writable")
    if fw == "torch" and out.device != query.device:
        raise KVABIError(f"out.device: must be the query's {query.device}, got {out.device}")
    span = byte_span(out, fw)
    if overlaps(span, byte_span(query, fw)):
        raise KVABIError("out: shares memory with the query; the output needs its own")
    for s in avoid:
        if overlaps(span, s):
            raise KVABIError("out: shares memory with the cache the attention reads; the "
                             "output needs its own")


def _dtype(x) -> str:
    return str(x.dtype).replace("torch.", "")
