"""What an engine's front tells its cache sides each step, and what a cache side tells the
front once at start: plain data, picklable, so that an engine whose front and cache sides
live in different processes (vLLM's scheduler and workers) carries them in its own
messages, and one whose halves share a process hands them over directly.

Block lists are per KV cache group, in the engine's own block ids, ``-1`` for none.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PullWork:
    """Read a request's prompt KV from a producer (consumer side)."""
    req_id: str
    remote: object                     # its validated RemotePrefill (.params)
    dst_blocks: list                   # ours per group, for positions from 0
    start: int                         # first token position to read
    num_tokens: int


@dataclass
class Fail:
    """A request refused where it entered: the cache side reports it failed, with the
    reason (so that engines whose failures are reported by the cache side see it there)."""
    req_id: str
    reason: str


@dataclass
class GrantIssue:
    """Publish a grant for a finished request's blocks (producer side)."""
    req_id: str
    slot: int
    nonce: bytes
    blocks: list                       # per group, the blocks holding its tokens
    num_tokens: int
    tokens: bytes                      # digest of those tokens


@dataclass
class HostSave:
    """Copy full blocks of a finished request into the host pools under ``keys``."""
    req_id: str
    keys: list
    blocks: list                       # per group, one engine block per key (-1: none)


@dataclass
class HostLoad:
    """Copy host blocks ``keys`` into engine blocks (a prefix hit)."""
    req_id: str
    keys: list
    blocks: list                       # per group, one engine block per key (-1: skip)


@dataclass
class StepWork:
    """One step's work for the cache sides, done in this order: refusals, pulls, grants,
    host loads, host evictions, host saves."""
    fails: list = field(default_factory=list)
    pulls: list = field(default_factory=list)
    grants: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    evicts: list = field(default_factory=list)
    saves: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.fails, self.pulls, self.grants, self.loads, self.evicts, self.saves))


@dataclass
class Served:
    """What one rank's cache side serves, told to the front once at start: the handshake
    messages per KV cache group and part, its grant table's, and the seed of host tier keys
    (what makes this engine's KV bytes differ from another's)."""
    handshakes: list = field(default_factory=list)
    grants: str = ""
    host_seed: bytes = b""


@dataclass
class Results:
    """What a cache side reports at a step: ``sent``, requests whose blocks the engine may
    free now (their grants released or expired, host saves done); ``received``, pulls that
    ended; ``failed``, of those (and refusals), the reason by request id."""
    sent: set = field(default_factory=set)
    received: set = field(default_factory=set)
    failed: dict = field(default_factory=dict)


__all__ = ["Fail", "GrantIssue", "HostLoad", "HostSave", "PullWork", "Results", "Served",
           "StepWork"]
