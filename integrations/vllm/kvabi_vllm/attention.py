"""A vLLM attention backend that runs any kvabi backend inside vLLM's model runner.

vLLM keeps its engine, scheduler, block manager, model code and KV cache allocation; this
backend turns each step's vLLM metadata into kvabi's (:mod:`kvabi_vllm.metadata`), plans
once per step and KV group (the metadata builder), and per layer writes new K/V
(``do_kv_cache_update``) and runs attention (``forward``) through the kvabi backend named by
``KVABI_VLLM_BACKEND``, over vLLM's own cache memory described byte for byte by a kvabi
:class:`~kvabi.Layout` (:mod:`kvabi_vllm.layouts`).

Everything the kvabi backend cannot serve (dtype, head size, window, soft cap, sinks, a
layout vLLM can allocate) is refused when the engine builds its attention groups, with the
backend's reason, never mid-generation.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

import kvabi
from kvabi import UnsupportedError
from kvabi.util.errors import KVABIError
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionLayer,
                                       AttentionMetadataBuilder, AttentionType, MultipleOf)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout, SlidingWindowSpec

from . import kv_quant as kq
from . import layouts as vl
from .env import ENV_BACKEND, ENV_LAYOUT, ConfigError, backend_from_env, backend_of, say_once
from .metadata import from_vllm, keep_indices


#: Per process: kvabi plans made (one per step and attention group), and how many of them
#: came from prefill skip and dropped tokens (``kv_sharing_fast_prefill``).  Read by tests,
#: the demo and the benchmark to show that kvabi, not vLLM's kernels, ran.
STATS: Counter = Counter()

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def kvabi_backend() -> kvabi.Backend:
    """The kvabi backend named by ``KVABI_VLLM_BACKEND``, available here (else
    :class:`~kvabi_vllm.env.ConfigError` naming the variable)."""
    name = backend_from_env()
    if name is None:
        raise ConfigError(f"{ENV_BACKEND}: not set; name a kvabi backend "
                          f"(`kvabi backends` lists them)")
    return backend_of(name)


def _forced_layout() -> str | None:
    v = os.environ.get(ENV_LAYOUT) or None
    if v is not None and v not in vl.VLLM_LAYOUTS:
        raise KVABIError(f"{ENV_LAYOUT}: must be one of {', '.join(vl.VLLM_LAYOUTS)}, "
                         f"got {v!r}")
    return v


def _model_spec(vllm_config: VllmConfig | None) -> kvabi.KVSpec:
    """A representative spec of the model (full attention) to ask a backend its layouts."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "hf_config", None) is None:
        return kvabi.KVSpec(kind="full", block_size=32, num_kv_heads=1, head_dim=64,
                            dtype="float32")
    bs = getattr(vllm_config.cache_config, "block_size", None) or 32
    return kvabi.KVSpec(kind="full", block_size=bs,
                        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
                        head_dim=mc.get_head_size(), dtype=_DTYPES.get(mc.dtype, "float32"))


def layout_choice(vllm_config: VllmConfig | None = None) -> vl.Choice:
    """vLLM layout name and kvabi preset for the configured backend and model."""
    return vl.choose(kvabi_backend(), _model_spec(vllm_config), vllm_name=_forced_layout())


class KvabiAttentionBackend(AttentionBackend):
    """vLLM's view of the kvabi backend named by ``KVABI_VLLM_BACKEND``."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = list(_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *kq.FP8]

    @staticmethod
    def get_name() -> str:
        # vLLM looks the name up in its backend enum; this class replaces that entry.
        return "CPU_ATTN"

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        caps = kvabi_backend().capabilities()
        if caps.block_sizes:
            return list(caps.block_sizes)
        return [MultipleOf(caps.block_size_multiple)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(kvabi_backend().capabilities().head_dims or ())

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        try:
            config = get_current_vllm_config()
        except Exception:  # outside an engine: no model to ask about
            config = None
        return (KVCacheLayout[layout_choice(config).vllm_name],)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return bool(kvabi_backend().capabilities().sinks)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type["KvabiAttentionImpl"]:
        return KvabiAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KvabiMetadataBuilder"]:
        return KvabiMetadataBuilder


@dataclass
class KvabiGroup:
    """One KV group's standing state: spec, layout, the cache over vLLM's memory, layers."""

    backend: Any
    spec: kvabi.KVSpec
    choice: vl.Choice
    num_q_heads: int
    scale: float
    softcap: float | None
    layer_index: dict[str, int]  # layer name -> L index (KV-shared layers: their owner's)
    layout: Any = None
    cache: Any = None
    bound_to: tuple = ()  # data pointers of the views the cache was built over


@dataclass
class KvabiMetadata:
    """Attention metadata of one step and KV group: the kvabi plan and what it was made of.

    ``logits_indices_padded``/``num_logits_indices`` are vLLM's fast-prefill fields (its
    Gemma 3n reads them from the metadata of KV-shared layers)."""

    group: KvabiGroup
    meta: kvabi.CommonAttentionMetadata
    plan: Any
    num_actual_tokens: int
    logits_indices_padded: torch.Tensor | None = None
    num_logits_indices: int | None = None


class KvabiMetadataBuilder(AttentionMetadataBuilder[KvabiMetadata]):
    """Builds one kvabi plan per step for its KV group (every layer of the group reuses it).

    When vLLM wraps it for ``kv_sharing_fast_prefill`` (a subclass overriding ``build``),
    the KV-shared layers' metadata comes from :func:`kvabi.transforms.prefill_skip` over
    the tokens vLLM samples, instead of vLLM's own transform."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "build" in cls.__dict__:  # vLLM's fast-prefill wrapper: kvabi does the skip
            cls.build = KvabiMetadataBuilder._build_prefill_skip

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        backend = kvabi_backend()
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        impls = {n: layer.impl for n, layer in layers.items()}
        windows = {i.sliding_window for i in impls.values()}
        if isinstance(kv_cache_spec, SlidingWindowSpec):
            windows.add(kv_cache_spec.sliding_window)
        if len(windows) != 1:
            raise UnsupportedError(f"{backend.name}: one plan serves a KV group, but the "
                                   f"layers of group {layer_names} have windows {windows}")
        window = windows.pop()
        # an fp8 cache is uint8 to vLLM: its model dtype here, its kvabi dtype from cache_dtype
        dtype = _DTYPES.get(kv_cache_spec.dtype) or _DTYPES.get(vllm_config.model_config.dtype)
        if dtype is None:
            raise UnsupportedError(f"{backend.name}: KV cache dtype {kv_cache_spec.dtype} "
                                   f"is not one kvabi names")
        spec = kvabi.KVSpec(kind="full" if window is None else "sliding_window",
                            block_size=kv_cache_spec.block_size,
                            num_kv_heads=kv_cache_spec.num_kv_heads,
                            head_dim=kv_cache_spec.head_size, dtype=dtype, window=window)
        spec = kq.quantize_spec(backend, spec, vllm_config.cache_config.cache_dtype)
        one = next(iter(impls.values()))
        for what in ("scale", "logits_soft_cap", "num_heads"):
            vals = {getattr(i, what) for i in impls.values()}
            if len(vals) != 1:
                raise UnsupportedError(f"{backend.name}: one plan serves a KV group, but its "
                                       f"layers differ in {what}: {sorted(vals)}")
        softcap = one.logits_soft_cap or None
        sinks = next((i.sinks for i in impls.values() if i.sinks is not None), None)
        backend.check_supported(spec, softcap=softcap,
                                sinks=None if sinks is None else np.zeros(one.num_heads))
        choice = vl.choose(backend, spec, vllm_name=vllm_config.cache_config
                           .get_resolved_kv_cache_layout().name)
        # The L axis of the group's layout: the layers that own a cache, in order.  A
        # KV-shared layer reads its owner's index; its owner may sit in another attention
        # group (vLLM splits fast-prefill layers off), so owners come from the targets.
        owners = list(dict.fromkeys(impls[n].kv_sharing_target_layer_name or n
                                    for n in layer_names))
        index = {n: owners.index(impls[n].kv_sharing_target_layer_name or n)
                 for n in layer_names}
        missing = set(owners) - set(layers)
        if missing:
            layers = {**layers, **get_layers_from_vllm_config(vllm_config, Attention,
                                                              sorted(missing))}
        self.group = KvabiGroup(backend=backend, spec=spec, choice=choice,
                                num_q_heads=one.num_heads, scale=one.scale, softcap=softcap,
                                layer_index=index)
        self._owners = owners
        self._layers = layers

    # -- per step --------------------------------------------------------------------------
    def _bind(self) -> KvabiGroup:
        """The group's cache over the views vLLM bound to its owning layers (rebuilt only
        when vLLM rebinds them)."""
        g = self.group
        views = [self._layers[n].kv_cache for n in self._owners]
        ptrs = tuple(v.data_ptr() for v in views)
        if ptrs != g.bound_to:
            layout, planes = vl.bind(g.choice, g.spec, views)
            fingerprint = getattr(layout, "fingerprint", None)  # a Layout method to come
            say_once("kvabi-vllm: %s layers of kind %s on kvabi backend %s, kvabi layout %s%s "
                     "in vLLM's layout %s", len(self._owners), g.spec.kind, g.backend.name,
                     layout.name, f" (fingerprint {fingerprint()})" if fingerprint else "",
                     g.choice.vllm_name)
            if g.backend.framework == "numpy":
                planes = [kvabi.tensors.to_numpy(p) for p in planes]  # bf16, fp8: ml_dtypes
            g.layout, g.bound_to = layout, ptrs
            g.cache = kvabi.KVCache.wrap(layout, planes)
        return g

    def _plan(self, meta: kvabi.CommonAttentionMetadata):
        g = self.group
        STATS["plans"] += 1
        return g.backend.plan(meta, g.spec, g.layout, num_q_heads=g.num_q_heads,
                              scale=g.scale, softcap=g.softcap)

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False
              ) -> KvabiMetadata:
        g = self._bind()
        meta = from_vllm(common_attn_metadata, g.spec.block_size)
        return KvabiMetadata(group=g, meta=meta, plan=self._plan(meta),
                             num_actual_tokens=meta.num_tokens)

    def _build_prefill_skip(self, common_prefix_len: int, common_attn_metadata,
                            fast_build: bool = False) -> KvabiMetadata:
        g = self._bind()
        cm = common_attn_metadata
        meta = from_vllm(cm, g.spec.block_size)
        keep = keep_indices(cm)
        if keep is not None:
            full = meta.num_tokens
            meta, _ = kvabi.transforms.prefill_skip(meta, keep)
            STATS["prefill_skip_plans"] += 1
            STATS["prefill_skip_tokens_dropped"] += full - meta.num_tokens
        return KvabiMetadata(group=g, meta=meta, plan=self._plan(meta),
                             num_actual_tokens=meta.num_tokens,
                             logits_indices_padded=cm.logits_indices_padded,
                             num_logits_indices=cm.num_logits_indices)


def _step(layer_name: str) -> KvabiMetadata | None:
    from vllm.model_executor.layers.attention.attention import get_attention_context

    return get_attention_context(layer_name)[0]


class KvabiAttentionImpl(AttentionImpl):
    """Per layer: write new K/V and run attention through the kvabi backend."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        name = os.environ.get(ENV_BACKEND, "?")
        if alibi_slopes is not None:
            raise UnsupportedError(f"{name}: ALiBi is not in kvabi's semantics")
        if kv_cache_dtype != "auto" and kv_cache_dtype not in kq.FP8:
            raise UnsupportedError(f"{name}: kv_cache_dtype {kv_cache_dtype!r} (served: auto, "
                                   f"{', '.join(kq.FP8)})")
        if attn_type != AttentionType.DECODER:
            raise UnsupportedError(f"{name}: attention type {attn_type} (decoder only)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks

    @staticmethod
    def _out(g: KvabiGroup, out: torch.Tensor):
        """vLLM's output buffer as the backend writes it: the same memory (a numpy view for
        a numpy backend; bfloat16 as ml_dtypes)."""
        return kvabi.tensors.to_numpy(out) if g.backend.framework == "numpy" else out

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        md = _step(layer.layer_name)
        if md is None:  # profiling run: no cache yet
            return
        g, n = md.group, md.num_actual_tokens
        k = key[:n].reshape(n, self.num_kv_heads, self.head_size)
        v = value[:n].reshape(n, self.num_kv_heads, self.head_size)
        out = g.backend.write_kv(md.plan, g.cache, key=k, value=v,
                                 layer=g.layer_index[layer.layer_name],
                                 **kq.layer_scales(layer, g.spec))
        if out is not g.cache and g.backend.framework == "jax":
            raise UnsupportedError(f"{g.backend.name}: a jax cache cannot live in vLLM's "
                                   f"torch memory")

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: KvabiMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedError("fused output quantization is not served by kvabi")
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        g, n = md.group, md.num_actual_tokens
        q = query[:n].reshape(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        # the layer's sinks tensor, the same every step: checked once (kvabi.Backend)
        g.backend.attention(md.plan, g.cache, query=q, layer=g.layer_index[layer.layer_name],
                            sinks=self.sinks, out=self._out(g, out),
                            **kq.layer_scales(layer, g.spec))
        return output
