"""What a backend can compute, and every reason a spec falls outside it."""
from __future__ import annotations

import attrs


@attrs.frozen
class Capabilities:
    """What a backend can compute.  ``None`` in a tuple field means "any".

    ``layouts`` is informational (the presets the backend can address); what an engine
    should allocate is ``Backend.preferred_layouts``."""

    kinds: tuple[str, ...] = ("full", "sliding_window", "chunked_local")
    dtypes: tuple[str, ...] = ("float32",)
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    block_size_multiple: int = 1
    softcap: bool = False
    sinks: bool = False
    layouts: tuple[str, ...] = ()
    notes: str = ""
    #: the ``KVSpec.quant`` granularities computed (``specs/semantics.md`` section 11)
    quant: tuple[str, ...] = ("none",)
    #: the ``KVSpec.rounding`` modes a quantizing write implements
    roundings: tuple[str, ...] = ("nearest_even",)

    def refusals(self, spec, *, softcap=None, sinks=None) -> tuple[str, ...]:
        """Every reason ``spec`` (with a soft cap / sinks, when given) is outside these
        capabilities, in field order; empty when it is inside (as vLLM's
        ``validate_configuration`` lists them all, not the first)."""
        out = []
        if spec.kind not in self.kinds:
            out.append(f"kind {spec.kind!r} not in {self.kinds}")
        if spec.dtype not in self.dtypes:
            out.append(f"dtype {spec.dtype!r} not in {self.dtypes}")
        if spec.quant not in self.quant:
            out.append(f"quant {spec.quant!r} not in {self.quant}")
        elif spec.quant != "none" and spec.rounding not in self.roundings:
            out.append(f"rounding {spec.rounding!r} not in {self.roundings}")
        if self.head_dims is not None:
            for d in dict.fromkeys((spec.head_dim, spec.head_dim_v)):
                if d not in self.head_dims:
                    out.append(f"head_dim {d} not in {self.head_dims}")
        if self.block_sizes is not None and spec.block_size not in self.block_sizes:
            out.append(f"block_size {spec.block_size} not in {self.block_sizes}")
        if spec.block_size % self.block_size_multiple:
            out.append(f"block_size {spec.block_size} not a multiple of "
                       f"{self.block_size_multiple}")
        if softcap is not None and not self.softcap:
            out.append("soft cap not supported")
        if sinks is not None and not self.sinks:
            out.append("attention sinks not supported")
        return tuple(out)

    def to_dict(self) -> dict:
        return attrs.asdict(self)
