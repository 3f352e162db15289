"""Validation every backend performs on a step: attention options, and that metadata,
spec, layout and tensors belong together.  Public so that third-party backends refuse bad
input with the same messages as the built-in ones."""
from __future__ import annotations

import math

import attrs
import numpy as np

from .errors import KVABIError
from .metadata import CommonAttentionMetadata
from .spec import KVSpec


def _positive(x, field):
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise KVABIError(f"{field}: must be a number or None, got {x!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise KVABIError(f"{field}: must be a positive finite number, got {x!r}")
    return v


@attrs.frozen(eq=False)
class AttentionOptions:
    """Validated attention options: ``scale`` (resolved; default ``1/sqrt(head_dim)``),
    ``softcap`` and ``sinks`` (None when off; sinks float64, one logit per query head)."""

    scale: float
    softcap: float | None
    sinks: np.ndarray | None

    @classmethod
    def resolve(cls, spec: KVSpec, scale=None, softcap=None, sinks=None) -> "AttentionOptions":
        scale = 1.0 / math.sqrt(spec.head_dim) if scale is None else _positive(scale, "scale")
        softcap = _positive(softcap, "softcap")
        if sinks is not None:
            sinks = np.asarray(sinks, dtype=np.float64)
            if sinks.ndim != 1:
                raise KVABIError(f"sinks: must be 1-D, one logit per query head, got shape "
                                 f"{sinks.shape}")
            if np.isnan(sinks).any():
                raise KVABIError("sinks: must not be NaN")
        return cls(scale, softcap, sinks)

    def check_heads(self, num_q_heads: int) -> None:
        """Sinks, when given, hold one logit per query head."""
        if self.sinks is not None and self.sinks.shape != (num_q_heads,):
            raise KVABIError(f"sinks: must have one logit per query head ({num_q_heads}), "
                             f"got shape {self.sinks.shape}")


def check_step(meta, spec, layout) -> None:
    """Metadata, spec and layout belong together: types, block size, dtype, heads, head dim,
    and block ids inside the layout's blocks."""
    if not isinstance(meta, CommonAttentionMetadata):
        raise KVABIError(f"meta: must be a CommonAttentionMetadata, got {type(meta).__name__}")
    if not isinstance(spec, KVSpec):
        raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
    if meta.block_size != spec.block_size:
        raise KVABIError(f"meta.block_size: must equal spec.block_size {spec.block_size}, "
                         f"got {meta.block_size}")
    if layout.dtype != spec.dtype:
        raise KVABIError(f"layout.dtype: must equal spec.dtype {spec.dtype!r}, got "
                         f"{layout.dtype!r}")
    for axis, want in (("N", spec.block_size), ("H", spec.num_kv_heads)):
        if layout.size(axis) != want:
            raise KVABIError(f"layout.sizes.{axis}: must be {want} for this spec, got "
                             f"{layout.size(axis)}")
    if layout.size("D") < spec.head_dim:
        raise KVABIError(f"layout.sizes.D: must be >= head_dim {spec.head_dim}, got "
                         f"{layout.size('D')}")
    n = layout.num_blocks
    need = -(-meta.seq_lens.astype(np.int64) // spec.block_size)
    used = np.arange(meta.block_table.shape[1])[None, :] < need[:, None]
    bad = used & ((meta.block_table < 0) | (meta.block_table >= n))
    if bad.any():
        r, c = (int(x[0]) for x in np.nonzero(bad))
        raise KVABIError(f"block_table: entry [{r}, {c}] = {int(meta.block_table[r, c])} is "
                         f"outside the layout's {n} blocks")


def check_query(query, meta, spec) -> int:
    """Check a query tensor [T, Hq, D] (any framework); returns Hq."""
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
    """Check new K/V tensors [T, H, D] / [T, H, Dv] (value None for MLA)."""
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
