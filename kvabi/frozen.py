"""Read-only arrays kvabi keeps after checking them (``specs/security.md``: an object kvabi
has checked is immutable for as long as anything trusts it).

``flags.writeable = False`` alone is a request, not a guarantee: the owner of the data can
set it back.  :func:`frozen_array` copies the values into an immutable ``bytes`` object and
views them from there, so no caller (through ``.base`` or otherwise) can make them writable
again.
"""
from __future__ import annotations

import numpy as np


def frozen_array(a, dtype=None) -> np.ndarray:
    """A read-only copy of ``a`` (C order, ``dtype`` if given) over an immutable buffer."""
    a = np.ascontiguousarray(a, dtype)
    return np.frombuffer(a.tobytes(), a.dtype).reshape(a.shape)


def is_frozen(a) -> bool:
    """True when ``a`` is a numpy array viewing (through read-only views) an immutable
    ``bytes`` buffer: its values cannot change."""
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        a = a.base
    return isinstance(a, bytes)
