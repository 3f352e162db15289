"""What each layer's KV cache is: :class:`KVSpec` and :class:`LayerKV` (the whole model:
:mod:`kvabi.model.model_kv`)."""
from __future__ import annotations

import attrs

from ..util.coerce import as_int
from ..util.dtypes import check_dtype, itemsize
from ..util.errors import KVABIError, require
from .quant import check_quant

KINDS = ("full", "sliding_window", "chunked_local", "mla")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive(field, optional: bool = False):
    """An attrs converter: a positive integer within int64 (Python, numpy, torch or jax
    integers welcome, stored as a Python int; bool, float or str refused by name); ``None``
    kept where the field is ``optional``."""
    def convert(value):
        if optional and value is None:
            return None
        return as_int(value, field, lo=1)

    return convert


@attrs.frozen
class KVSpec:
    """The KV cache of one layer.

    ``kind`` is ``full``, ``sliding_window`` (needs ``window`` W: a query at p sees keys
    p-W < j <= p), ``chunked_local`` (needs ``chunk`` C: keys in the query's own chunk of C
    positions) or ``mla`` (one latent plane per token of width ``head_dim`` =
    kv_lora_rank + rope dim; ``head_dim_v`` = kv_lora_rank, the part attention returns;
    ``num_kv_heads`` must be 1).  ``page_align`` pads each page (block of one layer) to a
    multiple of that many bytes, as some backends require.

    A quantized cache (``specs/semantics.md`` section 11) states ``quant``:
    ``per_tensor`` (one static float32 scale per layer for keys and one for values, given
    by the caller of ``write_kv`` and ``attention``) or ``per_token_head`` (one float32
    scale per token and head for keys and for values, computed by the write and stored in
    the cache beside the codes); its ``dtype`` is then ``float8_e4m3fn``, ``float8_e5m2``
    or ``int8``, and ``rounding`` says how a scaled value becomes a code
    (``nearest_even``; ``nearest_away`` for int8; ``toward_zero`` for float8).  ``quant``
    ``none`` (the default) stores values as given, in any dtype.
    """

    kind: str = attrs.field()
    block_size: int = attrs.field(converter=_positive("block_size"))
    num_kv_heads: int = attrs.field(converter=_positive("num_kv_heads"))
    head_dim: int = attrs.field(converter=_positive("head_dim"))
    dtype: str = attrs.field(default="bfloat16")
    head_dim_v: int | None = attrs.field(default=None,
                                         converter=_positive("head_dim_v", optional=True))
    window: int | None = attrs.field(default=None, converter=_positive("window", optional=True))
    chunk: int | None = attrs.field(default=None, converter=_positive("chunk", optional=True))
    page_align: int = attrs.field(default=1, converter=_positive("page_align"))
    quant: str = attrs.field(default="none")
    rounding: str = attrs.field(default="nearest_even")

    @kind.validator
    def _check_kind(self, attr, value):
        require(isinstance(value, str) and value in KINDS, "kind", f"must be one of {', '.join(KINDS)}", value)

    def __attrs_post_init__(self):
        check_dtype(self.dtype)
        check_quant(self.quant, self.rounding, self.dtype)
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.kind == "sliding_window":
            require(self.window is not None, "window",
                    "sliding_window needs a positive window", self.window)
        else:
            require(self.window is None, "window", f"only for sliding_window, not {self.kind}",
                    self.window)
        if self.kind == "chunked_local":
            require(self.chunk is not None, "chunk",
                    "chunked_local needs a positive chunk", self.chunk)
        else:
            require(self.chunk is None, "chunk", f"only for chunked_local, not {self.kind}",
                    self.chunk)
        if self.kind == "mla":
            require(self.num_kv_heads == 1, "num_kv_heads", "MLA has one latent head",
                    self.num_kv_heads)
            require(self.head_dim_v <= self.head_dim, "head_dim_v",
                    f"MLA value width must be <= latent width {self.head_dim}", self.head_dim_v)
            require(self.quant != "per_token_head", "quant",
                    "an MLA latent has no per-(token, head) scales (per_tensor or none)",
                    self.quant)

    @property
    def is_mla(self) -> bool:
        return self.kind == "mla"

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def is_quantized(self) -> bool:
        """Whether values are stored as codes under scales (``quant`` is not ``none``)."""
        return self.quant != "none"

    @property
    def scale_bytes_per_token(self) -> int:
        """Bytes of the scales one token stores: a float32 for its keys and one for its
        values per head when ``quant`` is ``per_token_head``, else 0."""
        return self.num_kv_heads * 2 * 4 if self.quant == "per_token_head" else 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token of context costs in this layer (unpadded; stored scales
        included)."""
        if self.is_mla:
            return self.head_dim * self.itemsize
        return (self.num_kv_heads * (self.head_dim + self.head_dim_v) * self.itemsize
                + self.scale_bytes_per_token)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer, padded to ``page_align``."""
        return cdiv(self.block_size * self.bytes_per_token, self.page_align) * self.page_align

    @property
    def span(self) -> int | None:
        """Keys one query can see at most (window or chunk), None for unbounded."""
        return self.window if self.kind == "sliding_window" else self.chunk

    def first_visible_key(self, positions):
        """The lowest key position a query at each of ``positions`` sees (numpy int arrays
        broadcast): 0, ``p - W + 1`` (window, floored at 0) or the start of p's chunk.
        With causality the visible keys of a query at p are ``first_visible_key(p) <= j <= p``."""
        import numpy as np

        p = np.asarray(positions)
        if self.kind == "sliding_window":
            return np.maximum(0, p - self.window + 1)
        if self.kind == "chunked_local":
            return (p // self.chunk) * self.chunk
        return np.zeros_like(p)

    def blocks_per_request(self, max_len: int, max_query_len: int = 1) -> int:
        """Blocks a request of up to ``max_len`` tokens must hold at once.

        A sliding window or chunk needs only the blocks covering the last
        ``span - 1 + max_query_len`` positions (plus one for misalignment).
        """
        max_len = as_int(max_len, "max_len", lo=1)
        max_query_len = as_int(max_query_len, "max_query_len", lo=1)
        full = cdiv(max_len, self.block_size)
        if self.span is None:
            return full
        return min(full, cdiv(self.span - 1 + max_query_len, self.block_size) + 1)


@attrs.frozen
class LayerKV:
    """One attention layer: its name, its spec, and the layer whose cache it reads, if any."""

    name: str
    spec: KVSpec
    shares: str | None = None
