"""A backend written against ABI 1.0, as a third-party package shipped it before 1.1.

``abi_version`` (1, 0); ``plan`` without ``num_q_heads``; ``attention`` without ``sinks``
or ``out``; caches are plain lists of numpy planes (anything else is a TypeError, as a 1.0
backend indexing ``cache[i]`` after checking ``isinstance(cache, list)`` would raise); its
own ``asarray``/``to_numpy``.  It computes with the reference, called the 1.0 way.  The
conformance kit must hand it nothing of 1.1, and it must pass the whole kit.
"""
from __future__ import annotations

import collections

import attrs

import numpy as np

import kvabi
from kvabi.views import allocate_numpy


class Abi10Backend(kvabi.Backend):
    """The reference behind the ABI 1.0 protocol; ``seen`` counts what it was handed."""

    abi_version = (1, 0)
    name = "abi10.reference"

    def __init__(self):
        from kvabi.reference import ReferenceBackend

        self._ref = ReferenceBackend()
        self.seen = collections.Counter()

    def available(self):
        return True, "ABI 1.0 wrapper of the reference"

    def capabilities(self, spec=None):  # 1.0 had no quantized caches
        return attrs.evolve(self._ref.capabilities(spec), quant=("none",))

    def preferred_layouts(self, spec):
        return self._ref.preferred_layouts(spec)

    # 1.0 had the kit convert arrays through these two hooks
    def asarray(self, x):
        self.seen["asarray"] += 1
        return np.array(x)

    def to_numpy(self, x):
        self.seen["to_numpy"] += 1
        return np.asarray(x)

    def allocate(self, layout):
        return allocate_numpy(layout, 0)

    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        self.seen["plan"] += 1
        return self._ref.plan(meta, spec, layout, scale=scale, softcap=softcap, sinks=sinks)

    def _list(self, cache):
        if type(cache) is not list:
            raise TypeError(f"ABI 1.0 backend: the cache must be a list of planes, got "
                            f"{type(cache).__name__}")
        self.seen["list cache"] += 1
        return cache

    def write_kv(self, cache, layout, key, value, plan, *, layer=0):
        self._ref.write_kv(self._list(cache), layout, key, value, plan, layer=layer)
        return cache

    def attention(self, query, cache, layout, plan, *, layer=0, return_lse=False):
        return self._ref.attention(query, self._list(cache), layout, plan, layer=layer,
                                   return_lse=return_lse)


@kvabi.hookimpl
def kvabi_backends():
    return [Abi10Backend()]
