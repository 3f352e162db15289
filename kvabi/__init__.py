"""kvabi: a hardware-agnostic ABI for the KV cache of LLM inference engines."""
from .backend.base import Backend
from .backend.capabilities import Capabilities
from .backend.hookspecs import hookimpl
from .layout.check import check_layer
from .layout.component import Component
from .layout.descriptor import Layout
from .layout.tp_view import TPView
from .memory.cache import KVCache
from .model.model_kv import KVGroup, ModelKV
from .model.quant import check_scales
from .model.shard import Shard
from .model.spec import KVSpec, LayerKV
from .step.checks import AttentionOptions, check_num_q_heads, check_step, index_dtype
from .step.limits import StepLimits
from .step.metadata import CommonAttentionMetadata
from .step.plan import StepPlan
from .util import tensors
from .util.errors import KVABIError, UnsupportedError
from .util.version import ABI_VERSION, WIRE_VERSION, __version__

# Modules `import kvabi` does not load (the registry scans entry points on first use).
_LAZY = {
    "get_backend": ("kvabi.backend.registry", "get_backend"),
    "backend_names": ("kvabi.backend.registry", "backend_names"),
    "merge_attention": ("kvabi.step.merge", "merge_attention"),
    "transforms": ("kvabi.transforms", None),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'kvabi' has no attribute {name!r}")


__all__ = ["ABI_VERSION", "AttentionOptions", "Backend", "Capabilities",
           "CommonAttentionMetadata", "Component", "KVABIError", "KVCache", "KVGroup",
           "KVSpec", "LayerKV", "Layout", "ModelKV", "Shard", "StepLimits", "StepPlan",
           "TPView", "UnsupportedError", "WIRE_VERSION", "backend_names", "check_layer",
           "check_num_q_heads", "check_scales", "check_step", "get_backend", "hookimpl",
           "index_dtype", "merge_attention", "tensors", "transforms", "__version__"]
