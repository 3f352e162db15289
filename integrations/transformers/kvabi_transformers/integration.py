"""``use(model, backend, layout)``: transformers' continuous batching on a kvabi backend."""
from __future__ import annotations

import os
import sys

import kvabi
from kvabi import KVABIError
from kvabi.util.coerce import as_bool, as_int
from kvabi.memory.planning import layout_page_bytes, parse_bytes, plan_memory

from .compat import TransformersMismatch, ensure_transformers, slice_problems
from .connector.settings import pd_options
from .model_kv import model_kv

#: Budget when neither ``memory`` nor the workload of ``generate_batch`` is known.
DEFAULT_MEMORY = "64MiB"
_REGISTERED = False


def _register_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    from .attention import kvabi_attention
    from .manager import ATTENTION_NAME

    AttentionInterface.register(ATTENTION_NAME, kvabi_attention)
    _REGISTERED = True


class Integration:
    """Everything ``use()`` decided about a model: backend, ModelKV, layer slots, layouts,
    block size, sinks, prefill skip.  Checked once; every run builds a Session from it."""

    def __init__(self, model, backend, layout, block_size, kv_dtype, prefill_skip, memory,
                 pd=None):
        _check_model(model)
        #: P/D options (``pd=``), None without P/D
        self.pd = pd_options(pd)
        self.prefill_skip = as_bool(prefill_skip, "prefill_skip")
        self.backend = _backend(backend)
        config = model.config.get_text_config()
        self.model_type = getattr(config, "model_type", type(model).__name__)
        self.block_size = _block_size(block_size, self.backend)
        dtype = kv_dtype if kv_dtype is not None else kvabi.tensors.dtype_name(model.dtype)
        self.model_kv, self.slots, modules = model_kv(model, self.block_size, dtype)
        #: layer index -> the model's attention module (the ones kvabi attention serves)
        self.modules = modules
        self.num_q_heads = int(config.num_attention_heads)
        self.memory_here, self.where = memory_here(model)
        _check_block_bytes(self.model_kv, self.block_size, self.memory_here, self.where)
        self.sinks = {i: m.sinks for i, m in modules.items()
                      if getattr(m, "sinks", None) is not None}
        softcap = getattr(config, "attn_logit_softcapping", None)
        self.layout_names = [
            _layout(layout, self.backend, g, softcap, bool(self.sinks), self.model_type)
            for g in self.model_kv.groups]
        self.all_full = all(l.spec.kind == "full" for l in self.model_kv.layers)
        if self.prefill_skip:
            _check_prefill_skip(model, self.model_kv, self.model_type)
        self.memory = None if memory is None else parse_bytes(memory)
        self.memory_plan = None
        if self.memory is not None:
            self.plan_blocks()  # a budget that holds nothing fails here
        #: the Session of the latest step (its stats and timing), None before any
        self.session = None
        #: weak reference to the latest continuous-batching manager (None before any)
        self.manager = None

    def plan_blocks(self, workload_hints=None) -> int:
        """Blocks per KV group from kvabi's memory plan: of ``memory`` if given, else of
        what the workload of ``generate_batch`` needs (every request at full length)."""
        budget = self.memory
        if budget is None and workload_hints is not None and workload_hints.num_requests:
            bs = self.block_size
            longest = workload_hints.max_prompt_length + workload_hints.max_generated_length
            blocks = workload_hints.num_requests * (-(-longest // bs) + 1)
            budget = blocks * self.bytes_per_block
        if budget is None:
            budget = parse_bytes(DEFAULT_MEMORY)
        if self.memory_here is not None and budget > self.memory_here:
            # refused before anything is allocated or the model's attention is switched
            raise KVABIError(f"memory: the KV cache would take {budget} bytes, more than the "
                             f"{self.memory_here} bytes of {self.where}")
        uniform = self.layout_names[0] if len(set(self.layout_names)) == 1 else None
        self.memory_plan = plan_memory(self.model_kv, budget, layout=uniform)
        blocks = min(g.num_blocks for g in self.memory_plan.groups)
        if workload_hints is not None and workload_hints.num_requests:
            longest = workload_hints.max_prompt_length + workload_hints.max_generated_length
            need = -(-longest // self.block_size)
            if blocks < need:
                raise KVABIError(f"memory: {budget} bytes hold {blocks} blocks of "
                                 f"{self.block_size} tokens per layer, but a request of "
                                 f"{longest} tokens needs {need}")
        return blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one more block costs across all KV groups, in their layouts."""
        return sum(layout_page_bytes(g.spec, name) * len(g.layers)
                   for g, name in zip(self.model_kv.groups, self.layout_names))


def _check_model(model) -> None:
    import torch

    config = getattr(model, "config", None)
    ok = (isinstance(model, torch.nn.Module) and hasattr(config, "get_text_config")
          and callable(getattr(model, "generate_batch", None)))
    if not ok:
        raise KVABIError(f"model: must be a transformers causal LM with continuous batching "
                         f"(generate_batch), got {type(model).__name__}")


#: what a backend must implement to serve a model (the base class raises NotImplementedError)
REQUIRED_METHODS = ("capabilities", "preferred_layouts", "write", "attend")


def _backend(backend):
    b = kvabi.get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(b, kvabi.Backend):
        raise KVABIError(f"backend: must be a kvabi backend or its name, got {backend!r}")
    missing = [m for m in REQUIRED_METHODS
               if getattr(type(b), m, None) is getattr(kvabi.Backend, m)]
    if missing:
        raise KVABIError(f"backend: {b.name or type(b).__name__} does not implement "
                         f"{', '.join(missing)}")
    ok, why = b.available()
    if not ok:
        raise KVABIError(f"backend: {b.name} is not available here: {why}")
    _check_triton_interpreter(b)
    return b


def _check_triton_interpreter(backend) -> None:
    """Triton's interpreter converts triton.language's library functions only when
    TRITON_INTERPRET=1 is set before triton.language is first imported; transformers
    imports it early, and kernels then fail mid-generation."""
    if not backend.name.startswith("cuda.") or os.environ.get("TRITON_INTERPRET") != "1":
        return
    tl = sys.modules.get("triton.language")
    if tl is not None and type(getattr(tl, "zeros", None)).__name__ != "InterpretedFunction":
        raise KVABIError(f"backend: {backend.name} runs in Triton's interpreter, but "
                         "triton.language was imported before TRITON_INTERPRET=1 was set; "
                         "set TRITON_INTERPRET=1 in the environment (or import kvabi_cuda) "
                         "before importing transformers")


def _block_size(block_size, backend) -> int:
    if block_size is None:
        caps = backend.capabilities()
        sizes = caps.block_sizes or (16,)
        size = sizes[0]
        return -(-size // caps.block_size_multiple) * caps.block_size_multiple
    # Python, numpy and torch integers (security.md); transformers' pages hold >= 4 tokens
    return as_int(block_size, "block_size", lo=4)


def memory_here(model) -> tuple[int | None, str]:
    """(bytes, what) of the memory the model's caches go to: the CUDA device's, or this
    machine's RAM for CPU models; (None, ...) where torch cannot tell."""
    import torch

    dev = model.device
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory), f"device {dev}"
    if dev.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
        except (ValueError, OSError, AttributeError):
            pass
    return None, f"device {dev}"


def _check_block_bytes(mkv, block_size: int, here: int | None, where: str) -> None:
    """Refuse, naming ``block_size``, a block size whose one block of every layer does not
    fit in the memory there is (before any layout is sized or any byte allocated)."""
    one = sum(g.spec.page_bytes * len(g.layers) for g in mkv.groups)
    if here is not None and one > here:
        raise KVABIError(f"block_size: {block_size} tokens per block: one block of every "
                         f"layer takes {one} bytes, more than the {here} bytes of {where}")


def _layout(layout, backend, group, softcap, sinks, model_type) -> str:
    spec = group.spec
    where = f"{model_type} layers {', '.join(group.layers)} ({spec.kind}, {spec.dtype})"
    try:
        backend.check_supported(spec, softcap=softcap, sinks=True if sinks else None)
    except kvabi.UnsupportedError as e:
        raise kvabi.UnsupportedError(f"model: {where}: {e}") from e
    supported = tuple(backend.preferred_layouts(spec))
    name = supported[0] if layout is None and supported else layout
    if not isinstance(name, str) or name not in supported:
        raise KVABIError(f"layout: {backend.name} does not support {layout!r} for {where}; "
                         f"it supports {', '.join(supported) or 'none'}")
    kvabi.Layout.preset(name, spec, num_blocks=1, num_layers=len(group.layers))
    return name


def _check_prefill_skip(model, mkv, model_type) -> None:
    base = getattr(model, "model", None)
    if not mkv.prefill_skip_layers:
        raise KVABIError(f"prefill_skip: {model_type} has no KV-shared suffix of layers "
                         "(num_kv_shared_layers is 0); nothing to skip")
    if not hasattr(base, "_maybe_slice_kv_shared_inputs"):
        raise KVABIError(f"prefill_skip: {model_type} has KV-shared layers but its modeling "
                         "code has no hook to run them on fewer tokens")
    problems = slice_problems(base)
    if problems:
        raise TransformersMismatch(f"prefill_skip: {model_type}: {problems[0]}")


def use(model, backend="reference", layout=None, *, block_size=None, kv_dtype=None,
        prefill_skip=False, memory=None, pd=None):
    """Serve ``model``'s continuous batching (``model.generate_batch``,
    ``model.init_continuous_batching``, ``model.generate(..., cache_implementation="paged")``)
    with a kvabi backend; returns ``model``.

    K/V are stored in kvabi caches of ``layout`` (a preset name the backend supports;
    None: the backend's preferred one) with ``block_size`` tokens per block and
    ``kv_dtype`` (default: the model's dtype); kvabi's memory plan of ``memory`` bytes
    (default: what the generate_batch workload needs) decides the number of blocks, and
    transformers' scheduler decides which requests run and which blocks they get.  Layers
    that read another layer's cache never write.  ``prefill_skip`` runs the KV-shared
    suffix of layers only on the tokens whose logits are needed.

    ``pd`` (None: off) makes the continuous-batching manager speak kvabi's P/D protocol
    (``specs/pd.md``) over NIXL: a role name or a dict like vLLM's
    ``--kv-transfer-config`` (``{"kv_role": "kv_producer" | "kv_consumer" | "kv_both",
    "kv_connector_extra_config": {...}}``, :mod:`kvabi_transformers.connector.settings`);
    requests then take ``kv_transfer_params`` at ``add_request`` and finished producer
    requests carry their answer as ``output.kv_transfer_params``.

    Raises :class:`kvabi.KVABIError` (UnsupportedError for what the backend refuses) here,
    not mid-generation, for any model, layout or option that cannot be served, and then
    leaves ``model`` as it was; :class:`~kvabi_transformers.compat.TransformersMismatch`
    for a transformers release outside the tested range or whose continuous-batching
    internals differ (checked once per process).  A run that fails gives the model its own
    attention back.
    """
    from .hooks import install

    ensure_transformers()
    integration = Integration(model, backend, layout, block_size, kv_dtype, prefill_skip,
                              memory, pd)
    _register_attention()
    install(model, integration)
    return model
