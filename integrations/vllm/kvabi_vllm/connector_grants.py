"""Grants: what a prefill engine remembers about the blocks it holds for a decode engine,
published where only a reader that knows the grant's secret can use it.

When a request with ``do_remote_decode`` finishes, the producer's scheduler side issues a
grant: a slot of its *grant table* and a random 16-byte nonce, returned (with the slot) in
the request's ``kv_transfer_params``.  Its worker side writes the grant's record into that
slot of the table, a small memory it registers with NIXL and serves like a cache:

- the nonce and a state (live, released, expired);
- what the KV is: the number of tokens, a digest of those tokens (the prompt), the block
  ids per KV cache group, and per group and part the fingerprint of the part's layout and
  a digest of its registered planes;
- a checksum per token and group of the KV itself (:mod:`.connector_checksum`).

The decode side reads the record before any KV and compares it with the parameters and
the handshakes it was given and with its own prompt, and after the READs compares the
checksums with the bytes that arrived; its notification names the slot and the nonce.
The producer frees a request's blocks only for a notification naming a live grant's slot
and nonce, once; a grant no decode engine reads expires (``hold_timeout_s``).  Another
request's ids, a replayed grant and a forged notification are all refused: they do not
know a live nonce, or name another request's tokens.

Record layout (little-endian): ``magic (8) | state (1) | pad (7) | nonce (16) | digest
(16, blake2b of the body) | body length (8) | body``; body: ``num_tokens u64 | tokens
digest (16) | groups u32 | pad u32 | per group (blocks u32, parts u32) | block ids i64 |
per part (name 32, layout fingerprint 16, planes digest 16) | per group num_tokens x u32
checksums``.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct
import time

import attrs
import numpy as np

from kvabi import KVABIError, KVCache, Layout

from .connector_meta import NOTIFY_PREFIX

MAGIC = b"KVABIG01"
HEADER = 64
LIVE, RELEASED, EXPIRED = 1, 2, 3
STATES = {LIVE: "live", RELEASED: "already read", EXPIRED: "expired"}
PART_BYTES = 64
NAME_BYTES = 32
#: most KV cache groups and parts per group a record may state
MAX_GROUPS, MAX_PARTS = 64, 8
TABLE_NAME = "kvabi.grants"


def record_bytes(num_groups: int, max_tokens: int, block_size: int) -> int:
    """Bytes of one table slot: a record for ``max_tokens`` tokens (blocks of
    ``block_size``) in ``num_groups`` groups, rounded up to 64."""
    blocks = -(-max_tokens // block_size) + 1
    n = HEADER + 32 + num_groups * (8 + 8 * blocks + MAX_PARTS * PART_BYTES + 4 * max_tokens)
    return -(-n // 64) * 64


def table_layout(slots: int, slot_bytes: int) -> Layout:
    """A grant table as a kvabi layout: one block of ``slot_bytes`` int8 per slot."""
    return Layout(order=("B", "N", "H", "D"), sizes={"B": slots, "N": 1, "H": 1,
                                                     "D": slot_bytes},
                  dtype="int8", name=TABLE_NAME)


@attrs.frozen
class PartClaim:
    """A part the producer serves for a group: its name, layout fingerprint, planes digest."""

    name: str
    layout: bytes
    planes: bytes


@attrs.frozen(eq=False)
class GrantRecord:
    """A decoded grant record."""

    state: int
    nonce: bytes
    num_tokens: int
    tokens: bytes                      # digest of the tokens whose KV the blocks hold
    blocks: tuple                      # per group: int64 block ids
    parts: tuple                       # per group: tuple of PartClaim
    checksums: tuple                   # per group: uint32 [num_tokens]


def encode(record: GrantRecord) -> bytes:
    """The bytes of ``record`` (header included)."""
    g = len(record.blocks)
    body = [struct.pack("<Q16sII", record.num_tokens, record.tokens, g, 0)]
    body += [struct.pack("<II", len(b), len(p)) for b, p in zip(record.blocks, record.parts)]
    body += [np.ascontiguousarray(b, "<i8").tobytes() for b in record.blocks]
    for parts in record.parts:
        for p in parts:
            name = p.name.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
            body.append(name + p.layout + p.planes)
    body += [np.ascontiguousarray(c, "<u4").tobytes() for c in record.checksums]
    data = b"".join(body)
    head = MAGIC + struct.pack("<B7x", record.state) + record.nonce + \
        hashlib.blake2b(data, digest_size=16).digest() + struct.pack("<Q", len(data))
    return head.ljust(HEADER, b"\0") + data


def read_header(buf) -> tuple[int, bytes] | None:
    """(state, nonce) of a slot's bytes, or None where no record was ever written."""
    raw = bytes(buf[:HEADER])
    if raw[:8] != MAGIC:
        return None
    return raw[8], raw[16:32]


def decode(buf) -> GrantRecord:
    """A record from a slot's bytes (read from a peer: untrusted; every count is checked
    against the bytes there); KVABIError naming ``kvabi_grant`` otherwise."""
    raw = memoryview(np.ascontiguousarray(buf, np.uint8)).cast("B")
    if len(raw) < HEADER or bytes(raw[:8]) != MAGIC:
        raise KVABIError("kvabi_grant: the producer's slot holds no grant record")
    state, nonce, digest = raw[8], bytes(raw[16:32]), bytes(raw[32:48])
    (n,) = struct.unpack_from("<Q", raw, 48)
    if n > len(raw) - HEADER:
        raise KVABIError(f"kvabi_grant: the record states {n} body bytes, its slot holds "
                         f"{len(raw) - HEADER}")
    data = bytes(raw[HEADER:HEADER + n])
    if hashlib.blake2b(data, digest_size=16).digest() != digest:
        raise KVABIError("kvabi_grant: the record's digest does not match its body "
                         "(read while being written, or corrupted)")
    try:
        num_tokens, tokens, g, _ = struct.unpack_from("<Q16sII", data, 0)
        if g > MAX_GROUPS or num_tokens > 2**24:
            raise ValueError(f"{g} groups, {num_tokens} tokens")
        at = 32
        counts = [struct.unpack_from("<II", data, at + 8 * i) for i in range(g)]
        at += 8 * g
        if any(p > MAX_PARTS for _, p in counts):
            raise ValueError("too many parts")
        nb = sum(b for b, _ in counts)
        need = at + 8 * nb + PART_BYTES * sum(p for _, p in counts) + 4 * g * num_tokens
        if need != len(data):
            raise ValueError(f"the counts need {need} body bytes, the body has {len(data)}")
        ids = np.frombuffer(data, "<i8", nb, at).astype(np.int64)
        at += 8 * nb
        blocks, parts, k = [], [], 0
        for b, p in counts:
            blocks.append(ids[k:k + b])
            k += b
            row = []
            for _ in range(p):
                name = data[at:at + NAME_BYTES].rstrip(b"\0").decode()
                row.append(PartClaim(name, data[at + 32:at + 48], data[at + 48:at + 64]))
                at += PART_BYTES
            parts.append(tuple(row))
        sums = np.frombuffer(data, "<u4", g * num_tokens, at).astype(np.uint32)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise KVABIError(f"kvabi_grant: malformed record ({e})") from None
    return GrantRecord(state, nonce, int(num_tokens), tokens, tuple(blocks), tuple(parts),
                       tuple(sums.reshape(g, num_tokens)))


def notify_message(slot: int, nonce: bytes) -> bytes:
    """The notification that tells a producer its grant ``slot`` was read."""
    return f"{NOTIFY_PREFIX}{slot}:{nonce.hex()}".encode()


def parse_notification(msg: bytes) -> tuple[int, bytes] | None:
    """(slot, nonce) of a notification, or None when it is not one (any bytes: from a peer)."""
    try:
        text = msg.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text.startswith(NOTIFY_PREFIX):
        return None
    slot, _, nonce = text[len(NOTIFY_PREFIX):].partition(":")
    if not slot.isdigit() or len(slot) > 9 or len(nonce) != 32:
        return None
    try:
        return int(slot), bytes.fromhex(nonce)
    except ValueError:
        return None


class GrantBook:
    """The producer scheduler side's grants: at most ``slots`` live, one per request."""

    def __init__(self, slots: int):
        self._free = collections.deque(range(slots))
        self._live: dict[str, int] = {}

    def issue(self, req_id: str) -> tuple[int, bytes] | None:
        """(slot, nonce) for ``req_id``, or None when every slot is held."""
        if not self._free or req_id in self._live:
            return None
        slot = self._free.popleft()
        self._live[req_id] = slot
        return slot, secrets.token_bytes(16)

    def release(self, req_id: str) -> None:
        slot = self._live.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def __len__(self) -> int:
        return len(self._live)


class GrantTable:
    """The producer worker side's registered table of grant records."""

    def __init__(self, slots: int, slot_bytes: int):
        self.layout = table_layout(slots, slot_bytes)
        self.cache = KVCache.allocate(self.layout, "numpy")
        self._rows = self.cache[0].reshape(slots, slot_bytes).view(np.uint8)
        #: slot -> (request id, nonce, deadline)
        self.live: dict[int, tuple[str, bytes, float]] = {}

    def write(self, slot: int, record: GrantRecord, req_id: str, deadline: float) -> None:
        data = encode(record)
        row = self._rows[slot]
        if len(data) > row.size:
            raise KVABIError(f"kvabi_grant: a record of {len(data)} bytes exceeds the "
                             f"table's {row.size}-byte slots")
        row[:HEADER] = 0  # no record while the body changes
        row[HEADER:len(data)] = np.frombuffer(data[HEADER:], np.uint8)
        row[:HEADER] = np.frombuffer(data[:HEADER], np.uint8)
        self.live[slot] = (req_id, record.nonce, deadline)

    def _close(self, slot: int, state: int) -> str:
        req_id, _, _ = self.live.pop(slot)
        self._rows[slot, 8] = state  # the nonce stays: a replay learns it was read
        return req_id

    def release(self, slot: int, nonce: bytes) -> str | None:
        """The request whose live grant ``slot`` holds ``nonce`` (then released), or None."""
        held = self.live.get(slot)
        if held is None or not hmac.compare_digest(held[1], nonce):
            return None
        return self._close(slot, RELEASED)

    def expire(self, now: float | None = None) -> list[str]:
        """Requests whose grants passed their deadline (then expired)."""
        now = time.monotonic() if now is None else now
        return [self._close(s, EXPIRED) for s, (_, _, d) in list(self.live.items()) if d <= now]


__all__ = ["GrantBook", "GrantRecord", "GrantTable", "PartClaim", "decode", "encode",
           "notify_message", "parse_notification", "read_header", "record_bytes",
           "table_layout"]
