"""vLLM's per-step metadata -> kvabi's: positions and slots against the direct formula,
padding dropped, a slot mapping that disagrees with the block table refused, and the
tokens vLLM samples (fast prefill) read back."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvabi.util.errors import KVABIError
from kvabi_vllm.metadata import from_vllm, keep_indices

BS = 4


def vllm_meta(query_lens, context_lens, table, pad_tokens=0, pad_reqs=0, slots=None):
    """What vLLM's model runner hands a builder (CPU tensors), built by the formula."""
    q, c = np.array(query_lens), np.array(context_lens)
    qsl = np.concatenate([[0], np.cumsum(q)])
    pos = np.concatenate([np.arange(ci, ci + qi) for qi, ci in zip(q, c)])
    req = np.repeat(np.arange(len(q)), q)
    t = np.array(table)
    ref = t[req, pos // BS] * BS + pos % BS
    sm = np.concatenate([ref if slots is None else slots, -np.ones(pad_tokens, np.int64)])
    qsl_p = np.concatenate([qsl, np.full(pad_reqs, qsl[-1])])
    seq_p = np.concatenate([q + c, np.zeros(pad_reqs, np.int64)])
    t_p = np.concatenate([t, np.zeros((pad_reqs, t.shape[1]), t.dtype)])
    return SimpleNamespace(
        num_reqs=len(q), num_actual_tokens=int(qsl[-1]) + pad_tokens,
        query_start_loc_cpu=torch.tensor(qsl_p, dtype=torch.int32),
        seq_lens=torch.tensor(seq_p, dtype=torch.int32),
        block_table_tensor=torch.tensor(t_p, dtype=torch.int32),
        slot_mapping=torch.tensor(sm, dtype=torch.int64)), pos, ref


def test_from_vllm_matches_the_formula_and_drops_padding():
    cm, pos, ref = vllm_meta([1, 6, 0, 3], [9, 0, 5, 2], [[3, 1, 7], [2, 0, 0], [4, 5, 0],
                                                          [6, 0, 0]], pad_tokens=3, pad_reqs=2)
    meta = from_vllm(cm, BS)
    assert meta.num_reqs == 4 and meta.num_tokens == 10
    np.testing.assert_array_equal(meta.positions, pos)
    np.testing.assert_array_equal(meta.slot_mapping, ref)
    np.testing.assert_array_equal(meta.context_lens, [9, 0, 5, 2])


def test_a_slot_mapping_that_disagrees_with_the_block_table_is_refused():
    cm, _, ref = vllm_meta([2, 2], [0, 3], [[1, 0], [2, 3]])
    bad = ref.copy()
    bad[3] += 1
    cm2, _, _ = vllm_meta([2, 2], [0, 3], [[1, 0], [2, 3]], slots=bad)
    assert from_vllm(cm, BS).num_tokens == 4
    with pytest.raises(KVABIError, match="slot_mapping: vLLM's slot of token 3"):
        from_vllm(cm2, BS)


def test_keep_indices_are_vllms_sampled_tokens():
    cm, _, _ = vllm_meta([3, 1], [0, 4], [[0, 1], [2, 3]])
    assert keep_indices(cm) is None
    cm.logits_indices_padded = torch.tensor([2, 3, 3, 3])
    cm.num_logits_indices = 2
    np.testing.assert_array_equal(keep_indices(cm), [2, 3])
