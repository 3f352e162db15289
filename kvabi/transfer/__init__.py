"""Moving KV: copy plans between layouts, executed locally, to host memory, or across
processes on NIXL (``specs/transfer.md``).

numpy only at import time; torch, jax and nixl are imported when used.

May import: util, model, layout, memory.
"""
from .execute import execute
from .host_pool import HostPool, cross_layer_twin
from .negotiate import Cost, Negotiation, Refused, negotiate
from .plan import TransferPlan, check_compatible, plan_block_transfer, plan_transfer
from .shards import (ShardPlan, execute_shards, plan_shard_block_transfer, plan_shard_transfer,
                     plan_tp_transfer)

__all__ = ["Cost", "HostPool", "Negotiation", "Refused", "ShardPlan", "TransferPlan",
           "check_compatible", "cross_layer_twin", "execute", "execute_shards", "negotiate",
           "plan_block_transfer", "plan_shard_block_transfer", "plan_shard_transfer",
           "plan_tp_transfer", "plan_transfer"]
