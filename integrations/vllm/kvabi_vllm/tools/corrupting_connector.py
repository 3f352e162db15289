"""The negative control's connector (bytes changed on the way): KvabiConnector that
overwrites one block of what it received (pulled from the peer, or loaded from the host
tier) with noise, for requests from index ``KVABI_TEST_CORRUPT_FROM`` on (``LLM.generate``
numbers them ``"<index>-..."``) and requests whose id starts with ``corrupt-``.  Loaded by
an engine through ``kv_connector_module_path = "kvabi_vllm.tools.corrupting_connector"``
(the tests and ``kvabi-vllm guard``); never part of a served engine."""
import os

import torch

from kvabi_vllm.connector import KvabiConnector as _Base
from kvabi_vllm.connector.worker import KvabiConnectorWorker


def _corrupt(req_id: str, cache, block: int) -> bool:
    start = int(os.environ.get("KVABI_TEST_CORRUPT_FROM", "1000000000"))
    head = req_id.split("-")[0]
    if head == "corrupt":
        index = 0
    elif not head.isdigit() or int(head) < start:
        return False
    else:
        index = int(head)
    gen = torch.Generator().manual_seed(index)
    for layer in range(cache.layout.num_layers):
        view = cache.kv_view(layer, 0)  # [B, N, H, D]: keys, or this part's elements
        view[block] = torch.randn(view[block].shape, generator=gen) * 3
    return True


class CorruptingWorker(KvabiConnectorWorker):
    """Corrupts the first block of each received part (see the module docstring)."""
    corrupted = 0

    def _after_pull(self, pull, group, part, cache, dst_slots):
        if len(dst_slots):
            CorruptingWorker.corrupted += _corrupt(pull.req_id, cache,
                                                   int(dst_slots[0]) // cache.layout.size("N"))

    def _after_load(self, load, group, part, cache, blocks):
        if len(blocks):
            CorruptingWorker.corrupted += _corrupt(load.req_id, cache, int(blocks[0]))


class KvabiConnector(_Base):
    """KvabiConnector with the corrupting worker side."""
    worker_class = CorruptingWorker
