"""kvabi: a hardware-agnostic ABI for the KV cache of LLM inference engines."""
from . import tensors
from .backend import Backend
from .cache import KVCache
from .capabilities import Capabilities
from .component import Component
from .errors import KVABIError, UnsupportedError
from .hookspecs import hookimpl
from .layout import Layout
from .metadata import CommonAttentionMetadata
from .quant import check_scales
from .shard import Shard
from .spec import KVGroup, KVSpec, LayerKV, ModelKV
from .step_checks import (AttentionOptions, check_layer, check_num_q_heads, check_step,
                          index_dtype)
from .step_limits import StepLimits
from .step_plan import StepPlan
from .tp_view import TPView
from .version import ABI_VERSION, WIRE_VERSION

__version__ = "0.1.0"

# Modules `import kvabi` does not load (the registry scans entry points on first use).
_LAZY = {
    "get_backend": ("kvabi.registry", "get_backend"),
    "backend_names": ("kvabi.registry", "backend_names"),
    "merge_attention": ("kvabi.merge", "merge_attention"),
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
