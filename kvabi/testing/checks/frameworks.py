"""A cache of another framework handed to a backend (``specs/security.md`` section 3): the
backend refuses it with a KVABIError naming both frameworks, the one it takes and the one
it was given, and changes nothing.  Never a TypeError from deep inside a kernel."""
from __future__ import annotations

import importlib.util

import numpy as np

from ...memory.cache import KVCache
from ...util.errors import KVABIError
from ...util.tensors import to_numpy
from ..harness import Runner, in_framework, step_inputs
from ..measure import ConformanceFailure
from .base import KitOptions, NotApplicable, Refused, attention_cases, not_refused


def foreign_framework(backend, layout) -> str | None:
    """A framework other than the backend's that can hold ``layout`` here (jax arrays are
    dense, and torch or jax must be installed), or None."""
    own = getattr(backend, "framework", "numpy")
    for fw in ("numpy", "torch", "jax"):
        if fw == own or (fw != "numpy" and importlib.util.find_spec(fw) is None):
            continue
        if fw == "jax" and not layout.is_c_contiguous:
            continue
        return fw
    return None


def check_foreign_framework(backend, reference, case, options: KitOptions = KitOptions()
                            ) -> float:
    """``write_kv`` of the step into a zeroed cache of another framework: refused by name
    (the message names the backend's framework and the cache's) with every byte still
    zero."""
    own = getattr(backend, "framework", "numpy")
    other = foreign_framework(backend, case.layout)
    if other is None:
        raise NotApplicable(f"no framework other than {own} can hold {case.layout.name}")
    lay = case.layout
    foreign = KVCache.allocate(lay, other)
    k, v, _ = step_inputs(case)
    b = Runner(backend, case, oracle=False)
    plan = b.plan(case.meta)
    what = f"write_kv into a cache of {other} planes ({backend.name} takes {own})"
    try:
        backend.write_kv(plan, foreign, key=in_framework(backend, k),
                         value=in_framework(backend, v), layer=case.layer,
                         **case.scales())
    except KVABIError as e:
        msg = str(e)
        if own not in msg or other not in msg:
            raise ConformanceFailure(f"{what}: refused, but the message does not name both "
                                     f"frameworks ({own!r} and {other!r}): {msg}") from e
        for i, p in enumerate(foreign):
            if np.any(np.ascontiguousarray(to_numpy(p)).view(np.uint8)):
                raise ConformanceFailure(f"{what}: refused, but plane {i} changed first")
        return Refused(f"{other} cache refused by name")
    except Exception as e:  # noqa: BLE001 - the point: no other exception may escape
        raise not_refused(what, e) from e
    raise ConformanceFailure(f"{what}: accepted instead of refused with a KVABIError")


def foreign_framework_strategy(backend, options):
    return attention_cases(backend, options)
