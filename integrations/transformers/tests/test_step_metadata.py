"""transformers' per-step read/write indices become kvabi metadata (a direct oracle:
indices built here from known block assignments, the way transformers' full-attention
allocator lays them out)."""
import numpy as np
import pytest
import torch
from kvabi import KVABIError
from kvabi_transformers.step import step_metadata

BS, FIRST = 4, 2
STRIDE = 2 * BS  # one layer: a block is BS key rows then BS value rows


def hf_rows(blocks, start, length):
    """Physical rows of tokens [start, start+length) of a request owning ``blocks``."""
    return [(blocks[p // BS] + FIRST) * STRIDE + p % BS for p in range(start, start + length)]


def case(ctx, qlen, tables):
    cu = np.concatenate([[0], np.cumsum(qlen)])
    pos = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx, qlen)])
    write = sum((hf_rows(t, c, q) for t, c, q in zip(tables, ctx, qlen)), [])
    read = sum((hf_rows(t, 0, c + q) for t, c, q in zip(tables, ctx, qlen)), []) \
        if any(ctx) else []
    return [torch.tensor(x, dtype=torch.int64) for x in (cu, pos[None], write, read)]


@pytest.mark.parametrize("ctx", [[0, 0, 0], [5, 0, 9], [8, 3, 0]])
def test_metadata_from_indices(ctx):
    qlen = [3, 6, 1]
    tables = [[4, 0, 7], [1, 5, 2], [3, 6, 8]]
    cu, pos, write, read = case(ctx, qlen, tables)
    meta = step_metadata(cu, pos, write, read, block_size=BS, stride=STRIDE,
                         first_block=FIRST, num_blocks=9)
    assert meta.query_lens.tolist() == qlen
    assert meta.context_lens.tolist() == ctx
    for r, (c, q) in enumerate(zip(ctx, qlen)):
        need = -(-(c + q) // BS)
        assert meta.block_table[r, :need].tolist() == tables[r][:need]
    want_slots = [tables[r][p // BS] * BS + p % BS
                  for r, (c, q) in enumerate(zip(ctx, qlen)) for p in range(c, c + q)]
    assert meta.slot_mapping.tolist() == want_slots


def test_disagreeing_write_index_is_refused():
    cu, pos, write, read = case([5, 0], [2, 3], [[4, 0], [1, 5]])
    write[1] += 1  # a token transformers would write elsewhere
    with pytest.raises(KVABIError, match="write_index: token 1"):
        step_metadata(cu, pos, write, read, block_size=BS, stride=STRIDE, first_block=FIRST,
                      num_blocks=9)


def test_missing_read_index_with_context_is_refused():
    cu, pos, write, _ = case([5, 0], [2, 3], [[4, 0], [1, 5]])
    with pytest.raises(KVABIError, match="read_index: empty"):
        step_metadata(cu, pos, write, torch.zeros(0, dtype=torch.int64), block_size=BS,
                      stride=STRIDE, first_block=FIRST, num_blocks=9)


def test_static_shape_padding_stays_padding():
    cu, pos, write, read = case([5, 0], [2, 3], [[4, 0], [1, 5]])
    # transformers pads to static shapes: plateaus in cu_seq_lens_q, zero positions
    cu = torch.cat([cu, cu[-1:], cu[-1:]])
    pos = torch.cat([pos, torch.zeros(1, 3, dtype=torch.int64)], dim=1)
    meta = step_metadata(cu, pos, write, read, block_size=BS, stride=STRIDE,
                         first_block=FIRST, num_blocks=9)
    assert meta.num_reqs == 2 and meta.num_tokens == 8 and meta.num_actual_tokens == 5
    assert meta.slot_mapping[5:].tolist() == [-1, -1, -1]
