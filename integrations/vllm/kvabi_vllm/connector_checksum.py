"""What a prefill engine vouches for and a decode engine checks: a digest of each served
part's layout and registered planes, and a checksum per token and KV head of the KV it
computed.

Both sides compute the same functions over their own data: the producer over its cache
and handshakes, the consumer over the handshakes it was given and the bytes that arrived
in its own cache (after any relayout).  A (token, head) checksum covers every logical
element (layer, K or V, dim) of that head's KV, as raw bits, independent of either side's
layout and of the tensor-parallel split: a decode rank holding other heads than a prefill
rank compares the global heads both hold.  The sum is the core's
(:mod:`kvabi.transfer.checksum`), the one every kvabi pull uses.
"""
from __future__ import annotations

import hashlib

import numpy as np

from kvabi.transfer.checksum import kv_checksums


def layout_fingerprint(layout) -> bytes:
    """The 16 bytes of the layout's own :meth:`kvabi.Layout.fingerprint` (where every byte
    lives), the fixed-width field a grant record carries."""
    return bytes.fromhex(layout.fingerprint().split(":", 1)[1])


def planes_digest(handshake) -> bytes:
    """16 bytes identifying the agent, the memory type and the (address, nbytes, device) of
    each plane a parsed handshake lists."""
    h = hashlib.blake2b(digest_size=16)
    h.update(handshake.agent_name.encode() + b"\0" + handshake.memory.encode() + b"\0")
    h.update(np.ascontiguousarray(handshake.planes, "<i8").tobytes())
    return h.digest()


def tokens_digest(token_ids) -> bytes:
    """16 bytes identifying a token sequence (the prompt a grant was issued for)."""
    toks = np.ascontiguousarray(np.asarray(token_ids, np.int64))
    return hashlib.blake2b(toks.tobytes(), digest_size=16).digest()


def head_checksums(cache, slots) -> np.ndarray:
    """uint32 [len(slots), local heads]: per token (slot; -1 for none: checksum 0) and head
    of ``cache`` (a KVCache holding keys and values, its layout stating its shard), the
    core's per-head checksum (:func:`kvabi.transfer.checksum.kv_checksums`, one token a
    chunk: a weighted sum of the raw words of the head's keys and values over every layer,
    modulo 2**64) folded to 32 bits.  Column ``i`` sums global head ``shard.heads[i]``, so
    a peer holding other heads of the same tokens compares the heads it holds."""
    slots = np.asarray(slots, np.int64).reshape(-1)
    heads = cache.layout.size("H")
    out = np.zeros((slots.size, heads), np.uint32)
    have = np.flatnonzero(slots >= 0)
    if have.size:
        v = kv_checksums(cache, slots[have], chunk=1).values
        out[have] = ((v ^ (v >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return out


__all__ = ["head_checksums", "layout_fingerprint", "planes_digest", "tokens_digest"]
