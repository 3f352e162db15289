"""Grant records (``specs/pd.md`` section 4.5): what a producer rank publishes in a slot
of its grant table for one grant, and the table's layout.

Record layout (little-endian): ``magic (8) | state (1) | pad (7) | nonce (16) | digest
(16, BLAKE2b-128 of the body) | body length (8) | pad (8) | body``; body: ``num_tokens u64 |
tokens digest (16) | groups u32 | pad u32 | per group (blocks u32, parts u32, heads u32,
pad u32) | block ids i64 | per part (name 32, layout fingerprint 16, planes digest 16) |
per part handshake digest 16 | per group num_tokens x heads u32 checksums``.

:func:`decode` reads bytes a peer served: every count is checked against the bytes there
before anything is allocated.
"""
from __future__ import annotations

import hashlib
import struct

import attrs
import numpy as np

from ..util.errors import KVABIError
from ..layout.descriptor import Layout
from .parts import MAX_PARTS, NAME_CHARS

MAGIC = b"KVABIG02"
HEADER = 64
LIVE, RELEASED, EXPIRED = 1, 2, 3
STATES = {LIVE: "live", RELEASED: "already read", EXPIRED: "expired"}
PART_BYTES = NAME_CHARS + 32  # name, layout fingerprint, planes digest
#: most KV cache groups and KV heads per rank a record may state; most tokens
MAX_GROUPS, MAX_HEADS, MAX_TOKENS = 64, 1024, 2**24
GROUP_BYTES = 16
TABLE_NAME = "kvabi.grants"
#: largest table slot a consumer reads (bytes)
MAX_SLOT_BYTES = 64 * 2**20


def record_bytes(num_groups: int, max_tokens: int, block_size: int, heads: int = 1) -> int:
    """Bytes of one table slot: a record for ``max_tokens`` tokens (blocks of
    ``block_size``) of ``heads`` KV heads in ``num_groups`` groups, rounded up to 64."""
    blocks = -(-max_tokens // block_size) + 1
    n = HEADER + 32 + num_groups * (GROUP_BYTES + 8 * blocks + MAX_PARTS * (PART_BYTES + 16) +
                                    4 * max_tokens * heads)
    return -(-n // 64) * 64


def table_layout(slots: int, slot_bytes: int) -> Layout:
    """A grant table as a kvabi layout: one block of ``slot_bytes`` int8 per slot."""
    return Layout(order=("B", "N", "H", "D"), sizes={"B": slots, "N": 1, "H": 1,
                                                     "D": slot_bytes},
                  dtype="int8", name=TABLE_NAME)


@attrs.frozen
class PartClaim:
    """A part the producer serves for a group: its name, the fingerprint of its layout, the
    digest of its registered planes and of its whole handshake message."""

    name: str
    layout: bytes
    planes: bytes
    handshake: bytes = bytes(16)


@attrs.frozen(eq=False)
class GrantRecord:
    """A decoded grant record."""

    state: int
    nonce: bytes
    num_tokens: int
    tokens: bytes                      # digest of the tokens whose KV the blocks hold
    blocks: tuple                      # per group: int64 block ids (-1: null)
    parts: tuple                       # per group: tuple of PartClaim
    checksums: tuple                   # per group: uint32 [num_tokens, heads]

    def to_json(self) -> dict:
        """The record as ``specs/pd.record.schema.json`` states it."""
        return {"format": MAGIC.decode(), "state": {LIVE: "live", RELEASED: "released",
                                                    EXPIRED: "expired"}[self.state],
                "nonce": self.nonce.hex(), "num_tokens": self.num_tokens,
                "tokens": self.tokens.hex(),
                "groups": [{"blocks": [int(b) for b in blocks],
                            "parts": [{"name": p.name, "layout": p.layout.hex(),
                                       "planes": p.planes.hex(),
                                       "handshake": p.handshake.hex()} for p in parts],
                            "checksums": np.asarray(sums).tolist()}
                           for blocks, parts, sums in zip(self.blocks, self.parts,
                                                          self.checksums)]}


def encode(record: GrantRecord) -> bytes:
    """The bytes of ``record`` (header included)."""
    g = len(record.blocks)
    body = [struct.pack("<Q16sII", record.num_tokens, record.tokens, g, 0)]
    body += [struct.pack("<III4x", len(b), len(p), np.shape(c)[1])
             for b, p, c in zip(record.blocks, record.parts, record.checksums)]
    body += [np.ascontiguousarray(b, "<i8").tobytes() for b in record.blocks]
    for parts in record.parts:
        for p in parts:
            name = p.name.encode()[:NAME_CHARS].ljust(NAME_CHARS, b"\0")
            body.append(name + p.layout + p.planes)
    body += [p.handshake for parts in record.parts for p in parts]
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
        return _body(state, nonce, data)
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise KVABIError(f"kvabi_grant: malformed record ({e})") from None


def _body(state: int, nonce: bytes, data: bytes) -> GrantRecord:
    num_tokens, tokens, g, _ = struct.unpack_from("<Q16sII", data, 0)
    if g > MAX_GROUPS or num_tokens > MAX_TOKENS:
        raise ValueError(f"{g} groups, {num_tokens} tokens")
    at = 32
    counts = [struct.unpack_from("<III4x", data, at + GROUP_BYTES * i) for i in range(g)]
    at += GROUP_BYTES * g
    if any(p > MAX_PARTS for _, p, _ in counts):
        raise ValueError("too many parts")
    if any(not 1 <= h <= MAX_HEADS for _, _, h in counts):
        raise ValueError(f"heads outside 1..{MAX_HEADS}")
    nb, np_ = sum(b for b, _, _ in counts), sum(p for _, p, _ in counts)
    need = at + 8 * nb + (PART_BYTES + 16) * np_ + \
        4 * num_tokens * sum(h for _, _, h in counts)
    if need != len(data):
        raise ValueError(f"the counts need {need} body bytes, the body has {len(data)}")
    ids = np.frombuffer(data, "<i8", nb, at).astype(np.int64)
    at += 8 * nb
    digests = at + PART_BYTES * np_
    blocks, parts, k = [], [], 0
    for b, p, _ in counts:
        blocks.append(ids[k:k + b])
        k += b
        row = []
        for _ in range(p):
            name = data[at:at + NAME_CHARS].rstrip(b"\0").decode()
            row.append(PartClaim(name, data[at + NAME_CHARS:at + NAME_CHARS + 16],
                                 data[at + NAME_CHARS + 16:at + PART_BYTES],
                                 data[digests:digests + 16]))
            at += PART_BYTES
            digests += 16
        parts.append(tuple(row))
    at = digests
    sums = []
    for _, _, h in counts:
        sums.append(np.frombuffer(data, "<u4", num_tokens * h, at).astype(np.uint32)
                    .reshape(num_tokens, h))
        at += 4 * num_tokens * h
    return GrantRecord(state, nonce, int(num_tokens), tokens, tuple(blocks), tuple(parts),
                       tuple(sums))


__all__ = ["EXPIRED", "GrantRecord", "HEADER", "LIVE", "MAGIC", "MAX_SLOT_BYTES",
           "PartClaim", "RELEASED", "STATES", "TABLE_NAME", "decode", "encode",
           "read_header", "record_bytes", "table_layout"]
