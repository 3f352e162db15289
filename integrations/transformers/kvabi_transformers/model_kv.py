"""The kvabi view of a transformers model: its ModelKV (from its config) and, per layer,
the attention module, checked against each other so that a config kvabi reads differently
from the modeling code fails at ``use()``, not mid-generation."""
from __future__ import annotations

import attrs
import kvabi
from kvabi import KVABIError


@attrs.frozen
class LayerSlot:
    """Where layer ``layer_idx`` keeps its K/V: KV group ``group``, layer ``index`` of that
    group's layout; ``shared`` when it reads another layer's cache (never writes)."""

    layer_idx: int
    group: int
    index: int
    shared: bool


def config_dict(config) -> dict:
    """The model config as the dict ``ModelKV.from_hf_config`` reads, with what transformers
    keeps only in per-layer form put back (Gemma 4's ``global_head_dim`` lives in
    ``per_layer_config`` once the config object is built)."""
    d = config.to_dict()
    per_layer = d.get("per_layer_config") or {}
    kinds = d.get("layer_types") or []
    for idx, over in per_layer.items():
        i = int(idx)
        if i < len(kinds) and kinds[i] == "full_attention" and isinstance(over, dict):
            if "head_dim" in over:
                d.setdefault("global_head_dim", over["head_dim"])
            if "num_key_value_heads" in over:
                d.setdefault("num_global_key_value_heads", over["num_key_value_heads"])
    return d


def attention_modules(model) -> dict[int, object]:
    """layer index -> the decoder layer's attention module (modules with a ``layer_idx``
    and a query projection)."""
    out = {}
    for _, m in model.named_modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and hasattr(m, "q_proj") and hasattr(m, "o_proj"):
            out.setdefault(idx, m)
    return out


def model_kv(model, block_size: int, kv_dtype: str | None):
    """(ModelKV, {layer_idx: LayerSlot}, {layer_idx: attention module}) of ``model``."""
    config = model.config.get_text_config()
    try:
        mkv = kvabi.ModelKV.from_hf_config(config_dict(config), block_size=block_size,
                                           kv_dtype=kv_dtype)
    except KVABIError as e:
        raise KVABIError(f"model: kvabi cannot read the {config.model_type!r} config: {e}") from e
    modules = attention_modules(model)
    n = len(mkv.layers)
    if sorted(modules) != list(range(n)):
        raise KVABIError(f"model: found attention modules for layers {sorted(modules)[:8]}, "
                         f"but the config has {n} layers ({config.model_type!r} is not a "
                         "decoder kvabi_transformers knows how to serve)")
    groups = mkv.groups
    where = {name: (g, i) for g, grp in enumerate(groups) for i, name in enumerate(grp.layers)}
    slots = {}
    for idx, layer in enumerate(mkv.layers):
        attn = modules[idx]
        spec = layer.spec
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is not None and head_dim != spec.head_dim:
            raise KVABIError(f"model: layer {idx} computes head_dim {head_dim} but its config "
                             f"reads as {spec.head_dim} ({config.model_type!r})")
        _check_heads(idx, attn, head_dim or spec.head_dim, spec.num_kv_heads,
                     config.num_attention_heads)
        hf_window = getattr(attn, "sliding_window", None)
        want = spec.window if spec.kind == "sliding_window" else None
        if hasattr(attn, "sliding_window") and hf_window != want:
            raise KVABIError(f"model: layer {idx} has sliding_window {hf_window} but its "
                             f"config reads as kind {spec.kind!r} window {want}")
        hf_shared = bool(getattr(attn, "is_kv_shared_layer", False))
        if hf_shared != (layer.shares is not None):
            raise KVABIError(f"model: layer {idx} KV sharing differs between the modeling "
                             f"code ({hf_shared}) and the config ({layer.shares})")
        g, i = where[mkv.owner(layer.name)]
        slots[idx] = LayerSlot(idx, g, i, layer.shares is not None)
    return mkv, slots, modules


def _heads(proj, head_dim: int) -> int | None:
    """Heads a projection computes (its output features over ``head_dim``); None where the
    module does not say (not a Linear-like module); -1 where they do not divide."""
    out = getattr(proj, "out_features", None)
    if not isinstance(out, int) or isinstance(out, bool):
        return None
    return out // head_dim if out % head_dim == 0 else -1


def _check_heads(idx: int, attn, head_dim: int, kv_heads: int, q_heads) -> None:
    """The config's head counts against what the layer's projections compute, so that a
    config edited after the model was built fails here, not in ``generate_batch``."""
    q = _heads(getattr(attn, "q_proj", None), head_dim)
    if q is not None and q != q_heads:
        raise KVABIError(f"num_attention_heads: the config says {q_heads!r}, but layer {idx}'s "
                         f"q_proj computes {attn.q_proj.out_features} features "
                         f"(head_dim {head_dim})")
    k = _heads(getattr(attn, "k_proj", None), head_dim)
    if k is not None and k != kv_heads:
        raise KVABIError(f"num_key_value_heads: the config reads as {kv_heads} KV heads at "
                         f"layer {idx}, but its k_proj computes {attn.k_proj.out_features} "
                         f"features (head_dim {head_dim})")
