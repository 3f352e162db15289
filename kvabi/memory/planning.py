"""Memory planning: how many blocks each KV group gets out of a byte budget.

Each group (owner layers of one spec, see :attr:`ModelKV.groups`) gets one tensor per
layer of ``num_blocks`` pages.  Layers that read another layer's cache cost nothing.

Two schemes:

``equal`` (default)
    Every group gets the same number of blocks, as vLLM's hybrid allocator does: a request
    needs blocks in every group, and a short request (shorter than any window) needs as
    many in a windowed group as in a full one, so equal pools never run out in one group
    first whatever the mix of request lengths.
``demand``
    Sized for requests of ``max_model_len`` tokens: each group gets blocks in proportion
    to what one such request holds in it (a windowed group holds only the blocks covering
    its window), and what is left over is spread equally.  For models that are mostly
    windowed (Gemma 3: 52 of 62 layers slide over 1024 tokens) this admits several times
    more long requests than ``equal``; in exchange, many short requests can exhaust a
    windowed group before the full-attention groups are full.
"""
from __future__ import annotations

import re

import attrs

from ..layout.descriptor import Layout
from ..model.model_kv import ModelKV
from ..model.spec import KVSpec
from ..util.coerce import as_int, is_int
from ..util.errors import KVABIError, require

SCHEMES = ("equal", "demand")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str | int) -> int:
    """Bytes from ``"16GiB"``, ``"1.5 GB"``, ``"512MiB"``, ``"4096"`` or an integer
    (Python, numpy or torch).

    Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024), any case.
    Fractions round down to a whole byte.
    """
    if is_int(text):
        return as_int(text, "memory", lo=0)
    require(isinstance(text, str), "memory", "must be a size such as '16GiB'", text)
    m = _BYTES_RE.fullmatch(text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise KVABIError(f"memory: {text!r} is not a size; use an int or a number with one "
                         "of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB")
    number = m.group(1)
    if "." in number:
        whole, frac = number.split(".")
        # exact decimal arithmetic: no float rounding surprises for "1.1GB"
        scale = 10 ** len(frac)
        return (int(whole or 0) * scale + int(frac or 0)) * unit // scale
    return int(number) * unit


@attrs.frozen
class GroupPlan:
    """The tensors of one KV group: one per layer, each ``num_blocks`` pages."""

    spec: KVSpec
    layers: tuple[str, ...]
    num_blocks: int
    #: bytes of one block of one layer as the chosen layout holds it
    page_bytes: int

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def layer_bytes(self) -> int:
        """Bytes of each layer's tensor."""
        return self.num_blocks * self.page_bytes

    @property
    def bytes(self) -> int:
        """Bytes of all this group's tensors."""
        return self.layer_bytes * len(self.layers)

    @property
    def tokens(self) -> int:
        """Token slots each layer's tensor holds."""
        return self.num_blocks * self.spec.block_size

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "layers": list(self.layers), "block_size": self.spec.block_size,
             "num_kv_heads": self.spec.num_kv_heads, "head_dim": self.spec.head_dim,
             "head_dim_v": self.spec.head_dim_v, "dtype": self.spec.dtype,
             "page_bytes": self.page_bytes, "num_blocks": self.num_blocks,
             "bytes": self.bytes}
        if self.spec.span is not None:
            d["window" if self.kind == "sliding_window" else "chunk"] = self.spec.span
        return d


@attrs.frozen
class MemoryPlan:
    """What to allocate for a model within a byte budget, and what it holds.

    ``max_tokens``: tokens of context the cache holds at once, over all requests.  With a
    full-attention (or MLA) group that is its token slots (the smallest such group's),
    and it bounds the sum of the requests' lengths.  When every group is windowed or
    chunked (``context_bounded`` is False) a request's length is not bounded by memory:
    ``max_tokens`` is then the token slots of the smallest group, i.e. how many tokens
    the requests' windows or chunks may hold together.

    ``max_concurrent_requests``: requests of ``max_model_len`` tokens that fit at once
    (each decoding up to ``max_query_len`` tokens per step), None without a
    ``max_model_len``; 0 means not even one fits.
    """

    model: ModelKV
    memory_bytes: int
    scheme: str
    groups: tuple[GroupPlan, ...]
    max_model_len: int | None
    max_query_len: int

    @property
    def used_bytes(self) -> int:
        return sum(g.bytes for g in self.groups)

    @property
    def shared_layers(self) -> dict[str, str]:
        return self.model.shared_layers

    @property
    def prefill_skip_layers(self) -> tuple[str, ...]:
        return self.model.prefill_skip_layers

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def context_bounded(self) -> bool:
        """True when some group keeps every token of a request (full attention or MLA)."""
        return any(g.spec.span is None for g in self.groups)

    @property
    def max_tokens(self) -> int:
        unbounded = [g for g in self.groups if g.spec.span is None]
        return min(g.tokens for g in (unbounded or self.groups))

    @property
    def max_concurrent_requests(self) -> int | None:
        if self.max_model_len is None:
            return None
        return min(g.num_blocks // g.spec.blocks_per_request(self.max_model_len,
                                                              self.max_query_len)
                   for g in self.groups)

    def to_dict(self) -> dict:
        return {"layers": len(self.model), "kv_bytes_per_token": self.kv_bytes_per_token,
                "memory_bytes": self.memory_bytes, "used_bytes": self.used_bytes,
                "scheme": self.scheme, "groups": [g.to_dict() for g in self.groups],
                "shared_layers": self.shared_layers,
                "prefill_skip_layers": list(self.prefill_skip_layers),
                "max_tokens": self.max_tokens, "context_bounded": self.context_bounded,
                "max_model_len": self.max_model_len, "max_query_len": self.max_query_len,
                "max_concurrent_requests": self.max_concurrent_requests}


def layout_page_bytes(spec: KVSpec, layout: str | None = None) -> int:
    """Bytes one more block of one layer costs in the preset ``layout`` (padding such as
    TPU's head dim rounded up to 128 included); ``spec.page_bytes`` without a layout."""
    if layout is None:
        return spec.page_bytes
    one, two = (Layout.preset(layout, spec, b, 1).total_nbytes for b in (1, 2))
    return two - one


def plan_memory(model: ModelKV, memory_bytes: int, max_model_len: int | None = None,
                max_query_len: int = 1, scheme: str = "equal",
                layout: str | None = None) -> MemoryPlan:
    """Split ``memory_bytes`` between the KV groups of ``model`` (see the module doc).

    ``layout`` names the preset the caches will use, so that its padding is paid for.

    Never allocates more than ``memory_bytes``.  Raises :class:`KVABIError` when the
    budget cannot hold one block in every group (``demand``: one request of
    ``max_model_len``).
    """
    require(isinstance(model, ModelKV), "model", "must be a ModelKV", type(model).__name__)
    # Strict ints (no bool, no float) within int64, like every kvabi size.
    memory_bytes = as_int(memory_bytes, "memory_bytes", lo=1)
    if max_model_len is not None:
        max_model_len = as_int(max_model_len, "max_model_len", lo=1)
    max_query_len = as_int(max_query_len, "max_query_len", lo=1)
    require(isinstance(scheme, str) and scheme in SCHEMES, "scheme",
            f"must be one of {', '.join(SCHEMES)}", scheme)

    groups = model.groups
    page = [layout_page_bytes(g.spec, layout) for g in groups]
    # bytes of one more block in every group
    stride = sum(p * len(g.layers) for p, g in zip(page, groups))
    if scheme == "equal":
        blocks = [memory_bytes // stride] * len(groups)
        require(blocks[0] > 0, "memory_bytes",
                f"must hold one block in every group ({stride} bytes)", memory_bytes)
    else:
        require(max_model_len is not None, "max_model_len", "the demand scheme needs it")
        demand = [g.spec.blocks_per_request(max_model_len, max_query_len) for g in groups]
        per_request = sum(d * p * len(g.layers) for d, p, g in zip(demand, page, groups))
        requests = memory_bytes // per_request
        require(requests > 0, "memory_bytes",
                f"must hold one request of max_model_len={max_model_len} "
                f"({per_request} bytes)", memory_bytes)
        extra = (memory_bytes - requests * per_request) // stride
        blocks = [requests * d + extra for d in demand]
    plan = MemoryPlan(model, memory_bytes, scheme,
                      tuple(GroupPlan(g.spec, g.layers, b, p)
                            for g, b, p in zip(groups, blocks, page)),
                      max_model_len, max_query_len)
    assert plan.used_bytes <= memory_bytes  # the contract; cheap to keep checking
    return plan
