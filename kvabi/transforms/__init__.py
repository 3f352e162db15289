"""Pure, vectorized transforms of :class:`~kvabi.CommonAttentionMetadata`.

Each takes metadata (never mutated), checks its other arguments (KVABIError naming the
field and value, through :mod:`kvabi.util.coerce`) and returns new metadata, plus whatever index
arrays line the result up with the input.  The input was checked when it was built, so the
output is assembled without validating it again (vectorized, no per-request or per-token
Python); the property tests prove every output passes
:meth:`~kvabi.CommonAttentionMetadata.validate`.  Outputs may share arrays with the input.

May import: util, model, layout, memory, step.
"""
from .cascade import cascade_split
from .local_batches import local_virtual_batches
from .pad import pad
from .prefill_skip import prefill_skip
from .reorder import permute_requests, reorder_decode_first, split_decode_prefill
from .ubatch import split_ubatches
from .update_slices import kv_update_slices

__all__ = ["cascade_split", "kv_update_slices", "local_virtual_batches", "pad",
           "permute_requests", "prefill_skip", "reorder_decode_first", "split_decode_prefill",
           "split_ubatches"]
