"""Moving KV: copy plans between layouts, executed locally, to host memory, or across
processes on NIXL (``specs/transfer.md``).

numpy only at import time; torch, jax and nixl are imported when used.
"""
from .execute import execute
from .host_pool import HostPool, cross_layer_twin
from .plan import TransferPlan, check_compatible, plan_block_transfer, plan_transfer

__all__ = ["HostPool", "TransferPlan", "check_compatible", "cross_layer_twin", "execute",
           "plan_block_transfer", "plan_transfer"]
