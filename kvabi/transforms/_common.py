"""Helpers shared by the transforms: argument checks and vectorized segment expansion."""
from __future__ import annotations

import numpy as np

from ..errors import KVABIError, require
from ..metadata import CommonAttentionMetadata


def check_meta(meta) -> CommonAttentionMetadata:
    """The transforms take CommonAttentionMetadata only (it validated itself when built)."""
    if not isinstance(meta, CommonAttentionMetadata):
        raise KVABIError(f"meta: must be CommonAttentionMetadata, got {type(meta).__name__}")
    return meta


def check_int(value, field: str, *, lo: int | None = None) -> int:
    """An integer argument (numpy integers accepted, bool refused), optionally >= lo."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    require(ok, field, "must be an int", value)
    if lo is not None:
        require(int(value) >= lo, field, f"must be >= {lo}", value)
    return int(value)


def int_array(x, field: str) -> np.ndarray:
    """A 1-D integer array (empty lists accepted) as int64."""
    a = np.asarray(x)
    require(a.ndim == 1, field, "must be 1-D", a.shape)
    if a.size == 0:
        return a.astype(np.int64)
    require(np.issubdtype(a.dtype, np.integer), field, "must be integers", a.dtype)
    return a.astype(np.int64)


def expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes ``counts``: (group of each element, index within its group).

    The vectorized form of ``[(g, i) for g, n in enumerate(counts) for i in range(n)]``.
    """
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return owner, np.arange(len(owner), dtype=np.int64) - starts[owner]


def query_bounds(meta: CommonAttentionMetadata):
    """(query_lens, context_lens, seq_lens, query_start_loc) as int64 arrays."""
    qsl = meta.query_start_loc.astype(np.int64)
    return (np.diff(qsl), meta.context_lens.astype(np.int64), meta.seq_lens.astype(np.int64),
            qsl)


def rebuild(meta: CommonAttentionMetadata, query_lens, context_lens, block_table, positions,
            slot_mapping) -> CommonAttentionMetadata:
    """New metadata with meta's block size and pool size; validated by construction."""
    q = np.asarray(query_lens, np.int64)
    c = np.asarray(context_lens, np.int64)
    qsl = np.zeros(len(q) + 1, np.int64)
    np.cumsum(q, out=qsl[1:])
    return CommonAttentionMetadata(qsl, c + q, c, positions, slot_mapping, block_table,
                                   meta.block_size, meta.num_blocks)
