"""The KV caches of a whole model: :class:`ModelKV` (ordered layers, KV sharing, the groups
of owner layers that share a spec) and :class:`KVGroup`."""
from __future__ import annotations

from typing import Mapping

import attrs

from ..util.errors import KVABIError, require
from .hf_config import layers_from_hf_config
from .spec import KVSpec, LayerKV


@attrs.frozen
class KVGroup:
    """Layers that own caches of one spec and so can share one block table."""

    spec: KVSpec
    layers: tuple[str, ...]


@attrs.frozen
class ModelKV:
    """The KV caches of a model: ordered layers, their groups, and KV sharing."""

    layers: tuple[LayerKV, ...] = attrs.field(converter=tuple)
    # name -> index, and each layer's owner index: built once, so lookups are O(1) and the
    # whole model is linear in its layers (sharing chains resolve through earlier layers).
    _index: dict = attrs.field(init=False, eq=False, repr=False)
    _owner: tuple = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self):
        require(len(self.layers) > 0, "layers", "a model needs at least one layer")
        index: dict[str, int] = {}
        owner: list[int] = []
        for i, layer in enumerate(self.layers):
            require(isinstance(layer, LayerKV), f"layers[{i}]", "must be a LayerKV", layer)
            require(isinstance(layer.name, str), f"layers[{i}].name", "must be a string",
                    layer.name)
            require(layer.name not in index, f"layers[{i}].name", "duplicate layer name",
                    layer.name)
            require(isinstance(layer.spec, KVSpec), f"layers[{i}].spec", "must be a KVSpec",
                    layer.spec)
            if layer.shares is not None:
                j = index.get(layer.shares) if isinstance(layer.shares, str) else None
                if j is None:
                    raise KVABIError(f"layers[{i}].shares: {layer.name!r} shares "
                                     f"{layer.shares!r}, which is not an earlier layer")
                if self.layers[j].spec != layer.spec:
                    raise KVABIError(f"layers[{i}].spec: {layer.name!r} shares "
                                     f"{layer.shares!r} but their specs differ")
                owner.append(owner[j])
            else:
                owner.append(i)
            index[layer.name] = i
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_owner", tuple(owner))

    def __len__(self):
        return len(self.layers)

    def layer(self, name: str) -> LayerKV:
        i = self._index.get(name) if isinstance(name, str) else None
        if i is None:
            raise KVABIError(f"layer: no layer named {name!r}")
        return self.layers[i]

    def owner(self, name: str) -> str:
        """The layer whose cache ``name`` reads (itself when it owns one); chains resolve."""
        self.layer(name)
        return self.layers[self._owner[self._index[name]]].name

    @property
    def shared_layers(self) -> dict[str, str]:
        """layer name -> owner name, for every layer that reads another layer's cache."""
        return {l.name: self.layers[o].name for l, o in zip(self.layers, self._owner)
                if l.shares is not None}

    @property
    def owners(self) -> tuple[str, ...]:
        """Names of the layers that own a cache, in order: the layers a layout's L axis
        holds (owner i is index i on it), like :attr:`shared_layers` and
        :attr:`prefill_skip_layers` give names (:attr:`owner_layers`: the objects)."""
        return tuple(l.name for l in self.owner_layers)

    @property
    def owner_layers(self) -> tuple[LayerKV, ...]:
        """The :class:`LayerKV` of each layer that owns a cache, in order."""
        return tuple(l for l in self.layers if l.shares is None)

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """Owner layers grouped by identical spec, in order of first appearance."""
        by_spec: dict[KVSpec, list[str]] = {}
        for l in self.owner_layers:
            by_spec.setdefault(l.spec, []).append(l.name)
        return tuple(KVGroup(spec, tuple(names)) for spec, names in by_spec.items())

    @property
    def prefill_skip_layers(self) -> tuple[str, ...]:
        """The maximal suffix of layers that all read another layer's cache.

        Prefill of these layers can be skipped (only consumed tokens run through them);
        empty when the last layer owns its cache.
        """
        out = []
        for l in reversed(self.layers):
            if l.shares is None:
                break
            out.append(l.name)
        return tuple(reversed(out))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token of context costs across all layers that own a cache."""
        return sum(l.spec.bytes_per_token for l in self.owner_layers)

    @classmethod
    def from_hf_config(cls, config: Mapping | str, block_size: int = 16,
                       kv_dtype: str | None = None, kv_quant: str | None = None,
                       rounding: str = "nearest_even") -> "ModelKV":
        """Build from a Hugging Face ``config.json`` (a dict or a path); see kvabi.model.hf_config
        (``kv_quant``/``rounding``: a quantized cache, by default as the config states)."""
        return cls(layers_from_hf_config(config, block_size=block_size, kv_dtype=kv_dtype,
                                         kv_quant=kv_quant, rounding=rounding))
