"""The ABI version and the check of a message's version field: the bottom of kvabi's
dependency order (the layout descriptor, the transfer handshake and the backend ABI all
carry it)."""
from __future__ import annotations

from .errors import KVABIError

#: (major, minor) of the backend ABI and of the layout descriptor format.
ABI_VERSION = (1, 2)
#: (major, minor) of the layout descriptor's JSON form (``specs/layout.md``; 2.0: components).
#: Readers take this major and every 1.x descriptor.
LAYOUT_VERSION = (2, 0)


def wire_version(ver) -> tuple[int, int]:
    """The ``kvabi_abi`` field of an untrusted message (descriptor, handshake) as
    (major, minor); KVABIError unless it is a list of two non-negative ints."""
    if (not isinstance(ver, list) or len(ver) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ver)):
        raise KVABIError(f"kvabi_abi: must be [major, minor], got {ver!r:.80}")
    return ver[0], ver[1]
