"""Checksums of a request's KV per token chunk and global head, computed on each side of a
pull from that side's own cache (``specs/transfer.md``, *Checksums*).

The serving side sums the tokens it serves, the receiving side the tokens it received, each
through its own layout: the sums do not depend on either layout, on block sizes, on the
TP split or on the plan between them, so a mismatch shows bytes that are not the source's
(a corrupted or reused block, a wrong region pairing, a shard that is not what it says)
whatever went wrong in between.  The sum is linear over 32-bit words (8-bit where a
head's bytes are not a multiple of 4) with position-dependent odd 64-bit weights, mod
2^64: any change of one word changes it; it detects accidents and bugs, not an adversary
who controls both the bytes and the sums.  Vectorized: one gather and one multiply-add per
layer and K/V.
"""
from __future__ import annotations

import json

import attrs
import numpy as np

from ..layout.component import NAMES
from ..memory.cache import KVCache
from ..model.shard import shard_of
from ..util.coerce import as_int, int_array
from ..util.errors import KVABIError
from ..util.frozen import frozen_array
from ..util.safe_json import loads
from ..util.tensors import to_numpy
from .execute import byte_view

#: tokens per checksum chunk by default (one per chunk and global head)
CHUNK = 16
#: version of the sum; both sides must agree
VERSION = "kvsum1"
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 counters (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _weights(layer: int, kv: int, chunk: int, words: int) -> np.ndarray:
    """Odd weights [chunk, words] of (layer, kv, token in chunk, word); ``kv`` 0 and 1 are
    the keys (an MLA latent) and values, ``kv`` >= 2 a component of its own (a scale, the
    rope part), whose counters start at ``kv << 56``."""
    base = (layer * 2 + kv) * chunk * words if kv < 2 else \
        (kv << 56) + layer * chunk * words
    ctr = np.arange(base, base + chunk * words, dtype=np.uint64).reshape(chunk, words)
    return _mix(ctr) | np.uint64(1)


def _index(name: str) -> int:
    """The ``kv`` of a component in the sum: keys and a latent 0, values 1, every other
    component 2 + its place in the vocabulary."""
    if name in ("key", "latent"):
        return 0
    if name == "value":
        return 1
    return 2 + NAMES.index(name)


def _component_rows(cache: KVCache, c, layer: int, blocks, offs) -> np.ndarray:
    """The bytes of component ``c`` at (``layer``, token i at ``blocks[i]``,
    ``offs[i]``) for every local head: [T, H, record bytes] (a component without an H
    stride: its one record under every head)."""
    lay = cache.layout
    heads = lay.size("H")
    h = np.arange(heads if c.varies("H") else 1)
    per = c.count // c.units
    plane, off = lay.element_offset(c.name, layer=layer, block=blocks[:, None, None],
                                    token=offs[:, None, None], head=h[None, :, None],
                                    index=np.arange(c.units)[None, None, :] * per)
    p = int(np.ravel(plane)[0])  # one plane per (component, layer)
    flat = byte_view(to_numpy(cache[p]), lay, p)
    off = np.broadcast_to(off, (blocks.size, h.size, c.units))
    rows = flat[off[..., None] + np.arange(c.unit)].reshape(blocks.size, h.size, -1)
    return np.broadcast_to(rows, (blocks.size, heads, rows.shape[-1]))


@attrs.frozen(eq=False)
class KVChecksums:
    """``values[c, i]``: the sum of tokens ``c*chunk .. c*chunk + chunk - 1`` (of ``tokens``)
    of global head ``heads[i]`` over ``layers``."""

    heads: tuple
    layers: tuple
    tokens: int
    chunk: int
    values: np.ndarray

    def to_json(self) -> str:
        return json.dumps({"sum": VERSION, "heads": list(self.heads),
                           "layers": list(self.layers), "tokens": self.tokens,
                           "chunk": self.chunk,
                           "values": [[f"{v:016x}" for v in row] for row in
                                      self.values.tolist()]}, sort_keys=True)

    @classmethod
    def from_json(cls, text) -> "KVChecksums":
        """Parse a peer's checksums (untrusted; KVABIError naming the field)."""
        d = loads(text, what="checksums", max_bytes=16 << 20, max_depth=4)
        if not isinstance(d, dict) or d.get("sum") != VERSION:
            raise KVABIError(f"checksums.sum: must be {VERSION!r}")
        heads = int_array(d.get("heads"), "checksums.heads", lo=0)
        layers = int_array(d.get("layers"), "checksums.layers", lo=0)
        tokens = as_int(d.get("tokens"), "checksums.tokens", lo=0)
        chunk = as_int(d.get("chunk"), "checksums.chunk", lo=1)
        rows = d.get("values")
        n = -(-tokens // chunk)
        if not isinstance(rows, list) or len(rows) != n or not all(
                isinstance(r, list) and len(r) == heads.size for r in rows):
            raise KVABIError(f"checksums.values: must be {n} rows of {heads.size} sums")
        try:
            vals = np.array([[int(v, 16) for v in r] for r in rows], np.uint64)
        except (TypeError, ValueError, OverflowError):
            raise KVABIError("checksums.values: must be 64-bit hex strings") from None
        return cls(tuple(heads.tolist()), tuple(layers.tolist()), tokens, chunk,
                   frozen_array(vals.reshape(n, heads.size)))


def kv_checksums(cache: KVCache, slots, *, layers=None, chunk: int = CHUNK) -> KVChecksums:
    """The checksums of tokens ``slots`` (token i at ``slots[i]``) of ``cache``, for every
    global head its layout's shard holds, over ``layers`` (default: all)."""
    if not isinstance(cache, KVCache):
        raise KVABIError(f"cache: must be a KVCache, got {type(cache).__name__}")
    lay = cache.layout
    bs = lay.size("N")
    slots = int_array(slots, "slots", lo=0, hi=lay.num_blocks * bs - 1)
    layers = tuple(range(lay.num_layers)) if layers is None else tuple(
        int_array(layers, "layers", lo=0, hi=lay.num_layers - 1).tolist())
    chunk = as_int(chunk, "chunk", lo=1)
    n, t = -(-slots.size // chunk), slots.size
    heads = lay.size("H")
    row = lay.size("D") * lay.itemsize
    wtype = np.uint32 if row % 4 == 0 else np.uint8
    words = row // np.dtype(wtype).itemsize
    acc = np.zeros((n, heads), np.uint64)
    blocks, offs = slots // bs, slots % bs

    def add(x, layer, kv):  # x: [T, H, row bytes]
        row = x.shape[-1]
        wtype = np.uint32 if row % 4 == 0 else np.uint8
        words = row // np.dtype(wtype).itemsize
        b = np.zeros((n * chunk, heads, row), np.uint8)
        b[:t] = x
        w = b.view(wtype).reshape(n, chunk, heads, words).astype(np.uint64)
        with np.errstate(over="ignore"):
            acc[...] += np.einsum("cthw,tw->ch", w, _weights(layer, kv, chunk, words),
                                  dtype=np.uint64)

    fast = lay.is_axis_form and not any(c.units != c.count for c in lay.components)
    for layer in layers:
        if fast:  # the views of the axis form: no gather of offsets
            row = lay.size("D") * lay.itemsize
            for kv in range(2 if lay.has_kv else 1):
                v = to_numpy(cache.kv_view(layer, kv))  # [B, N, H, D], no copy
                x = np.ascontiguousarray(v[blocks, offs])  # [T, H, D]
                add(x.view(np.uint8).reshape(t, heads, row), layer, kv)
            continue
        for c in lay.components:
            if c.varies("N"):  # per-block records are not summed per token
                add(_component_rows(cache, c, layer, blocks, offs), layer, _index(c.name))
    return KVChecksums(shard_of(lay).heads, layers, t, chunk, frozen_array(acc))


def check_checksums(got: KVChecksums, expected: KVChecksums, heads, source: str) -> None:
    """KVABIError naming the first global head of ``heads`` and token chunk where ``got``
    differs from ``expected`` (what ``source`` sent), or where they sum different things."""
    for f in ("layers", "tokens", "chunk"):
        if getattr(got, f) != getattr(expected, f):
            raise KVABIError(f"checksums.{f}: {source} summed {getattr(expected, f)}, the "
                             f"pull {getattr(got, f)}")
    for h in heads:
        if h not in expected.heads:
            raise KVABIError(f"checksums.heads: {source} sent no sums of global head {h}")
        a = got.values[:, got.heads.index(h)]
        b = expected.values[:, expected.heads.index(h)]
        bad = np.flatnonzero(a != b)
        if bad.size:
            c = int(bad[0])
            hi = min((c + 1) * got.chunk, got.tokens) - 1
            raise KVABIError(f"checksum: global head {h}, tokens {c * got.chunk}..{hi} differ "
                             f"from {source}'s ({bad.size} of {a.size} chunks); the "
                             f"destination slots hold wrong data and must not be used")
