"""Editing one place of a JSON document in tests (a hostile peer's or client's edit)."""
from __future__ import annotations

import copy

#: the value that deletes the place instead of setting it
DELETE = object()


def edited(doc, path, value):
    """A deep copy of ``doc`` with the place at ``path`` (keys and indices) set to ``value``,
    or removed where ``value`` is :data:`DELETE`."""
    out = copy.deepcopy(doc)
    at = out
    for k in path[:-1]:
        at = at[k]
    if value is DELETE:
        del at[path[-1]]
    else:
        at[path[-1]] = value
    return out
