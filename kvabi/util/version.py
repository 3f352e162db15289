"""kvabi's version numbers and the check of a message's version field: the bottom of
kvabi's dependency order.

Two numbers, kept apart because they move apart: :data:`ABI_VERSION` is the version of the
Python calls between an engine, kvabi and a backend (``Backend`` methods, hooks, the step
plan); :data:`WIRE_VERSION` is the ``kvabi_abi`` field of what kvabi writes for another
process to read (the layout descriptor's JSON and the transfer handshake message).
"""
from __future__ import annotations

from .errors import KVABIError

#: the version of the kvabi distribution
__version__ = "0.1.0"

#: (major, minor) of the Python ABI: the Backend calls and hooks (``specs/versioning.md``).
ABI_VERSION = (2, 0)

#: (major, minor) of the descriptor JSON and the handshake message (``kvabi_abi``); 2.0:
#: components in the descriptor. Readers take this major and every 1.x message.
WIRE_VERSION = (2, 0)


def wire_version(ver) -> tuple[int, int]:
    """The ``kvabi_abi`` field of an untrusted message (descriptor, handshake) as
    (major, minor); KVABIError unless it is a list of two non-negative ints."""
    if (not isinstance(ver, list) or len(ver) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ver)):
        raise KVABIError(f"kvabi_abi: must be [major, minor], got {ver!r:.80}")
    return ver[0], ver[1]
