"""What a producer vouches for and a consumer checks (``specs/pd.md`` section 2): digests
of a prompt, a layout, registered planes, per-tensor scales and a model identity, and a
checksum per token and KV head of the KV itself.

Both sides compute the same functions over their own data: the producer over its cache
and handshakes, the consumer over the handshakes it was given and the bytes that arrived
in its own cache (after any relayout).  A (token, head) checksum covers every logical
element (layer, K or V, dim, scales) of that head's KV, as raw bits, independent of either
side's layout and of the tensor-parallel split: a consumer rank holding other heads than a
producer rank compares the global heads both hold.  The sum is the core's
(:mod:`kvabi.transfer.checksum`), the one every kvabi pull uses.
"""
from __future__ import annotations

import hashlib

import numpy as np

from ..transfer.checksum import kv_checksums


def _b2(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def layout_fingerprint(layout) -> bytes:
    """The 16 bytes of the layout's own :meth:`kvabi.Layout.fingerprint` (where every byte
    lives), the fixed-width field a grant record carries."""
    return bytes.fromhex(layout.fingerprint().split(":", 1)[1])


def planes_digest(handshake) -> bytes:
    """16 bytes identifying the agent, the memory type and the (address, nbytes, device) of
    each plane a parsed handshake lists (int64, little-endian)."""
    rows = np.ascontiguousarray(handshake.planes, "<i8")
    return _b2(handshake.agent_name.encode() + b"\0" + handshake.memory.encode() + b"\0" +
               rows.tobytes())


def scales_digest(handshake) -> bytes:
    """16 bytes identifying the per-layer ``kv_scales`` a parsed handshake states (float64,
    little-endian), or that it states none."""
    s = handshake.kv_scales
    return _b2(b"none" if s is None else np.asarray(s, "<f8").tobytes())


def model_digest(handshake) -> bytes:
    """16 bytes identifying the model identity a parsed handshake states, or that it states
    none."""
    m = handshake.model
    return _b2(b"none" if m is None else b"model:" + m.encode())


def tokens_digest(token_ids) -> bytes:
    """16 bytes identifying a token sequence (the prompt a grant was issued for): BLAKE2b
    of the ids as little-endian int64."""
    return _b2(np.ascontiguousarray(np.asarray(token_ids, np.int64), "<i8").tobytes())


def head_checksums(cache, slots) -> np.ndarray:
    """uint32 [len(slots), local heads]: per token (slot; -1 for none: checksum 0) and head
    of ``cache`` (a KVCache holding keys and values, its layout stating its shard), the
    core's per-head checksum (:func:`kvabi.transfer.checksum.kv_checksums`, one token a
    chunk) folded to 32 bits.  Column ``i`` sums global head ``shard.heads[i]``, so a peer
    holding other heads of the same tokens compares the heads it holds."""
    slots = np.asarray(slots, np.int64).reshape(-1)
    heads = cache.layout.size("H")
    out = np.zeros((slots.size, heads), np.uint32)
    have = np.flatnonzero(slots >= 0)
    if have.size:
        v = kv_checksums(cache, slots[have], chunk=1).values
        out[have] = ((v ^ (v >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return out


__all__ = ["head_checksums", "layout_fingerprint", "model_digest", "planes_digest",
           "scales_digest", "tokens_digest"]
