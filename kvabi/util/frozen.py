"""What kvabi keeps after checking it, made immutable (``specs/security.md``: an object kvabi
has checked is immutable for as long as anything trusts it).

- :class:`FrozenDict` is a ``dict`` (JSON, ``==`` with plain dicts and ``dict(x)`` work as
  before) whose mutating methods raise, so ``layout.sizes["B"] = 10**6`` cannot change a
  :class:`~kvabi.Layout` after its byte counts were computed and checked.
- :func:`frozen_array`: ``flags.writeable = False`` alone is a request, not a guarantee (the
  owner of the data can set it back), so it copies the values into an immutable ``bytes``
  object and views them from there: no caller, through ``.base`` or otherwise, can make them
  writable again.
"""
from __future__ import annotations

import numpy as np

from .errors import FrozenError


def _refuse(self, *args, **kwargs):
    raise FrozenError(f"{type(self).__name__}: read-only (kvabi checked it when it was "
                      f"built); build a new object instead")


class FrozenDict(dict):
    """An immutable dict (hashable by its items; pickles as a plain dict's items)."""

    __slots__ = ()

    def __new__(cls, *args, **kwargs):
        self = dict.__new__(cls)
        dict.update(self, *args, **kwargs)
        return self

    def __init__(self, *args, **kwargs):  # filled in __new__: a second __init__ changes nothing
        pass

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __hash__(self):
        return hash(frozenset(self.items()))

    def __reduce__(self):
        return (type(self), (dict(self),))

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


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
