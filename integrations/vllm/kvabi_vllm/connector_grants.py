"""Grants: what a prefill engine remembers about the blocks it holds for a decode engine,
published where only a reader that knows the grant's secret can use it.

When a request with ``do_remote_decode`` finishes, the producer's scheduler side issues a
grant: a slot of its *grant table* and a random 16-byte nonce, returned (with the slot) in
the request's ``kv_transfer_params``.  Its worker side writes the grant's record into that
slot of the table, a small memory it registers with NIXL and serves like a cache:

- the nonce and a state (live, released, expired);
- which producer rank wrote it, of how many (tensor parallelism);
- what the KV is: the number of tokens, a digest of those tokens (the prompt), the block
  ids per KV cache group, and per group and part everything a reader needs to interpret
  the part's bytes, as the producer stated it in its own handshake: the fingerprint of
  the layout (placement, dtype, heads held), a digest of the registered planes (agent,
  memory type, addresses, sizes, devices), a digest of the per-layer scales of a
  quantized cache, and a digest of the model identity (:func:`part_claim`);
- a checksum per token, KV head and group of the KV itself (:mod:`.connector_checksum`).

Under tensor parallelism the scheduler issues one slot and nonce per request, and each
rank's worker writes its own record (its layouts, planes and heads) at that slot of its own
table.  The decode side reads the record of every producer rank before any KV and
compares it with the parameters, with the handshakes of the ranks it reads from and with
its own prompt, and after the READs compares the checksums of the global heads it holds with the
bytes that arrived; its notification names the slot, the nonce, and which of how many
decode ranks it is.  A producer rank frees a request's blocks once every decode rank has
notified it with the live grant's slot and nonce (or the grant expired:
``hold_timeout_s``).  Another request's ids, a replayed grant and a forged notification
are all refused: they do not know a live nonce, or name another request's tokens.

Record layout (little-endian), format 3 (magic ``KVABIG03``; format 2 bound neither the
scales, the model nor the rank, and a reader of format 3 refuses it): ``magic (8) | state
(1) | pad (7) | nonce (16) | digest (16, blake2b of the body) | body length (8) | body``;
body: ``num_tokens u64 | tokens digest (16) | groups u32 | rank u16 | ranks u16 | per
group (blocks u32, parts u32, heads u32, pad u32) | block ids i64 | per part (name 32,
layout fingerprint 16, planes digest 16, scales digest 16, model digest 16) | per group
num_tokens x heads u32 checksums``.
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

from .connector_checksum import layout_fingerprint, planes_digest

#: notifications a decode engine sends the prefill engine once it has read a request's KV
#: (here, not with the engine's metadata: the proxy sends them too, without importing vLLM)
NOTIFY_PREFIX = "kvabi.pull:"

#: the record format (3: parts bind scales and model, the record its producer rank)
MAGIC = b"KVABIG03"
HEADER = 64
LIVE, RELEASED, EXPIRED = 1, 2, 3
STATES = {LIVE: "live", RELEASED: "already read", EXPIRED: "expired"}
NAME_BYTES = 32
#: a part's claim: its name and four 16-byte digests
PART_BYTES = NAME_BYTES + 4 * 16
#: most KV cache groups, parts per group and KV heads per rank a record may state
MAX_GROUPS, MAX_PARTS, MAX_HEADS = 64, 8, 1024
#: most tensor-parallel ranks on either side of a pull
MAX_RANKS = 64
GROUP_BYTES = 16
TABLE_NAME = "kvabi.grants"


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

    #: per digest: the field of the handshake a mismatch names (after the part's own
    #: field) and what it says
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
    anything in between); equal claims mean the reader interprets the bytes as the
    producer wrote them."""
    scales = b"none" if handshake.kv_scales is None else \
        np.asarray(handshake.kv_scales, "<f8").tobytes()
    model = b"none" if handshake.model is None else b"model:" + handshake.model.encode()
    return PartClaim(name, layout_fingerprint(handshake.layout), planes_digest(handshake),
                     _digest(scales), _digest(model))


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@attrs.frozen(eq=False)
class GrantRecord:
    """A decoded grant record."""

    state: int
    nonce: bytes
    num_tokens: int
    tokens: bytes                      # digest of the tokens whose KV the blocks hold
    blocks: tuple                      # per group: int64 block ids
    parts: tuple                       # per group: tuple of PartClaim
    checksums: tuple                   # per group: uint32 [num_tokens, heads]
    rank: int = 0                      # the producer rank that wrote it
    ranks: int = 1                     # of the producer's tensor-parallel size


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
            name = p.name.encode()[:NAME_BYTES].ljust(NAME_BYTES, b"\0")
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
            "start both engines with the same kvabi-vllm)" if old else ""))
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
        num_tokens, tokens, g, rank, ranks = struct.unpack_from("<Q16sIHH", data, 0)
        if g > MAX_GROUPS or num_tokens > 2**24:
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
        nb = sum(b for b, _, _ in counts)
        need = at + 8 * nb + PART_BYTES * sum(p for _, p, _ in counts) + \
            4 * num_tokens * sum(h for _, _, h in counts)
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
                name = data[at:at + NAME_BYTES].rstrip(b"\0").decode()
                row.append(PartClaim(name, *(data[at + i:at + i + 16]
                                             for i in range(NAME_BYTES, PART_BYTES, 16))))
                at += PART_BYTES
            parts.append(tuple(row))
        sums = []
        for _, _, h in counts:
            sums.append(np.frombuffer(data, "<u4", num_tokens * h, at).astype(np.uint32)
                        .reshape(num_tokens, h))
            at += 4 * num_tokens * h
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise KVABIError(f"kvabi_grant: malformed record ({e})") from None
    return GrantRecord(state, nonce, int(num_tokens), tokens, tuple(blocks), tuple(parts),
                       tuple(sums), int(rank), int(ranks))


def notify_message(slot: int, nonce: bytes, rank: int = 0, size: int = 1) -> bytes:
    """The notification that tells a producer rank that decode rank ``rank`` of ``size`` is
    done with grant ``slot`` (it read the KV, or gave up)."""
    return f"{NOTIFY_PREFIX}{slot}:{nonce.hex()}:{rank}/{size}".encode()


def parse_notification(msg: bytes) -> tuple[int, bytes, int, int] | None:
    """(slot, nonce, decode rank, decode TP size) of a notification, or None when it is not
    one (any bytes: from a peer; the size at most :data:`MAX_RANKS`)."""
    try:
        text = msg.decode("ascii")
    except UnicodeDecodeError:
        return None
    if not text.startswith(NOTIFY_PREFIX):
        return None
    fields = text[len(NOTIFY_PREFIX):].split(":")
    if len(fields) != 3:
        return None
    slot, nonce, ranks = fields
    rank, _, size = ranks.partition("/")
    if not all(x.isdigit() and len(x) <= 9 for x in (slot, rank, size)) or len(nonce) != 32:
        return None
    rank, size = int(rank), int(size)
    if not 0 <= rank < size <= MAX_RANKS:
        return None
    try:
        return int(slot), bytes.fromhex(nonce), rank, size
    except ValueError:
        return None


#: :meth:`GrantTable.release`: the notification counted, other decode ranks still read
PENDING = "pending"


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
        #: slot -> (decode TP size, the decode ranks that are done) of live grants
        self._done: dict[int, tuple[int, set]] = {}

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
        self._done.pop(slot, None)

    def _close(self, slot: int, state: int) -> str:
        req_id, _, _ = self.live.pop(slot)
        self._done.pop(slot, None)
        self._rows[slot, 8] = state  # the nonce stays: a replay learns it was read
        return req_id

    def release(self, slot: int, nonce: bytes, rank: int = 0, size: int = 1) -> str | None:
        """Decode rank ``rank`` of ``size`` is done with the live grant ``slot`` holding
        ``nonce``: the request (then released) once every one of the ``size`` ranks is,
        :data:`PENDING` before that; None for no live grant of this slot and nonce, or a
        size other than the first notification's."""
        held = self.live.get(slot)
        if held is None or not hmac.compare_digest(held[1], nonce):
            return None
        want, done = self._done.setdefault(slot, (size, set()))
        if size != want:
            return None
        done.add(rank)
        if len(done) < want:
            return PENDING
        return self._close(slot, RELEASED)

    def closed(self, slot: int, nonce: bytes) -> bool:
        """Whether ``slot`` holds the record of grant ``nonce``, no longer live (a second
        notification for a grant already released: e.g. the proxy's after the decode
        engine's own)."""
        if not 0 <= slot < len(self._rows) or slot in self.live:
            return False
        head = read_header(self._rows[slot])
        return head is not None and hmac.compare_digest(head[1], nonce)

    def expire(self, now: float | None = None) -> list[str]:
        """Requests whose grants passed their deadline (then expired)."""
        now = time.monotonic() if now is None else now
        return [self._close(s, EXPIRED) for s, (_, _, d) in list(self.live.items()) if d <= now]


__all__ = ["GrantBook", "GrantRecord", "GrantTable", "PENDING", "PartClaim", "decode", "encode",
           "notify_message", "parse_notification", "part_claim", "read_header",
           "record_bytes", "table_layout"]
