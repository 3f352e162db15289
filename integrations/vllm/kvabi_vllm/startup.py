"""kvabi-vllm's configuration checks, at the earliest point each can run.

- :func:`~kvabi_vllm.env.backend_from_env` (the vLLM plugin, in every vLLM process, before vLLM reads its
  configuration): the kvabi variables themselves.  ``KVABI_VLLM_BACKEND`` set but empty,
  ``KVABI_VLLM_LAYOUT`` without a backend or not one of vLLM's names, a backend that is not
  registered or not available here: each is refused naming the variable, its value and
  the fix, instead of being ignored or failing in a worker.
- :func:`check_config` (right after vLLM builds its configuration, in the process that
  starts the engine, before any engine process is spawned; :func:`install` wraps
  ``EngineArgs.create_engine_config``): what depends on the model and the options, i.e.
  the backend's dtypes, head sizes, block sizes and attention kinds against the model's,
  the layout the backend can take in vLLM's memory, NIXL for a P/D ``KvabiConnector``, and
  the KV cache memory vLLM's CPU worker would reserve without ``VLLM_CPU_KVCACHE_SPACE``.

A refusal is a :class:`ConfigError`: one message, raised once, in the main process, seconds
after start.  Nothing here runs when neither a kvabi backend nor ``KvabiConnector`` is
configured (vLLM then runs exactly as without kvabi-vllm).
"""
from __future__ import annotations

import functools
import os

import kvabi
from kvabi import UnsupportedError
from kvabi.util.errors import KVABIError

from .env import (CONNECTOR, ENV_BACKEND, ENV_LAYOUT, ENV_SPACE, ConfigError, backend_from_env,
                  backend_of, say_once)

def _uses_connector(vllm_config) -> bool:
    kv = getattr(vllm_config, "kv_transfer_config", None)
    return kv is not None and kv.kv_connector == CONNECTOR


def _dtype_name(torch_dtype) -> str:
    return str(torch_dtype).replace("torch.", "")


def _specs(vllm_config) -> list[kvabi.KVSpec]:
    """The model's attention specs as vLLM will hand them to kvabi: one per kind (full,
    sliding window), in the model's dtype, head size, KV heads and block size."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    hf = mc.hf_text_config
    common = dict(block_size=int(cc.block_size),
                  num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
                  head_dim=mc.get_head_size(), dtype=_dtype_name(mc.dtype))
    window = getattr(hf, "sliding_window", None)
    types = set(getattr(hf, "layer_types", None) or ())
    specs = []
    if not window or not types or types - {"sliding_attention"}:
        specs.append(kvabi.KVSpec(kind="full", **common))
    if window:
        specs.append(kvabi.KVSpec(kind="sliding_window", window=int(window), **common))
    return specs


def _fix(field: str, caps, spec) -> str:
    """The fix for a refused ``field`` of ``spec`` given the backend's capabilities."""
    if field == "dtype":
        return f"start vLLM with --dtype {caps.dtypes[0]} (or a backend that takes " \
               f"{spec.dtype}: `kvabi backends`)"
    if field == "block_size":
        sizes = caps.block_sizes or tuple(
            b for b in (16, 32, 64, 128) if b % caps.block_size_multiple == 0)
        return f"start vLLM with --block-size (block_size=) one of {', '.join(map(str, sizes))}"
    return "choose a backend that takes it (`kvabi backends`)"


def _check_backend(name: str, vllm_config) -> None:
    from . import layouts as vl

    backend = backend_of(name)
    for spec in _specs(vllm_config):
        caps = backend.capabilities(spec)
        for field, ok, have, want in (
                ("dtype", spec.dtype in caps.dtypes, spec.dtype, caps.dtypes),
                ("head_dim", caps.head_dims is None or spec.head_dim in caps.head_dims,
                 spec.head_dim, caps.head_dims),
                ("block_size", (caps.block_sizes is None or spec.block_size in
                                caps.block_sizes) and
                 spec.block_size % caps.block_size_multiple == 0, spec.block_size,
                 caps.block_sizes or f"multiples of {caps.block_size_multiple}")):
            if not ok:
                raise ConfigError(f"{ENV_BACKEND}={name}: the model's {field} {have} is not "
                                  f"served ({name} takes {want}); {_fix(field, caps, spec)}")
        try:
            backend.check_supported(spec)
        except UnsupportedError as e:
            raise ConfigError(f"{ENV_BACKEND}={name}: {e}; "
                              f"{_fix('', caps, spec)}") from None
    forced = os.environ.get(ENV_LAYOUT)
    try:
        vl.choose(backend, _specs(vllm_config)[0], vllm_name=forced)
    except KVABIError as e:
        where = f" with {ENV_LAYOUT}={forced}" if forced else ""
        raise ConfigError(f"{ENV_BACKEND}={name}{where}: {e}; "
                          f"{'unset ' + ENV_LAYOUT + ' or ' if forced else ''}"
                          f"choose another backend") from None


def _check_memory(vllm_config) -> None:
    """What vLLM's CPU worker refuses later (sized from the node's memory without
    ``VLLM_CPU_KVCACHE_SPACE``), refused now and by the variable's name."""
    from vllm.platforms import current_platform

    cc = vllm_config.cache_config
    if not current_platform.is_cpu() or cc.kv_cache_memory_bytes is not None:
        return
    from vllm.utils.cpu_resource_utils import get_memory_node_info, get_visible_memory_node

    node = (get_visible_memory_node() or [0])[0]
    mem = get_memory_node_info(node)
    want = mem.total_memory * cc.gpu_memory_utilization
    if want > mem.available_memory:
        gib = 1 << 30
        raise ConfigError(
            f"{ENV_SPACE}: not set, so vLLM's CPU worker would reserve "
            f"gpu_memory_utilization {cc.gpu_memory_utilization} x "
            f"{mem.total_memory / gib:.1f} GiB of memory node {node} for the KV cache, "
            f"more than the {mem.available_memory / gib:.1f} GiB available; set "
            f"{ENV_SPACE}=<GiB of KV cache> (e.g. {ENV_SPACE}=1 for a small model)")


def _check_connector(vllm_config) -> None:
    kv = vllm_config.kv_transfer_config
    if kv.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
        return
    from kvabi.transfer import nixl

    ok, why = nixl.available()
    if not ok:
        raise ConfigError(f"kv_transfer_config.kv_role={kv.kv_role}: {CONNECTOR} moves "
                          f"KV over NIXL, which is missing here ({why})")
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if tp == 1:
        return
    # each rank's layouts state its shard of the KV heads (kvabi.Shard.tp): the split must
    # exist for a peer of another TP size to know which heads each rank holds
    from kvabi.model.shard import split_heads

    heads = int(vllm_config.model_config.get_total_num_kv_heads())
    if split_heads(0, tp, heads) is None:
        raise ConfigError(
            f"--tensor-parallel-size {tp} with kv_transfer_config.kv_role={kv.kv_role}: the "
            f"model's {heads} KV heads cannot be split over {tp} ranks (the TP size must "
            f"divide the KV heads, or the KV heads the TP size); {CONNECTOR} moves each "
            f"rank's shard of the heads; choose a --tensor-parallel-size that divides "
            f"{heads} or that {heads} divides")


def check_config(vllm_config) -> None:
    """Refuse what kvabi-vllm cannot serve in ``vllm_config`` (:class:`ConfigError`), and
    log which kvabi backend and layouts the engine will run on."""
    name = backend_from_env()
    connector = _uses_connector(vllm_config)
    if name is None and not connector:
        return
    _check_memory(vllm_config)
    if connector:
        _check_connector(vllm_config)
    if name is not None:
        _check_backend(name, vllm_config)
        from .attention import layout_choice

        choice = layout_choice(vllm_config)
        say_once("kvabi-vllm: attention on kvabi backend %s, kvabi layout %s in vLLM's "
                 "layout %s (vLLM's log names the entry it replaces, CPU_ATTN)", name,
                 choice.preset, choice.vllm_name)


def install() -> None:
    """Run :func:`check_config` after every ``EngineArgs.create_engine_config`` of this
    process (once per class; the general plugin calls this in every vLLM process)."""
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_kvabi_checked", False):
        return

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        check_config(config)
        return config

    create_engine_config._kvabi_checked = True
    EngineArgs.create_engine_config = create_engine_config
