"""What a prefill engine vouches for and a decode engine checks: a digest of each served
part's layout and registered planes, and a checksum per token of the KV it computed.

Both sides compute the same functions over their own data: the producer over its cache
and handshakes, the consumer over the handshakes it was given and the bytes that arrived
in its own cache (after any relayout).  A token's checksum covers every logical element
(layer, K or V, head, dim) of its KV, as raw bits, independent of either side's layout.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch


def layout_fingerprint(layout) -> bytes:
    """The 16 bytes of the layout's own :meth:`kvabi.Layout.fingerprint` (where every byte
    lives), the fixed-width field a grant record carries."""
    return bytes.fromhex(layout.fingerprint().split(":", 1)[1])


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


def _weights(num_layers: int, words: int) -> np.ndarray:
    """Odd 64-bit multipliers per (layer, K/V, word of a token's row), the same on every
    engine for the same shape: a swapped, shifted or transposed element changes the sum."""
    rng = np.random.default_rng([0x6B76, num_layers, words])
    return rng.integers(0, 2**63, size=(num_layers, 2, words), dtype=np.int64) | 1


_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _raw(view) -> np.ndarray:
    """A numpy array of ``view``'s raw elements (an integer of its width), over the same
    memory with the same strides: numpy gathers and sums on one thread, however busy the
    engine's torch threads are."""
    isz = view.element_size()
    storage = view.untyped_storage()
    buf = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return np.ndarray(tuple(view.shape), _INTS[isz], buffer=buf,
                      offset=view.storage_offset() * isz,
                      strides=tuple(st * isz for st in view.stride()))


def _rows(view, b, n) -> np.ndarray:
    """The tokens' rows of one ``[B, N, H, D]`` view as raw words: int64 where a row's
    bytes allow, else the element's own width."""
    bits = np.ascontiguousarray(_raw(view)[b, n]).reshape(len(b), -1)
    return bits.view(np.int64) if bits.shape[1] * bits.itemsize % 8 == 0 else \
        bits.astype(np.int64)


def token_checksums(layer_views, slots, block_size: int) -> np.ndarray:
    """uint32 [len(slots)]: per token (slot, -1 for none: checksum 0), a weighted sum of
    the raw bits of its keys and values over every layer, head and dim (64-bit words,
    wrapping), folded to 32 bits.  ``layer_views``: per layer the (key, value)
    ``[B, N, H, D]`` views of one group.  numpy does the arithmetic: one thread, however
    busy the engine's torch threads are."""
    slots = np.asarray(slots, np.int64)
    out = np.zeros(len(slots), np.uint32)
    have = np.flatnonzero(slots >= 0)
    if not len(have) or not layer_views:
        return out
    b, n = slots[have] // block_size, slots[have] % block_size
    acc = np.zeros(len(have), np.int64)
    w = None
    with np.errstate(over="ignore"):
        for layer, views in enumerate(layer_views):  # a loop over layers, vectorized
            for kv, view in enumerate(views):
                rows = _rows(view, b, n)
                if w is None:
                    w = _weights(len(layer_views), rows.shape[1])
                acc += rows @ w[layer, kv]
    folded = (acc ^ (acc >> 32)) & 0xFFFFFFFF
    out[have] = folded.astype(np.uint32)
    return out


__all__ = ["layout_fingerprint", "planes_digest", "token_checksums", "tokens_digest"]
