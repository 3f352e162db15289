"""Backends with planted bugs for the kit's own tests (tests/test_kit_*.py), importable by
name so that a reproducer can rebuild them (``FACTORY = "kvabi_planted:NoWindow"``).

Each is the reference with one deliberate mistake.  ``Recording`` is the correct reference
that logs every example it is handed, to compare what the entry points draw.
"""
from __future__ import annotations

import os

import attrs
import numpy as np

import kvabi
from kvabi.backend.reference import ReferenceBackend


class NoWindow(ReferenceBackend):
    """Ignores the sliding window: attends to every cached token."""

    name = "planted.no_window"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), kinds=("sliding_window",),
                            dtypes=("float32",))

    def prepare(self, plan):
        if plan.spec.kind == "sliding_window":
            plan = attrs.evolve(plan, spec=attrs.evolve(plan.spec, kind="full", window=None))
        return super().prepare(plan)


class LseLog2(ReferenceBackend):
    """Returns the log-sum-exp in base 2 (every lse off by a factor 1/ln 2 = 1.4427)."""

    name = "planted.lse_log2"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), kinds=("full",), dtypes=("float32",))

    def attend(self, **kw):
        out, lse = super().attend(**kw)
        return out, np.asarray(lse) / np.log(2.0)


class WrongSlot(ReferenceBackend):
    """Also writes the step's last key into the slot after its own."""

    name = "planted.wrong_slot"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), kinds=("full",), dtypes=("float32",))

    def write(self, plan, cache, key, value, layer, **scales):
        cache = super().write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              **scales)
        m, bs = plan.meta, plan.spec.block_size
        real = np.nonzero(m.slot_mapping >= 0)[0]
        if len(real):
            s = (int(m.slot_mapping[real[-1]]) + 1) % (plan.layout.num_blocks * bs)
            view = cache.kv_view(layer, 0)
            view[s // bs, s % bs] = np.asarray(key[real[-1]]).astype(view.dtype)
        return cache


class Recording(ReferenceBackend):
    """The correct reference, logging each example's spec, layout and batch to the file
    named by ``$KVABI_RECORD`` (one line per plan)."""

    name = "planted.recording"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), kinds=("full", "sliding_window"),
                            dtypes=("float32",))

    def prepare(self, plan):
        path = os.environ.get("KVABI_RECORD")
        if path:
            meta = plan.meta
            with open(path, "a") as f:
                f.write(f"{plan.spec} {plan.layout.name} {meta.query_lens.tolist()} "
                        f"{meta.context_lens.tolist()} {meta.block_table.tolist()} "
                        f"{plan.scale} {plan.softcap}\n")
        return super().prepare(plan)


ALL = (NoWindow, LseLog2, WrongSlot, Recording)


@kvabi.hookimpl
def kvabi_backends():
    return [cls() for cls in ALL]
