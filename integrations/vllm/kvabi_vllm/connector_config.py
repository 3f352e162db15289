"""What both sides of KvabiConnector read from vLLM's configuration, once, at start."""
from __future__ import annotations

import uuid

import attrs
import numpy as np


def window_blocks(spec, block_size: int) -> int | None:
    """Blocks a sliding-window group needs before a block boundary (None: all of them):
    the first token computed after it attends back ``window - 1`` tokens."""
    w = getattr(spec, "sliding_window", None)
    return None if not w else max(-(-(int(w) - 1) // block_size), 1)


@attrs.frozen(eq=False)
class ConnectorConfig:
    """The connector's settings (``kv_transfer_config`` and ``kv_connector_extra_config``)
    and the engine's KV cache groups."""

    producer: bool           # kv_producer: serves its prompts' KV to decode engines
    consumer: bool           # kv_consumer: reads prompts' KV from prefill engines
    engine: str              # this engine's id (names its NIXL agent)
    block_size: int
    groups: tuple            # vLLM's KVCacheGroupSpec per KV cache group
    need_back: np.ndarray    # per group: blocks it needs before a position (full: all)
    host_blocks: int         # host tier blocks per group (0: no host tier)
    nixl_host: str           # the address the NIXL agent listens on

    @classmethod
    def from_vllm(cls, vllm_config, kv_cache_config) -> "ConnectorConfig":
        cfg = vllm_config.kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        block_size = int(vllm_config.cache_config.block_size)
        groups = tuple(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else ()
        need = np.array([window_blocks(g.kv_cache_spec, block_size) or 1 << 40
                         for g in groups], np.int64)
        # P/D needs one side each; kv_both engines use the host tier only
        return cls(producer=cfg.kv_role == "kv_producer", consumer=cfg.kv_role == "kv_consumer",
                   engine=cfg.engine_id or uuid.uuid4().hex[:8], block_size=block_size,
                   groups=groups, need_back=need, host_blocks=int(extra.get("host_blocks", 0)),
                   nixl_host=str(extra.get("nixl_host", "127.0.0.1")))
