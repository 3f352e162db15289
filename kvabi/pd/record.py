"""Grant records (``specs/pd.md`` section 4.5): what a producer rank publishes in a slot
of its grant table for one grant, and the table's layout.

Record layout (little-endian), format 3 (magic ``KVABIG03``): ``magic (8) | state (1) |
pad (7) | nonce (16) | digest (16, BLAKE2b-128 of the body) | body length (8) | pad (8) |
body``; body: ``num_tokens u64 | tokens digest (16) | groups u32 | rank u16 | ranks u16 |
per group (blocks u32, parts u32, heads u32, pad u32) | block ids i64 | per part (name 32,
layout fingerprint 16, planes digest 16, scales digest 16, model digest 16) | per group
num_tokens x heads u32 checksums``.  A part's claim binds everything a reader interprets
its bytes with, as the producer's own handshake states it (:func:`part_claim`).

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
from .digests import layout_fingerprint, model_digest, planes_digest, scales_digest
from .notify import MAX_RANKS
from .parts import MAX_PARTS, NAME_CHARS

#: the record format (3: parts bind scales and model, the record its producer rank)
MAGIC = b"KVABIG03"
HEADER = 64
LIVE, RELEASED, EXPIRED = 1, 2, 3
STATES = {LIVE: "live", RELEASED: "already read", EXPIRED: "expired"}
#: a part's claim: its name and four 16-byte digests
PART_BYTES = NAME_CHARS + 4 * 16
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
    n = HEADER + 32 + num_groups * (GROUP_BYTES + 8 * blocks + MAX_PARTS * PART_BYTES +
                                    4 * max_tokens * heads)
    return -(-n // 64) * 64


def table_layout(slots: int, slot_bytes: int) -> Layout:
    """A grant table as a kvabi layout: one block of ``slot_bytes`` int8 per slot."""
    return Layout(order=("B", "N", "H", "D"), sizes={"B": slots, "N": 1, "H": 1,
                                                     "D": slot_bytes},
                  dtype="int8", name=TABLE_NAME)


@attrs.frozen
class PartClaim:
    """A part the producer serves for a group: its name and the digests of what a reader
    interprets its bytes with (:func:`part_claim`), each 16 bytes."""

    name: str
    layout: bytes     # the layout's fingerprint: placement, dtype, heads held
    planes: bytes     # agent, memory type, (address, nbytes, device) of each plane
    scales: bytes     # per-layer (k_scale, v_scale) of a per-tensor quantized cache, or none
    model: bytes      # the model identity the handshake states, or none

    #: per digest: the field a mismatch names (after the part's own) and what it says
    FIELDS = (("layout", "", "its layout is not the one the producer registered "
                             "(fingerprint differs)"),
              ("planes", "", "its planes (agent, memory, addresses, sizes) are not the ones "
                             "the producer registered"),
              ("scales", ".kv_scales", "not the scales the producer's cache holds its codes "
                                       "under (the same bytes would be other values)"),
              ("model", ".model", "not the model identity the producer registered"))


def part_claim(name: str, handshake) -> PartClaim:
    """The claim of part ``name`` served by a parsed ``handshake``: the producer makes it
    from its own handshake, a reader from the one it was given (a client may rewrite
    anything in between); equal claims mean the reader interprets the bytes as the producer
    wrote them."""
    return PartClaim(name, layout_fingerprint(handshake.layout), planes_digest(handshake),
                     scales_digest(handshake), model_digest(handshake))


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
    rank: int = 0                      # the producer rank that wrote it
    ranks: int = 1                     # of the producer's tensor-parallel size

    def to_json(self) -> dict:
        """The record as ``specs/pd.record.schema.json`` states it."""
        return {"format": MAGIC.decode(), "state": {LIVE: "live", RELEASED: "released",
                                                    EXPIRED: "expired"}[self.state],
                "nonce": self.nonce.hex(), "num_tokens": self.num_tokens,
                "tokens": self.tokens.hex(), "rank": self.rank, "ranks": self.ranks,
                "groups": [{"blocks": [int(b) for b in blocks],
                            "parts": [{"name": p.name, "layout": p.layout.hex(),
                                       "planes": p.planes.hex(), "scales": p.scales.hex(),
                                       "model": p.model.hex()} for p in parts],
                            "checksums": np.asarray(sums).tolist()}
                           for blocks, parts, sums in zip(self.blocks, self.parts,
                                                          self.checksums)]}


def encode(record: GrantRecord) -> bytes:
    """The bytes of ``record`` (header included)."""
    g = len(record.blocks)
    body = [struct.pack("<Q16sIHH", record.num_tokens, record.tokens, g, record.rank,
                        record.ranks)]
    body += [struct.pack("<III4x", len(b), len(p), np.shape(c)[1])
             for b, p, c in zip(record.blocks, record.parts, record.checksums)]
    body += [np.ascontiguousarray(b, "<i8").tobytes() for b in record.blocks]
    for parts in record.parts:
        for p in parts:
            name = p.name.encode()[:NAME_CHARS].ljust(NAME_CHARS, b"\0")
            body.append(name + p.layout + p.planes + p.scales + p.model)
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
        old = len(raw) >= 8 and bytes(raw[:7]) == MAGIC[:7]
        raise KVABIError("kvabi_grant: the producer's slot holds no grant record" + (
            f" of format {MAGIC[7:].decode()} (it holds format {bytes(raw[7:8]).decode()!r}: "
            "the two engines speak other P/D versions)" if old else ""))
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
    num_tokens, tokens, g, rank, ranks = struct.unpack_from("<Q16sIHH", data, 0)
    if g > MAX_GROUPS or num_tokens > MAX_TOKENS:
        raise ValueError(f"{g} groups, {num_tokens} tokens")
    if not 0 <= rank < ranks <= MAX_RANKS:
        raise ValueError(f"rank {rank} of {ranks}")
    at = 32
    counts = [struct.unpack_from("<III4x", data, at + GROUP_BYTES * i) for i in range(g)]
    at += GROUP_BYTES * g
    if any(p > MAX_PARTS for _, p, _ in counts):
        raise ValueError("too many parts")
    if any(not 1 <= h <= MAX_HEADS for _, _, h in counts):
        raise ValueError(f"heads outside 1..{MAX_HEADS}")
    nb, np_ = sum(b for b, _, _ in counts), sum(p for _, p, _ in counts)
    need = at + 8 * nb + PART_BYTES * np_ + 4 * num_tokens * sum(h for _, _, h in counts)
    if need != len(data):
        raise ValueError(f"the counts need {need} body bytes, the body has {len(data)}")
    ids = np.frombuffer(data, "<i8", nb, at).astype(np.int64)
    at += 8 * nb
    blocks, parts, k = [], [], 0
    for b, p, _ in counts:
        blocks.append(ids[k:k + b])
        k += b
        row = []
        for _ in range(p):
            name = data[at:at + NAME_CHARS].rstrip(b"\0").decode()
            row.append(PartClaim(name, *(data[at + i:at + i + 16]
                                         for i in range(NAME_CHARS, PART_BYTES, 16))))
            at += PART_BYTES
        parts.append(tuple(row))
    sums = []
    for _, _, h in counts:
        sums.append(np.frombuffer(data, "<u4", num_tokens * h, at).astype(np.uint32)
                    .reshape(num_tokens, h))
        at += 4 * num_tokens * h
    return GrantRecord(state, nonce, int(num_tokens), tokens, tuple(blocks), tuple(parts),
                       tuple(sums), int(rank), int(ranks))


__all__ = ["EXPIRED", "GrantRecord", "HEADER", "LIVE", "MAGIC", "MAX_SLOT_BYTES",
           "PartClaim", "RELEASED", "STATES", "TABLE_NAME", "decode", "encode", "part_claim",
           "read_header", "record_bytes", "table_layout"]
