"""The transformers releases kvabi-transformers is tested with, and the internals of
continuous batching it reaches into, checked once per process at ``use()``.

kvabi-transformers subclasses transformers' paged cache and continuous-batching manager,
calls their constructors and reads their attributes, and reads the step's packed inputs.
A release that changes any of it (5.24 made every model call the paged cache's ``update``
itself) must be reported at ``use()``, naming what changed, and not fail mid-generation.

Outside the tested range ``use()`` refuses: an internal that changed its meaning but not its
name gives wrong tokens without any error, which no check here can see.  Setting
``KVABI_TRANSFORMERS_UNTESTED=1`` turns that refusal into a warning (to try a new release);
the internals are checked either way.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
import warnings

from kvabi import KVABIError

#: the transformers releases the tests pass with (also the package's dependency range)
TESTED = ">=5.23,<5.25"
#: environment variable that turns the refusal of an untested release into a warning
UNTESTED_ENV = "KVABI_TRANSFORMERS_UNTESTED"

CB = "transformers.generation.continuous_batching"

#: callables kvabi-transformers calls with keywords: their parameters must include these
CALLED = {
    f"{CB}.cache.PagedAttentionCache.__init__": (
        "config", "continuous_batching_config", "device", "distributed_helper", "dtype",
        "model_supports_logits_to_keep"),
    f"{CB}.continuous_api.ContinuousBatchingManager.__init__": (
        "model", "generation_config", "continuous_batching_config", "workload_hints"),
    f"{CB}.continuous_api.ContinuousBatchProcessor.__init__": (
        "cache", "config", "generation_config", "continuous_batching_config",
        "logit_processor", "input_queue", "cancel_queue", "output_router",
        "background_thread_status", "model_device", "model_dtype", "scheduler",
        "distributed_helper"),
    f"{CB}.continuous_api.ContinuousBatchProcessor.reset": (),
    f"{CB}.initialization.update_cb_config_after_cache_creation": (
        "cb_config", "num_blocks", "max_batch_tokens"),
    f"{CB}.scheduler.FIFOScheduler.__init__": (
        "cache", "safety_margin", "max_requests_per_batch"),
    "transformers.AttentionInterface.register": (),
    # P/D (kvabi_transformers.connector)
    f"{CB}.cache.PagedAttentionCache.can_store_request_tokens": ("state", "request_len"),
    f"{CB}.cache.PagedAttentionCache.free_blocks": ("request_id",),
    f"{CB}.continuous_api.OutputRouter.fail_and_deliver": ("state", "error"),
}

#: methods kvabi-transformers overrides (or replaces on the model): transformers calls them
#: with exactly these parameters
OVERRIDDEN = {
    f"{CB}.cache.PagedAttentionCache.update": (
        "key_states", "value_states", "layer_idx", "kwargs"),
    f"{CB}.cache.PagedAttentionCache.perform_cache_copy": ("copy_src_and_dst",),
    f"{CB}.continuous_api.ContinuousBatchingManager.warmup": (),
    f"{CB}.continuous_api.ContinuousBatchingManager.switch_to_cb_friendly_attn": (
        "model", "auto_switch_to_flash"),
    f"{CB}.continuous_api.ContinuousBatchingManager._create_batch_processor": (),
    f"{CB}.continuous_api.ContinuousMixin.init_continuous_batching": (
        "generation_config", "continuous_batching_config", "workload_hints"),
    f"{CB}.continuous_api.ContinuousBatchingManager.add_request": (
        "input_ids", "request_id", "max_new_tokens", "streaming", "record_timestamps",
        "eos_token_id", "**"),
    f"{CB}.continuous_api.ContinuousBatchingManager.stop": (
        "block", "timeout", "keep_for_next_session", "hard_stop"),
    # P/D (kvabi_transformers.connector.hooks)
    f"{CB}.cache.PagedAttentionCache.mark_complete_blocks": ("state", "complete_blocks"),
    f"{CB}.scheduler.Scheduler.add_waiting_request": ("state",),
    f"{CB}.scheduler.Scheduler.finish_request": ("request_id",),
    f"{CB}.scheduler.Scheduler.set_request_cancellation": ("request_id",),
    f"{CB}.scheduler.Scheduler.has_pending_requests": (),
    f"{CB}.continuous_api.ContinuousBatchProcessor.prepare_next_batch": (),
    f"{CB}.continuous_api.ContinuousBatchProcessor.fail_all_requests": ("error",),
    f"{CB}.continuous_api.OutputRouter.deliver": ("output",),
    f"{CB}.continuous_api.OutputRouter.deliver_batch": ("outputs",),
}

#: fields of a request's state the P/D connector reads or sets (resuming a request whose
#: prompt KV was pulled, as transformers' prefix sharing resumes one)
REQUEST_FIELDS = ("request_id", "initial_tokens", "generated_tokens", "position_offset",
                  "remaining_prefill_tokens")
#: request statuses the connector reads or sets
REQUEST_STATUSES = ("PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED")

#: attributes of the manager that kvabi-transformers reads, set by its ``__init__``
MANAGER_ATTRIBUTES = (
    "model", "generation_config", "continuous_batching_config", "distributed_helper",
    "logit_processor", "input_queue", "cancel_queue", "output_router",
    "background_thread_status", "is_tp_driver", "batch_processor", "_original_attn_impl",
    "_use_prefix_sharing", "output_router")

#: fields of ContinuousBatchingConfig kvabi-transformers sets or reads
CONFIG_FIELDS = (
    "page_size", "num_blocks", "max_blocks_per_request", "cpu_offload_space",
    "allow_block_sharing", "scheduler_type", "safety_margin", "max_requests_per_batch")

#: the step's forward keywords the forward pre-hook reads (transformers' PagedAttentionArgs)
STEP_INPUTS = ("cache", "cu_seq_lens_q", "position_ids", "write_index", "read_index",
               "logits_indices")

#: the parameters of Gemma-style ``_maybe_slice_kv_shared_inputs`` that prefill skip wraps
#: (passed positionally; what follows goes through untouched)
SLICE_PARAMETERS = ("hidden_states", "per_layer_inputs", "position_embeddings",
                    "causal_mask_mapping", "logits_to_keep")


class TransformersMismatch(KVABIError):
    """The installed transformers is outside the tested range, or continuous batching's
    internals differ from what kvabi-transformers reaches into."""


_CHECKED: str | None = None  # the transformers version whose internals passed


def ensure_transformers() -> None:
    """Check the installed transformers (version and internals) once per process; raise
    :class:`TransformersMismatch` naming the version, the tested range and what differs."""
    global _CHECKED
    version = installed_version()
    if _CHECKED == version:
        return
    check_version(version)
    problems = internals_problems()
    if problems:
        raise TransformersMismatch(
            f"transformers: {version} is installed, and continuous batching's internals "
            f"differ from what kvabi-transformers reaches into (tested: {TESTED}): "
            + "; ".join(problems))
    _CHECKED = version


def installed_version() -> str:
    """The version of the transformers that is imported."""
    import transformers

    return transformers.__version__


def check_version(version: str) -> None:
    """Refuse (warn, with ``KVABI_TRANSFORMERS_UNTESTED=1``) a version outside TESTED."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        inside = Version(version) in SpecifierSet(TESTED)
    except InvalidVersion:
        inside = False
    if inside:
        return
    msg = (f"transformers: {version} is installed; kvabi-transformers is tested with "
           f"transformers {TESTED} (it reaches into continuous batching's internals, which "
           "change between releases)")
    if os.environ.get(UNTESTED_ENV) == "1":
        warnings.warn(f"{msg}; {UNTESTED_ENV}=1: going on untested", stacklevel=4)
        return
    raise TransformersMismatch(f"{msg}; install a tested release, or set {UNTESTED_ENV}=1 "
                               "to try this one")


def internals_problems() -> list[str]:
    """What differs, one line each, from what kvabi-transformers reaches into (empty: all
    is as tested)."""
    problems = []
    for path, names in CALLED.items():
        params, err = _parameters(path)
        if err:
            problems.append(err)
            continue
        missing = [n for n in names if n not in params and "**" not in params]
        if missing:
            problems.append(f"{_short(path)} takes no {', '.join(missing)} "
                            f"(it takes {_signature(params)})")
    for path, names in OVERRIDDEN.items():
        params, err = _parameters(path)
        if err:
            problems.append(err)
        elif tuple(params) != names:
            problems.append(f"{_short(path)} takes {_signature(params)}; kvabi-transformers "
                            f"overrides it as {_signature(names)}")
    problems += _manager_attributes()
    problems += _config_fields()
    problems += _step_inputs()
    problems += _request_state()
    if not problems:
        problems += bookkeeping_problems()
    return problems


def slice_problems(base) -> list[str]:
    """What differs in ``base._maybe_slice_kv_shared_inputs`` from what prefill skip wraps."""
    params = list(inspect.signature(type(base)._maybe_slice_kv_shared_inputs).parameters)[1:]
    if tuple(params[:len(SLICE_PARAMETERS)]) != SLICE_PARAMETERS:
        return [f"{type(base).__name__}._maybe_slice_kv_shared_inputs takes "
                f"{_signature(params)}; prefill skip wraps it as "
                f"{_signature(SLICE_PARAMETERS + ('...',))}"]
    return []


def bookkeeping_problems(block_size: int = 16, num_blocks: int = 4) -> list[str]:
    """Build transformers' paged cache on the bookkeeping config, as kvabi-transformers does,
    and check what it reads of it: one allocator, at least ``num_blocks`` blocks after the
    reserved ones, and write rows ``block * block_physical_stride + position % block_size``
    (what :func:`~kvabi_transformers.step.step_metadata` reads back as slots)."""
    import torch
    from transformers import ContinuousBatchingConfig, PretrainedConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    from .manager import bookkeeping_config

    config = bookkeeping_config(PretrainedConfig(hidden_size=64, vocab_size=128), torch.float32)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                  max_batch_tokens=64, max_blocks_per_request=0,
                                  allow_block_sharing=False, cpu_offload_space=0.0,
                                  max_memory_percent=0.5)
    where = "PagedAttentionCache of one bookkeeping layer"
    quiet = logging.getLogger("ContinuousBatchingLogger")  # its memory report is not ours
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        cache = PagedAttentionCache(
            config=config, continuous_batching_config=cb, device=torch.device("cpu"),
            distributed_helper=DistributedHelper(device_mesh=None, cpu_group_timeout=None),
            dtype=torch.float32)
        allocators = list(cache.cache_allocators.values())
        if len(allocators) != 1:
            return [f"{where}: {len(allocators)} allocators, expected 1"]
        (alloc,) = allocators
        # read as the manager and the session read them
        _ = (cache.use_prefix_sharing, cache.num_blocks, cache.max_batch_tokens)
        first = cache.pool.num_reserved_sectors * alloc.blocks_per_sector
        stride = alloc.block_physical_stride
        if alloc.num_blocks < num_blocks:
            return [f"{where}: {num_blocks} blocks asked, the allocator has {alloc.num_blocks}"]
        table = list(range(first, first + num_blocks))
        alloc.block_table["kvabi-check"] = table
        length = block_size * (num_blocks - 1) + 1
        rows = [int(r) for r in alloc.get_write_indices("kvabi-check", 0, length)]
    except Exception as e:  # whatever a changed release raises here, named as such
        return [f"{where}: {type(e).__name__}: {e}"]
    finally:
        quiet.setLevel(level)
    want = [table[p // block_size] * stride + p % block_size for p in range(length)]
    if len(rows) != length:
        return [f"{where}: {len(rows)} write rows for a request of {length} tokens"]
    bad = [p for p in range(length) if rows[p] != want[p]]
    if bad:
        p = bad[0]
        return [f"{where}: position {p} of a request is written to row {rows[p]}; "
                f"kvabi-transformers reads row {want[p]} as its slot (block "
                f"{table[p // block_size]}, token {p % block_size}, block stride {stride})"]
    return []


def _resolve(path: str):
    """The object a dotted path names (module, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def _parameters(path: str) -> tuple[list[str], str | None]:
    """(parameter names, without self; '**' for a **kwargs), or an error line."""
    try:
        fn = _resolve(path)
        params = inspect.signature(fn).parameters.values()
    except (ImportError, AttributeError):
        return [], f"{_short(path)} is gone"
    except (TypeError, ValueError):
        return [], f"{_short(path)} has no signature"
    names = ["**" if p.kind is p.VAR_KEYWORD else "*" if p.kind is p.VAR_POSITIONAL
             else p.name for p in params]
    return (names[1:] if names[:1] == ["self"] else names), None


def _manager_attributes() -> list[str]:
    """Attributes the manager's ``__init__`` no longer names (co_names holds every
    attribute name its code sets or reads)."""
    try:
        init = _resolve(f"{CB}.continuous_api.ContinuousBatchingManager.__init__")
        names = set(init.__code__.co_names)
    except (ImportError, AttributeError):
        return []  # reported by CALLED
    missing = [a for a in MANAGER_ATTRIBUTES if a not in names]
    return [f"ContinuousBatchingManager.__init__ no longer sets {', '.join(missing)}"] \
        if missing else []


def _config_fields() -> list[str]:
    try:
        cls = _resolve("transformers.ContinuousBatchingConfig")
    except (ImportError, AttributeError):
        return ["transformers.ContinuousBatchingConfig is gone"]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
        else set(vars(cls()))
    missing = [f for f in CONFIG_FIELDS if f not in fields]
    return [f"ContinuousBatchingConfig has no {', '.join(missing)}"] if missing else []


def _step_inputs() -> list[str]:
    try:
        args = _resolve(f"{CB}.input_outputs.PagedAttentionArgs")
    except (ImportError, AttributeError):
        return ["input_outputs.PagedAttentionArgs (the step's forward keywords) is gone"]
    keys = set(getattr(args, "__annotations__", {}))
    missing = [k for k in STEP_INPUTS if k not in keys]
    return [f"the step's forward keywords (PagedAttentionArgs) have no {', '.join(missing)}"] \
        if missing else []


def _request_state() -> list[str]:
    try:
        state = _resolve(f"{CB}.requests.RequestState")
        status = _resolve(f"{CB}.requests.RequestStatus")
    except (ImportError, AttributeError):
        return ["requests.RequestState or RequestStatus is gone"]
    fields = {f.name for f in dataclasses.fields(state)} if dataclasses.is_dataclass(state) \
        else set()
    out = [f"RequestState has no {f}" for f in REQUEST_FIELDS if f not in fields]
    out += [f"RequestStatus has no {s}" for s in REQUEST_STATUSES if not hasattr(status, s)]
    return out


#: what ``kvabi-transformers serve`` reaches into in transformers' server: callables and
#: the parameters it passes or reads by name
SERVING = {
    "transformers.cli.serving.model_manager.ModelManager._load_model": ("model_id_and_revision",),
    "transformers.cli.serving.server.build_server": (
        "model_manager", "chat_handler", "completion_handler"),
    "transformers.cli.serving.completion.CompletionHandler.handle_request": (
        "body", "request_id"),
    "transformers.cli.serving.chat_completion.ChatCompletionHandler.handle_request": (
        "body", "request_id"),
    "transformers.cli.serving.utils.CBWorkerDeadError": (),
}


def serving_problems() -> list[str]:
    """What differs in transformers' server from what ``kvabi-transformers serve`` reaches
    into (empty: all is as tested); its extras missing is one problem."""
    try:
        importlib.import_module("fastapi")
        importlib.import_module("uvicorn")
    except ImportError as e:
        return [f"transformers serve needs its serving extras ({e.name} is missing: "
                "pip install 'transformers[serving]')"]
    problems = []
    for path, names in SERVING.items():
        params, err = _parameters(path)
        if err and not path.endswith("Error"):
            problems.append(err)
            continue
        missing = [n for n in names if n not in params and "**" not in params]
        if missing:
            problems.append(f"{_short(path)} takes no {', '.join(missing)}")
    return problems


def _short(path: str) -> str:
    return path.removeprefix(f"{CB}.").removeprefix("transformers.")


def _signature(names) -> str:
    return "(" + ", ".join(names) + ")"
