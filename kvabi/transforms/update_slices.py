"""The Pallas KV-cache update input: contiguous (cache slot, new K/V token, length) runs."""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.coerce import INT32_MAX
from ._common import check_int, check_meta, expand, query_bounds

#: Largest padding factor: the slices are padded to a multiple of it, so it bounds memory
#: (vLLM's TPU runner uses single or double digits).
MAX_SLICES_PER_BLOCK = 1 << 16


def kv_update_slices(meta: CommonAttentionMetadata, num_slices_per_block: int = 8
                     ) -> tuple[np.ndarray, int]:
    """Slices that write the step's new K/V into a paged cache, never crossing a page.

    One row ``(cache_start slot, new_kv_start token index, length)`` per request per page
    its new tokens touch, in request then page order.  Returns ``(slices, num_slices)`` with
    ``slices`` of shape ``[3, padded]``: row 0 cache starts, row 1 token starts, row 2
    lengths; ``padded`` is ``num_slices`` rounded up to a multiple of
    ``num_slices_per_block`` (at least one block), filled with zero-length rows.  Copying
    ``new_kv[new_kv_start:new_kv_start+length]`` to ``cache[cache_start:cache_start+length]``
    for every row writes exactly ``cache[slot_mapping[t]] = new_kv[t]``.

    The dtype is int32 when every slot of the pool fits in it (``num_blocks * block_size <=
    2**31``, or, without ``num_blocks``, every slice end does), int64 otherwise: a slot is
    never truncated.  Token starts and lengths always fit in int32.
    ``num_slices_per_block`` is at most :data:`MAX_SLICES_PER_BLOCK`.
    """
    meta = check_meta(meta)
    per = check_int(num_slices_per_block, "num_slices_per_block", lo=1,
                    hi=MAX_SLICES_PER_BLOCK)
    bs = meta.block_size
    q, c, s, qsl = query_bounds(meta)
    first = c // bs
    count = np.where(q > 0, (s - 1) // bs - first + 1, 0)
    req, i = expand(count)
    page = first[req] + i
    start = np.maximum(c[req], page * bs)
    end = np.minimum(s[req], (page + 1) * bs)
    n = len(req)
    padded = max(1, -(-n // per)) * per
    cache_start = meta.block_table[req, page].astype(np.int64) * bs + start % bs
    if meta.num_blocks is not None:
        wide = meta.num_blocks * bs > INT32_MAX + 1
    else:
        wide = n > 0 and int(cache_start.max()) + bs > INT32_MAX + 1
    out = np.zeros((3, padded), np.int64 if wide else np.int32)
    out[0, :n] = cache_start
    out[1, :n] = qsl[req] + (start - c[req])
    out[2, :n] = end - start
    return out, n
