"""The backend ABI: pluggy hookspecs and the :class:`Backend` protocol.

A plugin module (registered under the entry-point group ``kvabi``) implements
``kvabi_backends()`` returning Backend objects.  Backends follow FlashInfer's split:
:meth:`Backend.plan` runs once per step and KV group; :meth:`Backend.write_kv` and
:meth:`Backend.attention` run per layer with that plan.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import pluggy

from .errors import KVABIError

#: (major, minor) of the backend ABI and of the layout descriptor format.
ABI_VERSION = (1, 0)
PROJECT = "kvabi"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class UnsupportedError(KVABIError):
    """A backend was asked for something outside its capabilities."""


class HookSpecs:
    """Hooks a kvabi plugin may implement."""

    @hookspec
    def kvabi_backends(self) -> Sequence["Backend"]:
        """Return the Backend objects this plugin provides."""

    @hookspec
    def kvabi_bench_suites(self) -> dict[str, Callable[..., Any]]:
        """Return {suite name: callable(argv) -> int} for ``kvabi bench NAME``."""


@attrs.frozen
class Capabilities:
    """What a backend can compute.  ``None`` in a tuple field means "any"."""

    kinds: tuple[str, ...] = ("full", "sliding_window", "chunked_local")
    dtypes: tuple[str, ...] = ("float32",)
    head_dims: tuple[int, ...] | None = None
    block_sizes: tuple[int, ...] | None = None
    block_size_multiple: int = 1
    softcap: bool = False
    sinks: bool = False
    layouts: tuple[str, ...] = ()
    notes: str = ""

    def unsupported_reason(self, spec, *, softcap=None, sinks=None) -> str | None:
        """Why ``spec`` (with these options) is unsupported, or None when it is supported."""
        if spec.kind not in self.kinds:
            return f"kind {spec.kind!r} not in {self.kinds}"
        if spec.dtype not in self.dtypes:
            return f"dtype {spec.dtype!r} not in {self.dtypes}"
        for d in {spec.head_dim, spec.head_dim_v}:
            if self.head_dims is not None and d not in self.head_dims:
                return f"head_dim {d} not in {self.head_dims}"
        if self.block_sizes is not None and spec.block_size not in self.block_sizes:
            return f"block_size {spec.block_size} not in {self.block_sizes}"
        if spec.block_size % self.block_size_multiple:
            return f"block_size {spec.block_size} not a multiple of {self.block_size_multiple}"
        if softcap is not None and not self.softcap:
            return "soft cap not supported"
        if sinks is not None and not self.sinks:
            return "attention sinks not supported"
        return None

    def to_dict(self) -> dict:
        return attrs.asdict(self)


class Backend:
    """Base class of an attention backend.  Subclasses override the methods below.

    Array arguments and results are in the backend's own framework (numpy, torch, jax);
    :meth:`asarray` and :meth:`to_numpy` convert for the conformance kit.

    Shapes: ``key`` [T, H, D], ``value`` [T, H, Dv] (``None`` for MLA, whose latent is passed
    as ``key`` [T, 1, D]); ``query`` [T, Hq, D]; output [T, Hq, Dv]; lse [T, Hq] (natural
    log).  ``T`` is ``meta.num_tokens`` (padding included); outputs at padding tokens are
    unspecified.  ``cache`` is the list of planes returned by :meth:`allocate`.
    """

    #: dotted name, e.g. "cuda.triton"
    name: str = ""
    #: the ABI (major, minor) the backend was built for
    abi_version: tuple[int, int] = ABI_VERSION

    def available(self) -> tuple[bool, str]:
        """(usable here, reason or mode description)."""
        return True, ""

    def capabilities(self, spec=None) -> Capabilities:
        raise NotImplementedError

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        """Layout preset names, best first."""
        raise NotImplementedError

    def check_supported(self, spec, *, softcap=None, sinks=None) -> None:
        """Raise :class:`UnsupportedError` unless this backend can compute ``spec``."""
        why = self.capabilities(spec).unsupported_reason(spec, softcap=softcap, sinks=sinks)
        if why:
            raise UnsupportedError(f"{self.name}: unsupported: {why}")

    def allocate(self, layout) -> list:
        """Zeroed planes for ``layout``, each shaped ``layout.plane_shape``."""
        raise NotImplementedError

    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        """Per-step plan from metadata; reused by every layer of the group."""
        raise NotImplementedError

    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        """Write new K/V at ``plan``'s slot mapping (slot -1 skipped); returns the cache."""
        raise NotImplementedError

    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        """Attention of the step's queries over the cache; ``(out, lse)`` if return_lse."""
        raise NotImplementedError

    def asarray(self, x):
        """A numpy array in this backend's framework (for tests)."""
        return x

    def to_numpy(self, x):
        import numpy as np

        return np.asarray(x)
