"""Helpers shared by the transforms: argument checks, vectorized segment expansion, and the
trusted assembly of their outputs."""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util import coerce
from ..util.errors import KVABIError


def check_meta(meta) -> CommonAttentionMetadata:
    """The transforms take CommonAttentionMetadata only (it was checked when built)."""
    if not isinstance(meta, CommonAttentionMetadata):
        raise KVABIError(f"meta: must be CommonAttentionMetadata, got {type(meta).__name__}")
    return meta


def check_int(value, field: str, *, lo: int | None = None,
              hi: int | None = coerce.INT32_MAX) -> int:
    """An integer argument (numpy integers accepted; bool, float, str refused) in
    ``[lo, hi]``; ``hi`` defaults to int32's maximum, the range of token and request
    counts."""
    return coerce.as_int(value, field, lo=lo, hi=hi)


def int_array(x, field: str) -> np.ndarray:
    """A 1-D integer array (empty lists accepted) as int64; floats, bools, complex, strings
    and ragged lists refused."""
    return coerce.int_array(x, field, ndim=1)


def expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For groups of sizes ``counts``: (group of each element, index within its group).

    The vectorized form of ``[(g, i) for g, n in enumerate(counts) for i in range(n)]``.
    """
    counts = np.asarray(counts, np.int64)
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return owner, np.arange(len(owner), dtype=np.int64) - np.repeat(starts, counts)


def query_bounds(meta: CommonAttentionMetadata):
    """(query_lens, context_lens, seq_lens, query_start_loc) as int64 arrays."""
    qsl = meta.query_start_loc.astype(np.int64)
    return (np.diff(qsl), meta.context_lens.astype(np.int64), meta.seq_lens.astype(np.int64),
            qsl)


def assemble(meta: CommonAttentionMetadata, query_lens, context_lens, block_table,
             positions, slot_mapping) -> CommonAttentionMetadata:
    """New metadata with ``meta``'s block size and pool size, built without validation.

    The caller (a transform) derives every argument from ``meta``, which was checked, so
    lengths stay within int32 and block ids within the pool; the transforms' property tests
    show every output passes :meth:`~kvabi.CommonAttentionMetadata.validate`.  Arrays are
    made C-contiguous in the field dtypes (no copy where they already are).
    """
    q = np.asarray(query_lens, np.int64)
    c = np.asarray(context_lens, np.int64)
    qsl = np.zeros(len(q) + 1, np.int32)
    np.cumsum(q, out=qsl[1:], dtype=np.int32)
    return CommonAttentionMetadata._trusted(
        qsl, (c + q).astype(np.int32), c.astype(np.int32),
        np.ascontiguousarray(positions, np.int64), np.ascontiguousarray(slot_mapping, np.int64),
        np.ascontiguousarray(block_table, np.int32), meta.block_size, meta.num_blocks)
