"""What a prefill engine vouches for and a decode engine checks: a digest of each served
part's layout and registered planes, and a checksum per token of the KV it computed.

Both sides compute the same functions over their own data: the producer over its cache
and handshakes, the consumer over the handshakes it was given and the bytes that arrived
in its own cache (after any relayout).  A token's checksum covers every logical element
(layer, K or V, head, dim) of its KV, as raw bits, independent of either side's layout.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

#: torch integer dtype of each item size: checksums read the elements' raw bits
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def layout_fingerprint(layout) -> bytes:
    """16 bytes identifying a layout descriptor (blake2b of its canonical JSON).  Kept in
    this one function so a ``Layout.fingerprint()`` of the core can replace it."""
    text = json.dumps(layout.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def planes_digest(handshake) -> bytes:
    """16 bytes identifying the agent and the (address, nbytes, device) of each plane a
    parsed handshake lists."""
    h = hashlib.blake2b(digest_size=16)
    h.update(handshake.agent_name.encode())
    h.update(np.ascontiguousarray(handshake.planes, np.int64).tobytes())
    return h.digest()


def tokens_digest(token_ids) -> bytes:
    """16 bytes identifying a token sequence (the prompt a grant was issued for)."""
    toks = np.ascontiguousarray(np.asarray(token_ids, np.int64))
    return hashlib.blake2b(toks.tobytes(), digest_size=16).digest()


def _weights(num_layers: int, heads: int, dim: int) -> torch.Tensor:
    """Odd 32-bit multipliers per (layer, K/V, head, dim), the same on every engine for the
    same shape: a swapped, shifted or transposed element changes the sum."""
    rng = np.random.default_rng([0x6B76, num_layers, heads, dim])
    w = rng.integers(1, 2**31, size=(num_layers, 2, heads, dim), dtype=np.int64) | 1
    return torch.from_numpy(w)


def token_checksums(layer_views, slots, block_size: int) -> np.ndarray:
    """uint32 [len(slots)]: per token (slot, -1 for none: checksum 0), the weighted sum of
    the raw bits of its keys and values over every layer, head and dim, modulo 2**32.
    ``layer_views``: per layer the (key, value) ``[B, N, H, D]`` views of one group."""
    slots = np.asarray(slots, np.int64)
    out = torch.zeros(len(slots), dtype=torch.int64)
    have = np.flatnonzero(slots >= 0)
    if not len(have) or not layer_views:
        return out.numpy().astype(np.uint32)
    s = torch.from_numpy(slots[have])
    b, n = s // block_size, s % block_size
    k0 = layer_views[0][0]
    w = _weights(len(layer_views), k0.shape[2], k0.shape[3])
    acc = torch.zeros(len(have), dtype=torch.int64)
    for layer, views in enumerate(layer_views):  # a loop over layers, vectorized over tokens
        for kv, view in enumerate(views):
            x = view[b, n].contiguous()  # [T, H, D]
            bits = x.view(_BITS[x.element_size()]).to(torch.int64)
            acc += (bits * w[layer, kv]).sum(dim=(1, 2))  # int64 wraps: fine modulo 2**32
    out[torch.from_numpy(have)] = acc & 0xFFFFFFFF
    return out.numpy().astype(np.uint32)


__all__ = ["layout_fingerprint", "planes_digest", "token_checksums", "tokens_digest"]
