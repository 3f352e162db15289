"""A read-only dict for the mappings that checked kvabi objects hold (``specs/security.md``:
an object kvabi has checked stays as it was checked).

:class:`FrozenDict` is a ``dict`` (JSON, ``==`` with plain dicts and ``dict(x)`` work as
before) whose mutating methods raise, so ``layout.sizes["B"] = 10**6`` cannot change a
:class:`~kvabi.Layout` after its byte counts were computed and checked.
"""
from __future__ import annotations

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
