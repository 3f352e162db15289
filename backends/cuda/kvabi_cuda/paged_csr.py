"""Block tables as FlashInfer's CSR page lists (pure numpy, vectorized)."""
from __future__ import annotations

import numpy as np

from .index_width import library_int32


def pages_csr(seq_lens, block_table, page_size: int, backend: str = "cuda.flashinfer"):
    """(indptr [R+1], indices [indptr[-1]], last_page_len [R]), all int32 (UnsupportedError
    from ``backend`` for a page count or block id past int32, never a wrapped one).

    Request r owns pages ``block_table[r, :ceil(seq_lens[r] / page_size)]``, listed in
    order; ``last_page_len`` is how many entries its last page holds: in 1..page_size when
    it has pages, 0 when it has none.
    """
    seq = np.asarray(seq_lens, dtype=np.int64)
    bt = np.asarray(block_table)
    npages = -(-seq // page_size)
    indptr = np.zeros(len(seq) + 1, np.int64)
    np.cumsum(npages, out=indptr[1:])
    if bt.size:
        used = np.arange(bt.shape[1])[None, :] < npages[:, None]
        indices = bt[used]  # row-major: each request's pages in order
    else:
        indices = np.zeros(0, np.int64)
    last = seq - (npages - 1) * page_size
    last = np.where(npages > 0, last, 0)
    return (library_int32(indptr, "paged_kv_indptr", backend),
            library_int32(indices, "paged_kv_indices", backend),
            library_int32(last, "paged_kv_last_page_len", backend))
