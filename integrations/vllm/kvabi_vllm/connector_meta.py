"""What KvabiConnector's scheduler side tells its worker side each step, and the pure
arithmetic both sides share (token slots of a block list, the restorable prefix).

The arithmetic is plain numpy, testable without an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvabi import KVABIError
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata)

#: vLLM's null block (``BlockPool`` block 0): a placeholder in a group's block list for a
#: block the request does not hold (sliding-window blocks out of the window)
NULL_BLOCK = 0


def token_slots(blocks, block_size: int, start: int, num_tokens: int) -> np.ndarray:
    """Slots of positions ``start .. start + num_tokens - 1`` of a request whose block list
    is ``blocks`` (slot = block * block_size + position % block_size); -1 where the block is
    the null block or beyond the list."""
    blocks = np.asarray(blocks, np.int64).reshape(-1)
    pos = np.arange(start, start + num_tokens, dtype=np.int64)
    idx = pos // block_size
    inside = idx < blocks.size
    b = np.where(inside, blocks[np.minimum(idx, max(blocks.size - 1, 0))] if blocks.size
                 else NULL_BLOCK, NULL_BLOCK)
    return np.where(b == NULL_BLOCK, -1, b * block_size + pos % block_size)


def paired_slots(src_blocks, src_bs: int, dst_blocks, dst_bs: int, start: int,
                 num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination slots of the tokens both sides hold (a token whose block is
    null on either side is left out: out of a sliding window, never read)."""
    s = token_slots(src_blocks, src_bs, start, num_tokens)
    d = token_slots(dst_blocks, dst_bs, start, num_tokens)
    keep = (s >= 0) & (d >= 0)
    return s[keep], d[keep]


def usable_prefix(present: np.ndarray, needed_back: np.ndarray) -> int:
    """The longest prefix of blocks ``k`` that can be restored: ``present[g, i]`` says block
    ``i`` of group ``g`` is held, and group ``g`` needs its last ``needed_back[g]`` blocks
    before ``k`` (all ``k`` blocks for full attention: pass ``k`` or more)."""
    present = np.asarray(present, bool)
    if present.ndim != 2:
        raise KVABIError(f"present: must be [groups, blocks], got shape {present.shape}")
    g, n = present.shape
    if n == 0:
        return 0
    # missing[g, k] = blocks missing among the first k of group g (cumulative)
    missing = np.concatenate([np.zeros((g, 1), np.int64),
                              np.cumsum(~present, axis=1)], axis=1)
    k = np.arange(n + 1)
    lo = np.maximum(k[None, :] - np.asarray(needed_back, np.int64)[:, None], 0)
    ok = (missing[:, k] - missing[np.arange(g)[:, None], lo] == 0).all(axis=0)
    ok[0] = True
    return int(np.flatnonzero(ok).max())


@dataclass
class PullWork:
    """Read a request's prompt KV from a peer engine (P/D decode side)."""
    req_id: str
    remote: object                     # its validated RemotePrefill (connector_params)
    dst_blocks: list[list[int]]        # ours per group
    start: int                         # first token position to read
    num_tokens: int


@dataclass
class Fail:
    """A request refused where it entered: the worker reports it failed (vLLM's path for
    a failed KV load), with the reason."""
    req_id: str
    reason: str


@dataclass
class GrantIssue:
    """Publish a grant for a finished request's blocks (P/D prefill side)."""
    req_id: str
    slot: int
    nonce: bytes
    blocks: list[list[int]]            # per group, the blocks holding its tokens
    num_tokens: int
    tokens: bytes                      # digest of those tokens


@dataclass
class HostSave:
    """Copy full blocks of a finished request into the host pool under ``keys``."""
    req_id: str
    keys: list[bytes]
    blocks: list[list[int]]            # per group, one device block per key (NULL: none)


@dataclass
class HostLoad:
    """Copy host blocks ``keys`` into device blocks (a prefix hit)."""
    req_id: str
    keys: list[bytes]
    blocks: list[list[int]]            # per group, one device block per key (NULL: skip)


@dataclass
class KvabiConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side, in this order: refusals, pulls, grants, host
    loads, host evictions, host saves."""
    fails: list[Fail] = field(default_factory=list)
    pulls: list[PullWork] = field(default_factory=list)
    grants: list[GrantIssue] = field(default_factory=list)
    loads: list[HostLoad] = field(default_factory=list)
    evicts: list[bytes] = field(default_factory=list)
    saves: list[HostSave] = field(default_factory=list)
    #: the step computes no token: the engine steps only for what the connector holds
    #: (grants, pulls), and the worker may wait for it (``connector_worker.IDLE_WAIT_S``)
    idle: bool = False

    def has_work(self) -> bool:
        """Whether the worker side has anything to do for this step's metadata."""
        return bool(self.fails or self.pulls or self.grants or self.loads or self.evicts
                    or self.saves)


@dataclass
class KvabiHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What the worker side tells the scheduler side once, at start: the handshake
    messages (JSON) it serves per KV cache group and part, its grant table's, and the seed
    of host tier keys (what makes this engine's KV bytes differ from another's)."""
    handshakes: list[dict[str, str]] = field(default_factory=list)
    grants: str = ""
    host_seed: bytes = b""
