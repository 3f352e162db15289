"""The host tier's index (``specs/pd.md`` section 10, a front's): which full blocks of
which prefixes the host pools hold, with the tokens they hold, bounded, least recently
used first out.

A block's key is a 128-bit chained hash: of the engine's *seed* (the model, its dtype,
the cache dtype, the layout fingerprints of the parts the pools keep: whatever changes the
bytes), the request's ``cache_salt``, the previous block's key and the block's tokens.
A hit is never trusted on the key alone: each entry keeps its parent's key and its own
tokens, and a prefix counts only as far as every block's tokens and parent equal the
request's (so by induction the whole prefix, salt included, is the request's).  Only
requests whose KV this engine computed are saved (not those that pulled from a peer).
"""
from __future__ import annotations

import collections
import hashlib

import attrs
import numpy as np

from .slots import usable_prefix


@attrs.frozen(eq=False)
class HostEntry:
    parent: bytes           # the previous block's key (the seed for the first block)
    tokens: np.ndarray      # int64 [block_size]
    held: tuple             # per group: whether its pool holds the block


def chain_keys(seed: bytes, salt, token_ids, block_size: int) -> tuple[list, list, np.ndarray]:
    """(keys, parents, tokens [blocks, block_size]) of the full blocks of ``token_ids``
    under ``seed`` and ``salt`` (a request's ``cache_salt``, or None)."""
    toks = np.asarray(token_ids, np.int64)
    n = toks.size // block_size
    blocks = np.ascontiguousarray(toks[:n * block_size].reshape(n, block_size), "<i8")
    salt_bytes = b"" if salt is None else str(salt).encode()
    prev = hashlib.blake2b(seed + b"\0" + salt_bytes, digest_size=16).digest()
    keys, parents = [], []
    for row in blocks:  # one hash per block, chained: a loop over blocks
        parents.append(prev)
        prev = hashlib.blake2b(prev + row.tobytes(), digest_size=16).digest()
        keys.append(prev)
    return keys, parents, blocks


class HostIndex:
    """Entries of up to ``capacity`` host blocks per group."""

    def __init__(self, num_groups: int, capacity: int, seed: bytes):
        self.capacity = capacity
        self.seed = seed
        self.used = np.zeros(num_groups, np.int64)
        self._entries: collections.OrderedDict[bytes, HostEntry] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def held(self, key) -> tuple | None:
        e = self._entries.get(key)
        return None if e is None else e.held

    def present(self, keys, parents, blocks) -> np.ndarray:
        """bool [groups, blocks]: block i of the request is held for group g, its entry's
        parent and tokens being the request's."""
        out = np.zeros((len(self.used), len(keys)), bool)
        for i, key in enumerate(keys):  # a loop over the prompt's blocks
            e = self._entries.get(key)
            if e is not None and e.parent == parents[i] and np.array_equal(e.tokens, blocks[i]):
                out[:, i] = e.held
        return out

    def hit(self, keys, parents, blocks, need_back) -> int:
        """Blocks of the prefix restorable (see :func:`~.slots.usable_prefix`); the entries
        used become the most recently used (the first block last: it is evicted last)."""
        if not keys or not self._entries:
            return 0
        k = usable_prefix(self.present(keys, parents, blocks), need_back)
        self.touch(keys[:k])
        return k

    def touch(self, keys) -> None:
        """Make a prefix's entries the most recently used, its first block last: a prefix
        loses its deepest blocks first (a block is of no use without those before it)."""
        for key in reversed(list(keys)):
            if key in self._entries:
                self._entries.move_to_end(key)

    def add(self, key, parent, tokens, held, keep=()) -> list | None:
        """Index a block to save, evicting least recently used entries (not those in
        ``keep``: saves not yet done) until it fits.  Returns the evicted keys, or None
        when it cannot fit (nothing is then changed)."""
        held = tuple(bool(h) for h in held)
        need = np.array(held, np.int64)
        if np.any(need > self.capacity):
            return None
        evict, free = [], self.capacity - self.used
        for old, e in self._entries.items():  # oldest first, until the block fits
            if np.all(need <= free):
                break
            if old in keep:
                continue
            evict.append(old)
            free = free + np.array(e.held, np.int64)
        if not np.all(need <= free):
            return None
        for old in evict:
            self.used -= np.array(self._entries.pop(old).held, np.int64)
        self._entries[key] = HostEntry(parent, np.array(tokens, np.int64), held)
        self.used += need
        return evict


__all__ = ["HostEntry", "HostIndex", "chain_keys"]
