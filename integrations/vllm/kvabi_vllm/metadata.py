"""vLLM's per-step ``CommonAttentionMetadata`` as kvabi's, vectorized (no loop per request).

vLLM and kvabi state the same thing (query start offsets, sequence lengths, a block table,
slot mapping); kvabi derives positions and slots from lengths and the block table.  One
proof per step: whether the block ids lie inside the cache is the plan's check
(``kvabi.check_step``, against the layout), not repeated here; what is checked here is
only what the plan cannot see, that vLLM's own slots agree with kvabi's token for token (a
disagreement means the two sides read the block table with different block sizes, and
the cache would be written where vLLM's scheduler does not expect it).
"""
from __future__ import annotations

import numpy as np

import kvabi
from kvabi.util.errors import KVABIError


def _np(t) -> np.ndarray:
    """A CPU numpy view (no copy on CPU) of a torch tensor."""
    return t.detach().cpu().numpy() if t.device.type != "cpu" else t.detach().numpy()


def from_vllm(cm, block_size: int) -> kvabi.CommonAttentionMetadata:
    """kvabi metadata of vLLM's ``CommonAttentionMetadata`` ``cm`` for a KV group of
    ``block_size``: the real tokens of its ``num_reqs`` requests (padding dropped: queries
    and keys are sliced to ``num_actual_tokens`` of the result).  KVABIError if vLLM's slot
    mapping disagrees with its block table."""
    r = int(cm.num_reqs)
    qsl = _np(cm.query_start_loc_cpu)[:r + 1].astype(np.int64)
    seq = _np(cm.seq_lens)[:r].astype(np.int64)
    q = np.diff(qsl)
    bt = _np(cm.block_table_tensor)[:r]
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        query_lens=q, context_lens=seq - q, block_table=bt, block_size=block_size)
    n = meta.num_tokens
    theirs = _np(cm.slot_mapping)[:n]
    if theirs.shape[0] != n or not np.array_equal(theirs, meta.slot_mapping):
        bad = np.nonzero(theirs != meta.slot_mapping[:theirs.shape[0]])[0]
        at = int(bad[0]) if len(bad) else theirs.shape[0]
        raise KVABIError(f"slot_mapping: vLLM's slot of token {at} "
                         f"({int(theirs[at]) if at < theirs.shape[0] else 'missing'}) "
                         f"disagrees with its block table (kvabi: "
                         f"{int(meta.slot_mapping[at])}), block_size {block_size}")
    return meta


def keep_indices(cm) -> np.ndarray | None:
    """The tokens whose outputs vLLM samples this step (``kv_sharing_fast_prefill``: the
    tokens KV-shared layers must compute), or None when vLLM did not arm it."""
    idx, num = getattr(cm, "logits_indices_padded", None), getattr(cm, "num_logits_indices",
                                                                    None)
    if idx is None or num is None:
        return None
    return _np(idx)[:int(num)].astype(np.int64)
