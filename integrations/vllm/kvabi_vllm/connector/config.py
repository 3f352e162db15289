"""What both sides of KvabiConnector read from vLLM's configuration, once, at start: the
engine's facts (block size, KV cache groups and their windows, the model, tensor
parallelism) and the P/D settings (:class:`kvabi.pd.PDSettings`).

``kv_connector_extra_config`` keys (all optional):

| key | default | meaning |
|---|---|---|
| ``host_blocks`` | 0 | host tier blocks per KV cache group (0: no host tier) |
| ``nixl_host`` | ``"127.0.0.1"`` | the address this engine's NIXL agent listens on |
| ``pull_timeout_s`` | 30 | decode side: a request's pull (connect, grant, READs, checks) fails after this |
| ``hold_timeout_s`` | 120 | prefill side: blocks held for a decode engine are released after this |
| ``max_held`` | 256 | prefill side: requests holding blocks for decode engines at once |
| ``max_pulls`` | 64 | decode side: pulls queued or running at once (more are refused) |
| ``pull_threads`` | 4 | decode side: pulls running at once (a frozen peer holds one) |
| ``max_peers`` | 16 | decode side: prefill engines kept connected (least recently used dropped) |
| ``model_id`` | a digest of the model's configuration | the model's identity in this engine's handshakes (a decode engine refuses another) |

``kv_role``: ``kv_producer`` serves its prompts' KV to decode engines, ``kv_consumer``
reads prompts' KV from prefill engines, ``kv_both`` does both (two engines, of any
tensor-parallel sizes, serving each other's prefills); any role keeps a host tier when
``host_blocks`` is set.
"""
from __future__ import annotations

import hashlib
import json
import uuid

import attrs

from kvabi import KVABIError
from kvabi.util.coerce import as_float, as_int
from kvabi.pd import DEFAULTS as PD_DEFAULTS
from kvabi.pd import PDSettings

#: kv_connector_extra_config keys and their defaults (kvabi.pd's bounds, and where the NIXL
#: agent listens, and the model identity the handshakes state)
DEFAULTS = {**PD_DEFAULTS, "nixl_host": "127.0.0.1", "model_id": None}


def _extra(extra: dict) -> dict:
    """The extra config's known keys, checked (KVABIError naming the key and value)."""
    out = dict(DEFAULTS)
    for key, value in extra.items():
        name = f"kv_connector_extra_config.{key}"
        if key == "model_id":
            if value is not None:
                from kvabi.transfer.handshake import check_model

                out[key] = check_model(value, name)
        elif key == "nixl_host":
            if not isinstance(value, str) or not value:
                raise KVABIError(f"{name}: must be a host name or address, got {value!r}")
            out[key] = value
        elif key.endswith("_s") and key in DEFAULTS:
            out[key] = as_float(value, name, positive=True)
        elif key in DEFAULTS:
            out[key] = as_int(value, name, lo=0 if key == "host_blocks" else 1)
    return out


@attrs.frozen(eq=False)
class ConnectorConfig:
    """The connector's settings (``kv_transfer_config`` and ``kv_connector_extra_config``)
    and the engine's KV cache groups."""

    producer: bool           # kv_producer: serves its prompts' KV to decode engines
    consumer: bool           # kv_consumer: reads prompts' KV from prefill engines
    engine: str              # this engine's id (names its NIXL agent)
    block_size: int
    groups: tuple            # vLLM's KVCacheGroupSpec per KV cache group
    windows: tuple           # per group: its sliding window (None: full attention)
    model: str               # what makes one engine's KV bytes differ from another's
    max_model_len: int
    host_blocks: int = 0
    nixl_host: str = "127.0.0.1"
    pull_timeout_s: float = 30.0
    hold_timeout_s: float = 120.0
    max_held: int = 256
    max_pulls: int = 64
    pull_threads: int = 4
    max_peers: int = 16
    model_id: str | None = None     # what this engine's handshakes say the model is
    tp_size: int = 1                # tensor-parallel ranks (workers) of this engine
    num_kv_heads: int = 0           # the model's KV heads (all ranks together)

    @classmethod
    def from_vllm(cls, vllm_config, kv_cache_config) -> "ConnectorConfig":
        cfg = vllm_config.kv_transfer_config
        extra = _extra(dict(cfg.kv_connector_extra_config or {}))
        block_size = int(vllm_config.cache_config.block_size)
        groups = tuple(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else ()
        windows = tuple(getattr(g.kv_cache_spec, "sliding_window", None) or None
                        for g in groups)
        mc = vllm_config.model_config
        model = "|".join(str(x) for x in (getattr(mc, "model", ""), getattr(mc, "revision", ""),
                                           getattr(mc, "dtype", ""),
                                           vllm_config.cache_config.cache_dtype))
        if extra["model_id"] is None:
            extra["model_id"] = model_identity(vllm_config)
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        return cls(producer=cfg.kv_role in ("kv_producer", "kv_both"),
                   consumer=cfg.kv_role in ("kv_consumer", "kv_both"),
                   engine=cfg.engine_id or uuid.uuid4().hex[:8], block_size=block_size,
                   groups=groups, windows=windows, model=model,
                   max_model_len=int(getattr(mc, "max_model_len", 0) or 0), tp_size=tp,
                   num_kv_heads=total_kv_heads(vllm_config), **extra)

    @property
    def settings(self) -> PDSettings:
        """The P/D settings (role and bounds) of this engine."""
        role = {(True, True): "both", (True, False): "producer", (False, True): "consumer",
                (False, False): "none"}[(self.producer, self.consumer)]
        return PDSettings(role=role, pull_timeout_s=self.pull_timeout_s,
                          hold_timeout_s=self.hold_timeout_s, max_held=self.max_held,
                          max_pulls=self.max_pulls, pull_threads=self.pull_threads,
                          max_peers=self.max_peers, host_blocks=self.host_blocks,
                          nixl_host=self.nixl_host, model_id=self.model_id)


#: configuration keys that say where a checkpoint sits, not what the model is
_NOT_IDENTITY = ("_name_or_path", "transformers_version")


def model_identity(vllm_config) -> str | None:
    """The model's identity this engine's handshakes carry (a decode engine's negotiation
    refuses a producer serving another model): a digest of the model's Hugging Face
    configuration, the same for one checkpoint under any path, on any host, at any
    tensor-parallel size; None where the configuration cannot be read."""
    hf = getattr(vllm_config.model_config, "hf_config", None)
    try:
        cfg = hf.to_dict()
    except AttributeError:
        return None
    for k in _NOT_IDENTITY:
        cfg.pop(k, None)
    text = json.dumps(cfg, sort_keys=True, default=str)
    return "config:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def total_kv_heads(vllm_config) -> int:
    """The model's KV heads, all tensor-parallel ranks together (0 where unknown)."""
    try:
        return int(vllm_config.model_config.get_total_num_kv_heads())
    except (AttributeError, TypeError, ValueError):
        return 0


__all__ = ["ConnectorConfig", "DEFAULTS", "model_identity", "total_kv_heads"]
