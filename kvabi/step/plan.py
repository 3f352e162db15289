"""The step plan: one immutable value per step and KV group, made by ``Backend.plan``.

It carries what every backend needs, checked once (the metadata against the spec and the
layout, the attention options, the query head count) and, in :attr:`StepPlan.prepared`,
what the backend itself prepared for the step (index arrays on its device, a library's
planned wrapper).  Every layer of the group reuses it: nothing in it depends on the layer.
The layout is fixed here, so the per-layer calls take no layout.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..model.spec import KVSpec
from .metadata import CommonAttentionMetadata


@attrs.frozen(eq=False)
class StepPlan:
    """One step of one KV group, for one backend (see the module docstring).

    ``scale`` is resolved (default ``1/sqrt(head_dim)``); ``softcap`` and ``sinks`` are None
    when off; ``sinks`` holds one float64 logit per query head (read-only), the default of
    every layer.  ``prepared`` is the backend's own (``Backend.prepare``); its type is the
    backend's business.  Only the backend that made a plan accepts it: a copy, or a plan
    rebuilt from these fields, is refused."""

    backend: str
    meta: CommonAttentionMetadata
    spec: KVSpec
    layout: Layout
    num_q_heads: int
    scale: float
    softcap: float | None
    sinks: np.ndarray | None
    prepared: object = None
    #: derived once, for the per-layer checks: the step's array shapes (key, value or None
    #: for MLA, query, output) and the layout's layer count
    shapes: tuple = attrs.field(init=False, repr=False)
    num_layers: int = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self):
        t, h, s = self.meta.num_tokens, self.spec.num_kv_heads, self.spec
        object.__setattr__(self, "shapes", (
            (t, h, s.head_dim), None if s.is_mla else (t, h, s.head_dim_v),
            (t, self.num_q_heads, s.head_dim), (t, self.num_q_heads, s.head_dim_v)))
        object.__setattr__(self, "num_layers", self.layout.num_layers)

    @property
    def num_tokens(self) -> int:
        """Tokens of the step, padding included (the first dimension of every array)."""
        return self.meta.num_tokens
