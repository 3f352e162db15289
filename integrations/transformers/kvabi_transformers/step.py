"""One continuous-batching step of transformers as kvabi metadata.

transformers' paged cache hands the model, per step, packed queries (``cu_seq_lens_q``,
``position_ids``) and per-token physical row indices into its cache tensor
(``write_index``: the new tokens; ``read_index``: every token of every request, when any
request has cached context).  With one full-attention allocator, row ``r`` is token
``r % stride`` of block ``r // stride``; kvabi's block table of a request is the block of
every ``block_size``-th token.  All of it is vectorized (numpy), no loop per request.
"""
from __future__ import annotations

import numpy as np
from kvabi import CommonAttentionMetadata, KVABIError


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, index within group) of every element of groups sized ``counts``."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return owner, np.arange(len(owner), dtype=np.int64) - starts[owner]


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


def step_metadata(cu_seq_lens_q, position_ids, write_index, read_index, *, block_size: int,
                  stride: int, first_block: int, num_blocks: int) -> CommonAttentionMetadata:
    """kvabi metadata of one step from transformers' paged-attention inputs.

    ``stride``: rows per block of the bookkeeping allocator; ``first_block``: its first data
    block (those before are its trash blocks), subtracted so kvabi block ids start at 0;
    ``num_blocks``: kvabi's pool size.  The slots kvabi derives from the block table are
    checked against transformers' write indices (KVABIError if they differ).
    """
    cu = _np(cu_seq_lens_q).reshape(-1)
    pos = _np(position_ids).reshape(-1)
    write = _np(write_index).reshape(-1)
    read = _np(read_index).reshape(-1)
    q = np.diff(cu)
    keep = q > 0  # padding requests (plateaus of cu_seq_lens_q) carry no tokens
    cu = np.concatenate([[0], np.cumsum(q[keep])])
    q = q[keep]
    total = int(cu[-1])
    ctx = pos[cu[:-1]]
    seq = ctx + q
    nblk = -(-seq // block_size)
    owner, j = _expand(nblk)
    if read.size:
        if read.size < int(seq.sum()):
            raise KVABIError(f"read_index: {read.size} rows for {int(seq.sum())} tokens")
        start = np.concatenate([[0], np.cumsum(seq)[:-1]])
        rows = read[start[owner] + j * block_size]
    else:
        if ctx.any():
            raise KVABIError("read_index: empty although requests have cached context")
        rows = write[cu[:-1][owner] + j * block_size]
    table = np.zeros((len(q), int(nblk.max(initial=0))), np.int64)
    table[owner, j] = rows // stride - first_block
    # Tokens past the real ones (static-shape padding) stay padding: slot -1.
    meta = CommonAttentionMetadata.from_lengths(q, ctx, table, block_size,
                                                num_blocks=num_blocks, num_tokens=len(pos))
    hf_slots = (write[:total] // stride - first_block) * block_size + write[:total] % stride
    bad = np.nonzero(meta.slot_mapping[:total] != hf_slots)[0]
    if len(bad):
        t = int(bad[0])
        raise KVABIError(f"write_index: token {t} is written to slot {int(hf_slots[t])} by "
                         f"transformers but to {int(meta.slot_mapping[t])} by the block table")
    return meta
