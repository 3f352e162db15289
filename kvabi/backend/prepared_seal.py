"""What a backend prepared for a step stays as it was prepared (``specs/security.md``
section 2.5): :class:`Seal`.

``Backend.plan`` checks a step once and the backend's ``prepare`` turns it into index
arrays its kernels trust (block entries, slots, query offsets).  A caller who changed one
afterwards (``plan.prepared.table[0, 0] = 10**6``) would make a kernel read or write
outside the cache, or silently compute something else.  So the base class seals
``plan.prepared`` when ``plan`` returns and checks the seal at every ``write_kv`` and
``attention``:

- numpy arrays are made read-only (and every array they view); the flag turned back on is
  refused at use (an array over an immutable buffer, :func:`kvabi.util.frozen.frozen_array`,
  cannot be made writable and is not checked);
- torch tensors have no read-only flag: the version counter of each one's storage owner
  (views share it; every in-place torch operation on the tensor or any view bumps it) is
  kept and compared at use; a tensor without a counter (made in inference mode) is
  compared with a copy;
- jax arrays are immutable;
- mutable containers (a ``dict``, a ``list``, a class that is not frozen) keep the
  identity of what they held; an entry added, removed or rebound is refused at use.

The seal walks frozen attrs classes and dataclasses, tuples, lists, dicts; any other
object is the backend's (``security.md`` section 3: a backend keeps what ``prepare``
returns immutable).  Data a backend makes from a plan later (per query dtype, per tile
shape) goes through ``Backend.prepared_for``, sealed when made.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading

import attrs
import numpy as np

from ..util.errors import KVABIError
from ..util.frozen import FrozenDict, is_frozen


@attrs.frozen
class _FrozenProbe:
    x: int = 0


#: the ``__setattr__`` of every attrs frozen class
_FROZEN_SETATTR = _FrozenProbe.__setattr__
#: a walk visits at most this many objects (a prepared step holds a few dozen)
MAX_OBJECTS = 1 << 16
_MISSING = object()


def normal_tensors():
    """A context in which torch makes tensors with version counters: inside torch's
    inference mode (vLLM's engine runs in it) every new tensor would be an inference
    tensor, which has none."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    return torch.inference_mode(False)


class Seal:
    """The state of everything a backend prepared for one plan (see the module
    docstring); :meth:`check` refuses any change, naming where it is."""

    __slots__ = ("_counters", "_numpy", "_mutable", "_clones", "_memo", "_lock")

    def __init__(self):
        self._counters: list = []  # (tensor owning a version counter, version, path)
        self._numpy: list = []  # (array made read-only, path)
        self._mutable: list = []  # (container, its entries, path)
        self._clones: list = []  # (inference tensor, its copy, path)
        self._memo: dict = {}  # Backend.prepared_for: key -> (value, its own Seal)
        self._lock = threading.Lock()

    # -- sealing ---------------------------------------------------------------------------
    def add(self, obj, path: str) -> None:
        """Seal ``obj`` and everything it holds (``path``: its name in messages).  On the
        path of every step: types are classified once, leaves (numbers, strings) skipped
        by exact type before anything else is asked of them."""
        torch = sys.modules.get("torch")
        tensor = torch.Tensor if torch is not None else ()
        seen: set[int] = set()
        counters = {id(t): paths for t, _, paths in self._counters}
        todo = [(obj, path)]
        while todo:
            x, where = todo.pop()
            tx = type(x)
            if tx in _LEAVES or id(x) in seen:
                continue
            seen.add(id(x))
            if len(seen) > MAX_OBJECTS:
                raise KVABIError(f"{path}: holds more than {MAX_OBJECTS} objects (a step's "
                                 f"prepared data is a few arrays)")
            kind = _KINDS.get(tx)
            if kind is None:
                kind = _KINDS[tx] = _kind(tx, tensor)
            if kind is _TENSOR:
                self._seal_torch(x, where, counters)
            elif kind is _ARRAY:
                self._seal_numpy(x, where)
            elif kind is _TUPLE:
                todo += [(v, f"{where}[{i}]") for i, v in enumerate(x)
                         if type(v) not in _LEAVES]
            elif kind is _FROZEN_MAP or kind is _MAP:
                if kind is _MAP:  # entries can be added, removed, rebound: keep them
                    self._mutable.append((x, tuple(x.items()), where))
                todo += [(v, f"{where}[{k!r}]") for k, v in x.items()
                         if type(v) not in _LEAVES]
            elif kind is _LIST:
                self._mutable.append((x, tuple(x), where))
                todo += [(v, f"{where}[{i}]") for i, v in enumerate(x)
                         if type(v) not in _LEAVES]
            elif kind is not _OPAQUE:  # a class's fields: (names, shown names, frozen)
                names, shown, frozen = kind
                values = tuple(getattr(x, n, _MISSING) for n in names)
                if not frozen:  # its attributes can be rebound: keep what they were
                    self._mutable.append((x, tuple(zip(names, values)), where))
                todo += [(v, f"{where}.{n}") for n, v in zip(shown, values)
                         if type(v) not in _LEAVES]

    def _seal_numpy(self, a: np.ndarray, where: str) -> None:
        if a.dtype.hasobject:
            raise KVABIError(f"{where}: an object array (its entries can change); prepare "
                             f"arrays of numbers")
        if is_frozen(a):
            return  # over an immutable buffer: can never be written
        b = a
        while isinstance(b, np.ndarray):  # the array and every array it views
            b.flags.writeable = False
            self._numpy.append((b, where))
            b = b.base

    def _seal_torch(self, t, where: str, counters: dict) -> None:
        owner = t._base
        owner = t if owner is None else owner  # views share their base's counter
        paths = counters.get(id(owner))
        if paths is not None:  # another view of a storage already sealed: named with it
            paths.append(where)
            return
        try:
            version = owner._version
        except RuntimeError:  # an inference tensor has no counter: compared with a copy
            self._clones.append((t, t.clone(), where))
            return
        counters[id(owner)] = paths = [where]
        self._counters.append((owner, version, paths))

    # -- checking --------------------------------------------------------------------------
    def check(self) -> None:
        """KVABIError naming the first prepared array or container that changed since it
        was sealed."""
        for t, v, paths in self._counters:
            if t._version != v:  # views of one storage share the counter: all named
                raise _changed(", ".join(sorted(paths)), "written")
        for a, where in self._numpy:
            if a.flags.writeable:
                raise _changed(where, "made writable")
        for c, entries, where in self._mutable:
            if not _same_entries(c, entries):
                raise _changed(where, "rebound, added or removed entries")
        if self._clones:
            self._check_clones()

    def _check_clones(self) -> None:
        import torch

        for t, c, where in self._clones:
            if t.shape != c.shape or t.dtype != c.dtype or not torch.equal(t, c):
                raise _changed(where, "written")

    # -- data made later -------------------------------------------------------------------
    def memo(self, key, make, path: str):
        """The value ``make()`` gave for ``key`` (made once under the lock, sealed), its
        seal checked at every return."""
        hit = self._memo.get(key)
        if hit is None:
            with self._lock:
                hit = self._memo.get(key)
                if hit is None:
                    with normal_tensors():
                        value = make()
                    seal = Seal()
                    seal.add(value, path)
                    hit = self._memo[key] = (value, seal)
        value, seal = hit
        seal.check()
        return value


#: types whose objects hold nothing to seal (exact types: a lookup, not an isinstance,
#: which asks a tensor for its ``__class__``)
_LEAVES = frozenset((str, bytes, int, bool, float, complex, type(None)))
# how the walk treats a type, found once per type
_TENSOR, _ARRAY, _TUPLE, _LIST, _MAP, _FROZEN_MAP, _OPAQUE = (
    "tensor", "array", "tuple", "list", "map", "frozen map", "opaque")
_KINDS: dict = {}


def _kind(t, tensor):
    """What the walk does with objects of type ``t`` (``tensor``: torch.Tensor, or ())."""
    if tensor and issubclass(t, tensor):
        return _TENSOR
    if issubclass(t, np.ndarray):
        return _ARRAY
    if issubclass(t, tuple):
        return _TUPLE
    if issubclass(t, FrozenDict):
        return _FROZEN_MAP
    if issubclass(t, dict):
        return _MAP
    if issubclass(t, list):
        return _LIST
    if t.__module__.split(".")[0] in ("jax", "jaxlib"):
        return _OPAQUE  # immutable arrays
    if attrs.has(t):
        names = tuple(f.name for f in attrs.fields(t))
        return names, tuple(n.lstrip("_") for n in names), t.__setattr__ is _FROZEN_SETATTR
    if dataclasses.is_dataclass(t):
        names = tuple(f.name for f in dataclasses.fields(t))
        return names, names, bool(t.__dataclass_params__.frozen)
    return _OPAQUE  # the backend's own (a library's planned wrapper)


def _same_entries(c, entries) -> bool:
    if isinstance(c, dict):
        return len(c) == len(entries) and all(c.get(k, _MISSING) is v for k, v in entries)
    if isinstance(c, list):
        return len(c) == len(entries) and all(a is b for a, b in zip(c, entries))
    return all(getattr(c, n, _MISSING) is v for n, v in entries)


def _changed(where: str, how: str) -> KVABIError:
    return KVABIError(f"{where}: {how} after plan() prepared it (what a backend prepared "
                      f"for a step is read-only while the plan is used); make a new plan")
