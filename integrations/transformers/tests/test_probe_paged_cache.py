"""transformers' own paged-cache write, probed: the layout its continuous-batching cache
really has (``FullAttentionCacheAllocator``: one uint8 tensor; per block, for each layer, a
page of keys then a page of values).  kvabi names it: ``kvbm.fully_contiguous``.

Nothing here reimplements transformers' addressing: slots become write indices through the
allocator's own ``get_write_indices`` (a one-block table per token), and the cache is
written by its own ``update``.
"""
import math

import numpy as np
import pytest
import torch

import kvabi
from kvabi.probe import infer_layout, verify_layout

cb = pytest.importorskip("transformers.generation.continuous_batching.cache_allocators")
from transformers import LlamaConfig  # noqa: E402
from transformers.generation.continuous_batching.cache_allocators.cache_pool import (  # noqa: E402
    CachePool)
from transformers.generation.continuous_batching.cache_allocators.full_attention import (  # noqa: E402
    FullAttentionCacheAllocator)

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 8, 4


def transformers_cache(dtype, num_sectors=2):
    """A full-attention allocator over a fresh cache tensor, and its write."""
    config = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=HEADS * 2,
                         num_key_value_heads=HEADS, hidden_size=HEADS * 2 * HEAD_DIM,
                         head_dim=HEAD_DIM)
    alloc = FullAttentionCacheAllocator(
        index=0, config=config, num_key_value_heads=HEADS, cache_dtype=dtype, page_size=PAGE,
        layer_indices=list(range(LAYERS)), allow_block_sharing=False)
    sector = math.lcm(alloc.bytes_per_block, 128)
    tensor = torch.zeros((num_sectors + 2) * sector, dtype=torch.uint8)  # 2 trash sectors
    alloc.register_cache_tensor(sector, num_sectors * sector, tensor,
                                CachePool(num_sectors, 1))
    num_blocks = tensor.numel() // alloc.bytes_per_block

    def write(layer, slots, key, value):
        rows = []
        for i, s in enumerate(np.asarray(slots).tolist()):
            alloc.block_table[f"r{i}"] = [s // PAGE]
            rows += alloc.get_write_indices(f"r{i}", s % PAGE, 1)
        alloc.update(kvabi.tensors.to_torch(key), kvabi.tensors.to_torch(value), layer,
                     torch.zeros(0, dtype=torch.long), torch.tensor(rows, dtype=torch.long))
    return tensor, write, num_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_attention_cache_is_kvbm_fully_contiguous(dtype):
    tensor, write, num_blocks = transformers_cache(dtype)
    name = str(dtype).replace("torch.", "")
    spec = kvabi.KVSpec("full", block_size=PAGE, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                        dtype=name)
    got = infer_layout(spec, [tensor], write, num_blocks=num_blocks, num_layers=LAYERS)
    assert got.name == "kvbm.fully_contiguous"
    assert got.order == ("B", "L", "KV", "N", "H", "D")
    verify_layout(got, [tensor], write)
    # the per-layer presets kvabi-transformers can allocate are not what transformers writes
    other = kvabi.Layout.preset("vllm.BLNHC", spec, num_blocks, LAYERS)
    with pytest.raises(kvabi.KVABIError, match="from where vllm.BLNHC puts it"):
        verify_layout(other, [tensor], write)
