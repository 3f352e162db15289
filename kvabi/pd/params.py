"""``kv_transfer_params`` (``specs/pd.md`` sections 4.1-4.3 and 6.1): the producer's answer,
and the consumer's reading of it, once, in full, where a request enters, against the
request's own prompt and the engine's KV cache groups.

A client may send any JSON value there, so nothing is assumed about types.  Anything wrong
raises KVABIError naming the field and value; the engine then fails that request alone.
Keys this protocol does not read are left alone.  Whether the producer's ranks really are
that engine's ranks, in order, each holding its split of the heads, and whether its
records vouch for what the parameters say, is checked by the pull (:mod:`.consumer`).
"""
from __future__ import annotations

import collections
import re

import attrs
import numpy as np

from ..util.coerce import as_bool, as_int
from ..util.errors import KVABIError
from ..transfer.handshake import parse_handshake
from .digests import tokens_digest
from .notify import MAX_RANKS
from .parts import MAX_PARTS, NAME_CHARS, is_image
from .record import TABLE_NAME
from .slots import NULL, null_allowed

#: this protocol's [major, minor]
PD_VERSION = (1, 0)
_NONCE = re.compile(r"[0-9a-f]{32}")
#: parsed handshakes kept (producers send the same messages with every request)
HANDSHAKE_CACHE = 64
#: the fields of a remote prefill, in the order their absence is named
REQUIRED = ("kvabi_pd", "remote_num_tokens", "remote_block_ids", "kvabi_handshakes",
            "kvabi_grants", "kvabi_grant")
#: the ask (specs/pd.md 4.1): what a request to a producer carries
ASK = {"do_remote_decode": True, "do_remote_prefill": False}


@attrs.frozen(eq=False)
class RemotePrefill:
    """A consumer request's validated remote prefill."""

    num_tokens: int          # tokens whose KV the producer holds (a prefix of the prompt)
    blocks: tuple            # per group: the producer's block ids (int64, -1: none)
    handshakes: tuple        # per group: {part: (handshake message per producer rank)}
    grants: tuple            # the handshake of each producer rank's grant table
    slot: int                # the grant's slot in that table
    nonce: bytes             # the grant's secret
    tokens: bytes            # digest of this request's prompt[:num_tokens]
    block_size: int          # the producer's
    layouts: tuple = ()      # per group: {part: (Layout per producer rank)}

    @property
    def ranks(self) -> int:
        """The producer's tensor-parallel size."""
        return len(self.grants)


@attrs.frozen(eq=False)
class Entry:
    """What a request asks: a remote prefill to pull (consumer), to hold its blocks for a
    consumer (producer), and whether the host tier may serve and keep it."""

    remote: RemotePrefill | None = None
    remote_decode: bool = False
    host: bool = True


def answer(*, slot: int, nonce: bytes, num_tokens: int, blocks, handshakes, grants,
           engine_id: str | None = None, request_id: str | None = None) -> dict:
    """A producer's answer for a held request (``specs/pd.md`` 4.2): ``blocks`` per group
    (ids, -1 none), ``handshakes`` per group {part: message, or a list per rank},
    ``grants`` the grant table's message (a list per rank under TP)."""
    out = {"kvabi_pd": list(PD_VERSION), "do_remote_prefill": True,
           "do_remote_decode": False, "remote_num_tokens": int(num_tokens),
           "remote_block_ids": [[int(b) for b in g] for g in blocks],
           "kvabi_handshakes": [{part: list(m) if isinstance(m, (list, tuple)) else m
                                 for part, m in g.items()} for g in handshakes],
           "kvabi_grants": list(grants) if isinstance(grants, (list, tuple)) else grants,
           "kvabi_grant": {"slot": int(slot), "nonce": nonce.hex()}}
    if engine_id is not None:
        out["remote_engine_id"] = engine_id
    if request_id is not None:
        out["remote_request_id"] = request_id
    return out


class ParamsReader:
    """Reads requests' ``kv_transfer_params`` (one per front: it keeps a few parsed
    handshakes).  ``windows``: per KV cache group its sliding window (None: full)."""

    def __init__(self, *, consumer: bool, windows: tuple):
        self.consumer = consumer
        self.windows = tuple(windows)
        self._parsed: collections.OrderedDict = collections.OrderedDict()

    def _handshake(self, message, field: str):
        if not isinstance(message, str):
            raise KVABIError(f"{field}: must be a handshake message (a string), got "
                             f"{type(message).__name__}")
        h = self._parsed.get(message)
        if h is None:
            try:
                h = parse_handshake(message)
            except KVABIError as e:
                raise KVABIError(f"{field}: {e}") from None
            self._parsed[message] = h
            if len(self._parsed) > HANDSHAKE_CACHE:
                self._parsed.popitem(last=False)
        else:
            self._parsed.move_to_end(message)
        return h

    def read(self, params, prompt) -> Entry:
        """The entry of a request with ``params`` and prompt token ids ``prompt``."""
        if params is None:
            return Entry()
        if not isinstance(params, dict):
            raise KVABIError(f"kv_transfer_params: must be an object, got "
                             f"{type(params).__name__}")
        flags = {}
        for key, default in (("do_remote_prefill", False), ("do_remote_decode", False),
                             ("kvabi_host", True)):
            v = params.get(key, default)
            flags[key] = default if v is None else as_bool(v, key)
        remote = None
        if flags["do_remote_prefill"] and self.consumer:
            remote = self._remote(params, prompt)
        return Entry(remote, flags["do_remote_decode"], flags["kvabi_host"])

    def _remote(self, p: dict, prompt) -> RemotePrefill:
        groups = len(self.windows)
        for key in REQUIRED:
            if key not in p:
                raise KVABIError(f"{key}: missing from a remote prefill's kv_transfer_params")
        _version(p["kvabi_pd"])
        plen = len(prompt)
        n = as_int(p["remote_num_tokens"], "remote_num_tokens", lo=1)
        if n > plen:
            raise KVABIError(f"remote_num_tokens: {n} exceeds this request's prompt of "
                             f"{plen} tokens")
        grant = p["kvabi_grant"]
        if not isinstance(grant, dict) or set(grant) != {"slot", "nonce"}:
            raise KVABIError("kvabi_grant: must be an object of exactly slot and nonce")
        slot = as_int(grant["slot"], "kvabi_grant.slot", lo=0)
        nonce = grant["nonce"]
        if not isinstance(nonce, str) or not _NONCE.fullmatch(nonce):
            raise KVABIError("kvabi_grant.nonce: must be 32 lowercase hex digits")
        grants = _per_rank(p["kvabi_grants"], "kvabi_grants")
        ranks = len(grants)
        for i, msg in enumerate(grants):
            field = "kvabi_grants" if isinstance(p["kvabi_grants"], str) else \
                f"kvabi_grants[{i}]"
            table = self._handshake(msg, field).layout
            if table.name != TABLE_NAME or table.dtype != "int8":
                raise KVABIError(f"{field}: not a grant table (layout {table.name!r})")
            if slot >= table.num_blocks:
                raise KVABIError(f"kvabi_grant.slot: {slot} is beyond the producer's "
                                 f"{table.num_blocks} grant slots")
        hs = p["kvabi_handshakes"]
        if not isinstance(hs, list) or len(hs) != groups:
            got = len(hs) if isinstance(hs, list) else type(hs).__name__
            raise KVABIError(f"kvabi_handshakes: must list {groups} KV cache groups, got {got}")
        ids = p["remote_block_ids"]
        if not isinstance(ids, list) or len(ids) != groups:
            got = len(ids) if isinstance(ids, list) else type(ids).__name__
            raise KVABIError(f"remote_block_ids: must list {groups} KV cache groups, got {got}")
        blocks, bs_all, msgs_all, layouts_all = [], set(), [], []
        for g in range(groups):
            msgs, layouts = self._group(hs[g], g, ranks)
            token_parts = [(name, lays) for name, lays in layouts.items() if not is_image(name)]
            if not token_parts:
                raise KVABIError(f"kvabi_handshakes[{g}]: the producer serves no token "
                                 f"layout (only {sorted(layouts)})")
            bs = token_parts[0][1][0].size("N")
            for name, lays in token_parts:
                for i, lay in enumerate(lays):
                    if lay.size("N") != bs:
                        raise KVABIError(f"kvabi_handshakes[{g}].{name}[{i}]: block size "
                                         f"{lay.size('N')}, the producer's first says {bs}")
            num_blocks = min(lay.num_blocks for lays in layouts.values() for lay in lays)
            bs_all.add(bs)
            blocks.append(self._block_ids(ids[g], g, n, bs, num_blocks))
            msgs_all.append(msgs)
            layouts_all.append(layouts)
        if len(bs_all) != 1:
            raise KVABIError(f"kvabi_handshakes: groups of block sizes {sorted(bs_all)}")
        return RemotePrefill(n, tuple(blocks), tuple(msgs_all), grants, slot,
                             bytes.fromhex(nonce), tokens_digest(prompt[:n]), bs_all.pop(),
                             tuple(layouts_all))

    def _group(self, parts, g: int, ranks: int) -> tuple[dict, dict]:
        if not isinstance(parts, dict) or not parts or len(parts) > MAX_PARTS:
            raise KVABIError(f"kvabi_handshakes[{g}]: must be an object of 1 to "
                             f"{MAX_PARTS} part -> message entries")
        msgs, layouts = {}, {}
        for name, sent in parts.items():
            if not isinstance(name, str) or not 0 < len(name) <= NAME_CHARS:
                raise KVABIError(f"kvabi_handshakes[{g}]: part names are strings of 1 to "
                                 f"{NAME_CHARS} characters, got {name!r:.60}")
            field = f"kvabi_handshakes[{g}].{name}"
            msgs[name] = _per_rank(sent, field)
            if len(msgs[name]) != ranks:
                raise KVABIError(f"{field}: {len(msgs[name])} producer ranks, "
                                 f"kvabi_grants lists {ranks}")
            layouts[name] = tuple(
                self._handshake(m, field if isinstance(sent, str) else f"{field}[{i}]")
                .layout for i, m in enumerate(msgs[name]))
        return msgs, layouts

    def _block_ids(self, row, g: int, n: int, bs: int, num_blocks: int) -> np.ndarray:
        field = f"remote_block_ids[{g}]"
        want = -(-n // bs)
        if not isinstance(row, list) or len(row) != want:
            got = len(row) if isinstance(row, list) else type(row).__name__
            raise KVABIError(f"{field}: must list the {want} blocks holding {n} tokens of "
                             f"{bs}, got {got}")
        typed = [isinstance(b, (int, np.integer)) and not isinstance(b, (bool, np.bool_))
                 for b in row]
        if not all(typed) or (row and not NULL <= min(row) <= max(row) < num_blocks):
            for i, b in enumerate(row):  # name the first offender
                if b != NULL or not typed[i]:
                    as_int(b, f"{field}[{i}]", lo=0, hi=num_blocks - 1)
        ids = np.array(row, np.int64).reshape(-1)
        null = ids == NULL
        if null.any():
            bad = np.flatnonzero(null & ~null_allowed(self.windows[g], bs, n))
            if bad.size:
                raise KVABIError(f"{field}[{int(bad[0])}]: the null block where the prompt's "
                                 f"KV must be")
        real = ids[~null]
        if np.unique(real).size != real.size:
            vals, counts = np.unique(real, return_counts=True)
            raise KVABIError(f"{field}: block {int(vals[counts > 1][0])} appears twice")
        ids.setflags(write=False)
        return ids


def _version(v) -> None:
    if not (isinstance(v, list) and len(v) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        raise KVABIError(f"kvabi_pd: must be [major, minor], two integers >= 0, got {v!r:.60}")
    if v[0] != PD_VERSION[0]:
        raise KVABIError(f"kvabi_pd: protocol {v[0]}.{v[1]}, this engine reads major "
                         f"{PD_VERSION[0]}")


def _per_rank(sent, field: str) -> tuple:
    """The messages of one place in the parameters, one per producer rank: a message (a
    producer of TP size 1) or a list of 1 to MAX_RANKS messages."""
    if isinstance(sent, str):
        return (sent,)
    if not isinstance(sent, list) or not 1 <= len(sent) <= MAX_RANKS:
        got = f"a list of {len(sent)}" if isinstance(sent, list) else type(sent).__name__
        raise KVABIError(f"{field}: must be a handshake message or a list of 1 to "
                         f"{MAX_RANKS} (one per producer rank), got {got}")
    for i, m in enumerate(sent):
        if not isinstance(m, str):
            raise KVABIError(f"{field}[{i}]: must be a handshake message (a string), got "
                             f"{type(m).__name__}")
    return tuple(sent)


__all__ = ["ASK", "Entry", "PD_VERSION", "ParamsReader", "RemotePrefill", "answer"]
