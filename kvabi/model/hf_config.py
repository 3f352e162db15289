"""The layers of a Hugging Face ``config.json``, as :class:`~kvabi.model.spec.LayerKV` values
(``ModelKV.from_hf_config`` builds the model from them).

Which layer gets which kind of KV cache, following the conventions of the Hugging Face
configuration classes (the semantics, not their code):

- ``layer_types`` (newer configs: Gemma 3/3n, GPT-OSS, Llama 4, ...) wins when present:
  ``full_attention``, ``sliding_attention`` (window ``sliding_window``) and
  ``chunked_attention`` (chunk ``attention_chunk_size``).
- Gemma 2 (``model_type`` ``gemma2``): sliding on even-indexed layers (i % 2 == 0).
- Gemma 3 (``sliding_window_pattern`` P, default 6 for ``gemma3_text``): layer i is full
  when (i + 1) % P == 0, sliding otherwise (five sliding, then one full).
- Llama 4 (``attention_chunk_size``): ``no_rope_layers[i]`` is 1 where layer i uses RoPE
  and 0 where it is a NoPE layer; RoPE layers attend within their chunk
  (``chunked_local``), NoPE layers attend to everything (``full``). An empty or absent
  list means every ``no_rope_layer_interval``-th layer (default 4) is NoPE.
- Otherwise a non-null ``sliding_window`` makes every layer sliding (Mistral), unless
  ``use_sliding_window`` is false (Qwen 2).
- MLA (``kv_lora_rank``, DeepSeek V2/V3): one latent plane per token of width
  kv_lora_rank + qk_rope_head_dim, of which attention returns the first kv_lora_rank.
- KV sharing (``num_kv_shared_layers`` N, Gemma 3n): the last N layers own no cache; each
  reads the cache of the last earlier non-shared layer of its own type.

A quantized KV cache (``specs/semantics.md`` section 11) is read from
``quantization_config``: compressed-tensors' ``kv_cache_scheme`` (``type`` float,
``num_bits`` 8, ``strategy`` tensor, symmetric) and ModelOpt's ``kv_cache_quant_algo``
``FP8`` both state an ``float8_e4m3fn`` cache with one static scale per layer for keys and
one for values (``quant`` ``per_tensor``; the scale values are checkpoint weights, passed
per call).  Per-head static scales (``strategy`` ``attn_head``) are refused by field.

The window W of ``sliding_window`` is used as is: Hugging Face masks keys j <= p - W, so a
query sees W keys including itself, which is kvabi's convention too.

Configs are untrusted (``specs/security.md``): a file is read as bytes through the strict
JSON reader, every field read is type-checked (an integer is not a boolean or a float, a
boolean is not the string ``"false"``) and every error names the field; at most
:data:`MAX_LAYERS` (65,536) layers, and the work is linear in the layers.

Layers are named ``layers.<i>``.  Multimodal wrappers keep the decoder under
``text_config``; it is read from there, and the outer ``torch_dtype`` applies when the
inner config has none.  Draft (MTP) layers such as DeepSeek's ``num_nextn_predict_layers``
are not part of the decoder and are not counted.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from ..util.coerce import as_bool, as_int
from ..util.dtypes import DTYPES
from ..util.errors import KVABIError, require
from ..util.safe_json import MAX_BYTES, loads
from .quant import check_quant
from .spec import KVSpec, LayerKV

#: The most decoder layers a config may declare (the largest public models have ~200):
#: bounds the time and memory a hostile config can cost (``specs/security.md``).
MAX_LAYERS = 65536
#: Size limit of a config.json (public ones are at most a few hundred KiB).
MAX_CONFIG_BYTES = MAX_BYTES

#: Defaults the Hugging Face config classes fill in for KV-relevant fields that public
#: config.json files leave out (e.g. gemma-3-27b omits ``sliding_window_pattern``).
MODEL_TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 256, "sliding_window": 4096},
    "gemma3_text": {"head_dim": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "max_position_embeddings": 131072},
    "llama4_text": {"head_dim": 128, "attention_chunk_size": 8192,
                    "no_rope_layer_interval": 4},
}

#: torch dtype names (as configs write them, and common aliases) -> kvabi dtype.
_TORCH_DTYPES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "float32": "float32", "float": "float32", "fp32": "float32",
}

#: KV dtype aliases engines accept on their command lines.
KV_DTYPE_ALIASES = {
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
}

_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding_window",
                "chunked_attention": "chunked_local"}


def load_hf_config(config: Mapping | str | os.PathLike) -> dict:
    """The config as a dict: a mapping as is, or a ``config.json`` path (or its folder),
    read as bytes through the strict JSON reader (:mod:`kvabi.util.safe_json`): at most
    :data:`MAX_CONFIG_BYTES`, UTF-8, no duplicate keys, bounded nesting."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise KVABIError(f"config: expected a mapping or a path, got {type(config).__name__}")
    path = os.fspath(config)
    if not isinstance(path, str):
        raise KVABIError(f"config: path must be text, got {path!r:.80}")
    try:
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)  # never more: /dev/zero is a "file" too
    except OSError as e:
        raise KVABIError(f"config: cannot read {path!r}: {e.strerror or e}") from None
    except ValueError as e:  # e.g. an embedded NUL in the path
        raise KVABIError(f"config: cannot read {path!r}: {e}") from None
    data = loads(raw, what=f"config {path!r}", max_bytes=MAX_CONFIG_BYTES)
    require(isinstance(data, dict), "config", f"{path!r} must hold a JSON object",
            type(data).__name__)
    return data


def text_config(config: Mapping) -> dict:
    """The decoder's config: ``text_config`` when nested, with the model-type defaults
    filled in and the outer dtype inherited."""
    inner = config.get("text_config")
    if inner is None:
        cfg = dict(config)
    else:
        require(isinstance(inner, Mapping), "text_config", "must be an object",
                type(inner).__name__)
        cfg = dict(inner)
        for key in ("torch_dtype", "dtype"):
            if cfg.get(key) is None and config.get(key) is not None:
                cfg[key] = config[key]
    model_type = cfg.get("model_type")
    require(model_type is None or isinstance(model_type, str), "model_type",
            "must be a string", model_type)
    for key, value in MODEL_TYPE_DEFAULTS.get(model_type, {}).items():
        cfg.setdefault(key, value)
    return cfg


def hf_max_model_len(config: Mapping | str | os.PathLike) -> int | None:
    """The context length the config declares (``max_position_embeddings``), if any."""
    value = text_config(load_hf_config(config)).get("max_position_embeddings")
    return _int_or_none(value, "max_position_embeddings", minimum=1)


def resolve_kv_dtype(name: str) -> str:
    """A kvabi dtype from a name or an engine alias (``fp8`` -> ``float8_e4m3fn``)."""
    require(isinstance(name, str), "kv_dtype", "must be a dtype name", name)
    name = KV_DTYPE_ALIASES.get(name, name)
    require(name in DTYPES, "kv_dtype", f"must be one of {', '.join(DTYPES)} or an alias "
            f"({', '.join(KV_DTYPE_ALIASES)})", name)
    return name


def config_kv_dtype(cfg: Mapping) -> str:
    """The KV dtype a config implies: its ``torch_dtype``/``dtype``, else bfloat16."""
    for key in ("torch_dtype", "dtype"):
        value = cfg.get(key)
        if value is None:
            continue
        require(isinstance(value, str), key, "must be a dtype name", value)
        # "auto" or a dtype kvabi has no cache for (float64, ...) falls back to bfloat16.
        return _TORCH_DTYPES.get(value.replace("torch.", ""), "bfloat16")
    return "bfloat16"


def config_kv_quant(config: Mapping) -> tuple[str, str] | None:
    """``(kvabi dtype, quant)`` of the KV cache a config's ``quantization_config`` states,
    or None when it states none; KVABIError naming the field for a scheme kvabi has no
    granularity for."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    require(isinstance(qc, Mapping), "quantization_config", "must be an object",
            type(qc).__name__)
    scheme = qc.get("kv_cache_scheme")
    if scheme is not None:
        f = "quantization_config.kv_cache_scheme"
        require(isinstance(scheme, Mapping), f, "must be an object", type(scheme).__name__)
        kind, bits = scheme.get("type"), scheme.get("num_bits")
        require(kind == "float" and type(bits) is int and bits == 8, f,
                "kvabi reads float 8-bit KV cache schemes (type float, num_bits 8)",
                {"type": kind, "num_bits": bits})
        strategy = scheme.get("strategy", "tensor")
        require(strategy == "tensor", f + ".strategy", "must be tensor (one static scale "
                "per layer; per-head static scales are not a kvabi granularity)", strategy)
        require(scheme.get("symmetric", True) is True, f + ".symmetric",
                "must be true (kvabi's scales have no zero point)", scheme.get("symmetric"))
        return "float8_e4m3fn", "per_tensor"
    algo = qc.get("kv_cache_quant_algo")
    if algo is None:
        return None
    require(isinstance(algo, str) and algo.upper() == "FP8",
            "quantization_config.kv_cache_quant_algo", "kvabi reads FP8 (per-tensor)", algo)
    return "float8_e4m3fn", "per_tensor"


def _int_or_none(value, field: str, minimum: int = 1) -> int | None:
    """None, or an int >= ``minimum`` (no bool, no float, no string; int64 at most)."""
    if value is None:
        return None
    return as_int(value, field, lo=minimum)


def _need_int(cfg: Mapping, field: str, minimum: int = 1) -> int:
    require(field in cfg and cfg[field] is not None, field, "is required")
    return _int_or_none(cfg[field], field, minimum)


def _bool(cfg: Mapping, field: str, default: bool) -> bool:
    """A JSON boolean field; absent or null gives ``default`` (the string "false" is not
    a boolean: it is refused, never read as true)."""
    value = cfg.get(field)
    return default if value is None else as_bool(value, field)


def _layer_kinds(cfg: Mapping, n: int) -> list[str]:
    """The HF layer type of every layer: full_attention, sliding_attention or
    chunked_attention."""
    model_type = cfg.get("model_type")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        require(isinstance(layer_types, list) and len(layer_types) == n, "layer_types",
                f"must be a list of num_hidden_layers={n} entries",
                layer_types if not isinstance(layer_types, list) else
                f"a list of {len(layer_types)}")
        for i, t in enumerate(layer_types):
            require(isinstance(t, str) and t in _LAYER_KINDS, f"layer_types[{i}]",
                    f"unsupported layer type (kvabi knows {', '.join(_LAYER_KINDS)})", t)
        return list(layer_types)
    if model_type == "gemma2":
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    pattern_key = next((k for k in ("sliding_window_pattern", "_sliding_window_pattern")
                        if cfg.get(k) is not None), None)
    if pattern_key is not None:
        p = _int_or_none(cfg[pattern_key], pattern_key, minimum=1)
        return ["full_attention" if (i + 1) % p == 0 else "sliding_attention"
                for i in range(n)]
    if cfg.get("attention_chunk_size") is not None:
        rope = cfg.get("no_rope_layers")
        if rope is None or rope == []:  # absent or empty: HF derives it from the interval
            interval = _int_or_none(cfg.get("no_rope_layer_interval", 4),
                                    "no_rope_layer_interval", minimum=1)
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        require(isinstance(rope, list) and len(rope) >= n, "no_rope_layers",
                f"must list at least num_hidden_layers={n} entries",
                rope if not isinstance(rope, list) else f"a list of {len(rope)}")
        for i in range(n):
            r = rope[i]
            require(isinstance(r, int) and not isinstance(r, bool) and r in (0, 1),
                    f"no_rope_layers[{i}]", "must be 1 (RoPE, chunked) or 0 (NoPE, full)", r)
        return ["chunked_attention" if rope[i] else "full_attention" for i in range(n)]
    if cfg.get("sliding_window") is not None and _bool(cfg, "use_sliding_window", True):
        # Qwen 2 style: with use_sliding_window, only layers from max_window_layers slide.
        first = cfg.get("max_window_layers") if "use_sliding_window" in cfg else None
        first = _int_or_none(first, "max_window_layers", minimum=0) or 0
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _shared_targets(kinds: list[str], num_shared: int) -> list[int | None]:
    """For each layer, the index of the layer whose cache it reads (None: its own).

    One pass: the last non-shared layer of each type is all a shared layer needs."""
    n = len(kinds)
    first = n - num_shared
    out: list[int | None] = [None] * n
    last: dict[str, int] = {}
    for j in range(first):
        last[kinds[j]] = j
    for i in range(first, n):
        # No earlier layer of that type: the layer keeps its own cache (as HF does).
        out[i] = last.get(kinds[i])
    return out


def _divides(heads: int, kv_heads: int, field: str) -> int:
    require(heads % kv_heads == 0, field,
            f"must divide num_attention_heads={heads} (each KV head serves a whole group of "
            f"query heads)", kv_heads)
    return kv_heads


def layers_from_hf_config(config: Mapping | str | os.PathLike, block_size: int = 16,
                         kv_dtype: str | None = None, kv_quant: str | None = None,
                         rounding: str = "nearest_even") -> list[LayerKV]:
    """The layers (:class:`LayerKV`, in order) of a Hugging Face config (a dict, a config.json path, or the
    folder holding it).  ``kv_dtype`` defaults to the config's KV quantization
    (:func:`config_kv_quant`), else its dtype (bfloat16 if none); ``kv_quant`` (``none``,
    ``per_tensor``, ``per_token_head``) to what the config states when ``kv_dtype`` is not
    given, else ``none``; ``rounding`` is the quantized cache's (``KVSpec.rounding``).

    Every field is type-checked (ints are ints, booleans are booleans) and every error
    names the config field.  Linear in the number of layers, which is at most
    :data:`MAX_LAYERS`.
    """
    block_size = as_int(block_size, "block_size", lo=1)
    raw = load_hf_config(config)
    cfg = text_config(raw)
    stated = config_kv_quant(raw) or config_kv_quant(cfg)
    if kv_dtype is None and stated is not None:
        dtype, quant = stated
    else:
        dtype = config_kv_dtype(cfg) if kv_dtype is None else resolve_kv_dtype(kv_dtype)
        quant = "none"
    if kv_quant is not None:
        quant = kv_quant
    check_quant(quant, rounding, dtype)  # refused by field before any spec is built
    q = {} if quant == "none" else {"quant": quant, "rounding": rounding}
    n = _need_int(cfg, "num_hidden_layers")
    require(n <= MAX_LAYERS, "num_hidden_layers", f"must be <= {MAX_LAYERS} (kvabi's "
            f"limit on decoder layers)", n)
    # Checked even where another rule decides the layer types: a string "false" here is a
    # config that means something else than it says, whichever rule applies.
    _bool(cfg, "use_sliding_window", True)

    if cfg.get("kv_lora_rank") is not None:
        rank = _need_int(cfg, "kv_lora_rank")
        rope_dim = _need_int(cfg, "qk_rope_head_dim", minimum=0)
        spec = KVSpec("mla", block_size, 1, rank + rope_dim, dtype=dtype, head_dim_v=rank,
                      **q)
        return [LayerKV(f"layers.{i}", spec) for i in range(n)]

    heads = _need_int(cfg, "num_attention_heads")
    kv_heads = _int_or_none(cfg.get("num_key_value_heads"), "num_key_value_heads") or heads
    _divides(heads, kv_heads, "num_key_value_heads")
    head_dim = _int_or_none(cfg.get("head_dim"), "head_dim")
    if head_dim is None:
        hidden = _need_int(cfg, "hidden_size")
        require(hidden % heads == 0, "hidden_size",
                f"must be divisible by num_attention_heads={heads} when head_dim is absent",
                hidden)
        head_dim = hidden // heads
    # Gemma 4 style: full-attention layers may have their own head size and KV heads.
    full_head_dim = _int_or_none(cfg.get("global_head_dim"), "global_head_dim") or head_dim
    full_kv_heads = (_int_or_none(cfg.get("num_global_key_value_heads"),
                                  "num_global_key_value_heads") or kv_heads)
    _divides(heads, full_kv_heads, "num_global_key_value_heads")
    require(not _bool(cfg, "attention_k_eq_v", False), "attention_k_eq_v",
            "layers whose keys are their values are not supported", True)

    kinds = _layer_kinds(cfg, n)
    specs: dict[str, KVSpec] = {}
    for t in set(kinds):
        kind = _LAYER_KINDS[t]
        extra: dict[str, int] = {}
        if kind == "sliding_window":
            extra["window"] = _need_int(cfg, "sliding_window")
        elif kind == "chunked_local":
            extra["chunk"] = _need_int(cfg, "attention_chunk_size")
        if kind == "full":
            specs[t] = KVSpec(kind, block_size, full_kv_heads, full_head_dim, dtype=dtype,
                              **q)
        else:
            specs[t] = KVSpec(kind, block_size, kv_heads, head_dim, dtype=dtype, **extra,
                              **q)

    num_shared = _int_or_none(cfg.get("num_kv_shared_layers"), "num_kv_shared_layers",
                              minimum=0) or 0
    require(num_shared < n, "num_kv_shared_layers",
            f"must be < num_hidden_layers={n} (some layer must own a cache)", num_shared)
    targets = _shared_targets(kinds, num_shared)
    return [LayerKV(f"layers.{i}", specs[kinds[i]],
                    None if targets[i] is None else f"layers.{targets[i]}")
            for i in range(n)]
