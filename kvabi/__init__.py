"""kvabi: a hardware-agnostic ABI for the KV cache of LLM inference engines."""
from .abi import ABI_VERSION, Backend, Capabilities, UnsupportedError, abi_at_least, hookimpl
from .cache import KVCache, as_cache
from .errors import KVABIError
from .metadata import CommonAttentionMetadata
from .quant import check_scales
from .step_limits import StepLimits
from .spec import KVGroup, KVSpec, LayerKV, ModelKV
from .step_checks import (AttentionOptions, check_kv, check_layer, check_num_q_heads, check_query, check_sinks,
                          check_step, index_dtype)

__version__ = "0.1.0"

_LAZY = {
    "Layout": ("kvabi.layout", "Layout"),
    "Component": ("kvabi.component", "Component"),
    "get_backend": ("kvabi.registry", "get_backend"),
    "backend_names": ("kvabi.registry", "backend_names"),
    "merge_attention": ("kvabi.merge", "merge_attention"),
    "transforms": ("kvabi.transforms", None),
    "tensors": ("kvabi.tensors", None),
}


def __getattr__(name):
    # Lazy so that `import kvabi` stays cheap and modules under construction don't break it.
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        m = importlib.import_module(mod)
        return m if attr is None else getattr(m, attr)
    raise AttributeError(f"module 'kvabi' has no attribute {name!r}")


__all__ = ["ABI_VERSION", "AttentionOptions", "Component", "KVCache", "abi_at_least", "as_cache", "tensors", "Backend", "Capabilities", "CommonAttentionMetadata", "KVABIError",
           "KVGroup", "KVSpec", "LayerKV", "Layout", "ModelKV", "StepLimits", "UnsupportedError",
           "backend_names", "check_kv", "check_scales", "check_layer", "check_num_q_heads", "check_query", "check_sinks", "check_step", "index_dtype", "get_backend", "hookimpl", "merge_attention", "transforms",
           "__version__"]
