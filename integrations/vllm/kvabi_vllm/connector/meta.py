"""What KvabiConnector's scheduler side tells its worker side each step, and what the
worker side tells the scheduler side once at start: kvabi.pd's plain data in vLLM's
metadata classes; and the one fact about vLLM's block ids the protocol needs (its null
block is block 0; the protocol's is -1)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvabi.pd import Served, StepWork
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata)

#: vLLM's null block (``BlockPool`` block 0): a placeholder in a group's block list for a
#: block the request does not hold (sliding-window blocks out of the window)
VLLM_NULL = 0


def pd_blocks(block_ids) -> list[list[int]]:
    """vLLM's block lists (per KV cache group) as the protocol's: its null block as -1."""
    out = []
    for ids in block_ids:
        a = np.asarray(list(ids), np.int64)
        out.append(np.where(a == VLLM_NULL, -1, a).tolist())
    return out


@dataclass
class KvabiConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side (:class:`kvabi.pd.StepWork`)."""
    work: StepWork = field(default_factory=StepWork)


@dataclass
class KvabiHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker serves (:class:`kvabi.pd.Served`): its handshake messages per KV cache
    group and part, its grant table's, and the seed of its host tier's keys."""
    handshakes: list = field(default_factory=list)
    grants: str = ""
    host_seed: bytes = b""

    @classmethod
    def of(cls, served: Served) -> "KvabiHandshakeMetadata":
        return cls(list(served.handshakes), served.grants, served.host_seed)

    def served(self) -> Served:
        return Served(list(self.handshakes), self.grants, self.host_seed)


__all__ = ["KvabiConnectorMetadata", "KvabiHandshakeMetadata", "VLLM_NULL", "pd_blocks"]
