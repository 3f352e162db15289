"""Notifications (``specs/pd.md`` section 4.6): the ASCII message a consumer rank sends a
producer rank when it is done with a grant, ``kvabi.pull:<slot>:<nonce>:<rank>/<size>``."""
from __future__ import annotations

import re

#: what every notification starts with
PREFIX = "kvabi.pull:"
#: most tensor-parallel ranks on either side of a pull
MAX_RANKS = 64
_NOTE = re.compile(r"kvabi\.pull:([0-9]{1,9}):([0-9a-f]{32}):([0-9]{1,9})/([0-9]{1,9})")


def notify_message(slot: int, nonce: bytes, rank: int = 0, size: int = 1) -> bytes:
    """The notification that tells a producer rank that consumer rank ``rank`` of ``size``
    is done with grant ``slot`` (it read the KV, or gave up after binding)."""
    return f"{PREFIX}{slot}:{nonce.hex()}:{rank}/{size}".encode()


def parse_notification(msg: bytes) -> tuple[int, bytes, int, int] | None:
    """(slot, nonce, consumer rank, consumer TP size) of a notification, or None when it is
    not one (any bytes: from a peer)."""
    try:
        text = msg.decode("ascii")
    except (UnicodeDecodeError, AttributeError):
        return None
    m = _NOTE.fullmatch(text)
    if m is None:
        return None
    slot, nonce, rank, size = m.groups()
    rank, size = int(rank), int(size)
    if not 0 <= rank < size <= MAX_RANKS:
        return None
    return int(slot), bytes.fromhex(nonce), rank, size


__all__ = ["MAX_RANKS", "PREFIX", "notify_message", "parse_notification"]
