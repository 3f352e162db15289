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

from .cache import KVCache
from .errors import KVABIError
from .tensors import convert, to_numpy
from .version import ABI_VERSION, wire_version  # noqa: F401 - public here since ABI 1.0

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
    #: the ``KVSpec.quant`` granularities computed (``specs/semantics.md`` section 11)
    quant: tuple[str, ...] = ("none",)
    #: the ``KVSpec.rounding`` modes a quantizing write implements
    roundings: tuple[str, ...] = ("nearest_even",)

    def unsupported_reason(self, spec, *, softcap=None, sinks=None) -> str | None:
        """Why ``spec`` (with these options) is unsupported, or None when it is supported."""
        if spec.kind not in self.kinds:
            return f"kind {spec.kind!r} not in {self.kinds}"
        if spec.dtype not in self.dtypes:
            return f"dtype {spec.dtype!r} not in {self.dtypes}"
        quant = getattr(spec, "quant", "none")
        if quant not in self.quant:
            return f"quant {quant!r} not in {self.quant}"
        if quant != "none" and spec.rounding not in self.roundings:
            return f"rounding {spec.rounding!r} not in {self.roundings}"
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


def abi_at_least(backend, version: tuple[int, int]) -> bool:
    """Whether ``backend`` was built for ABI ``version`` or a later minor of its major:
    callers pass the keywords a minor added (1.1: ``num_q_heads``, per-call ``sinks``,
    ``out``) and call the methods it added (1.2: ``warmup``) only on backends that declare
    it."""
    v = tuple(getattr(backend, "abi_version", (1, 0)))
    return v[0] == version[0] and v >= tuple(version)


class Backend:
    """Base class of an attention backend.  Subclasses override the methods below.

    Array arguments and results are in the backend's own framework (:attr:`framework`:
    numpy, torch or jax); :mod:`kvabi.tensors` converts between frameworks.

    Shapes: ``key`` [T, H, D], ``value`` [T, H, Dv] (``None`` for MLA, whose latent is passed
    as ``key`` [T, 1, D]); ``query`` [T, Hq, D]; output [T, Hq, Dv] in the query's dtype;
    lse [T, Hq] float32 (natural log; the numpy reference returns float64).  ``T`` is
    ``meta.num_tokens`` (padding included); outputs at padding tokens are unspecified.

    ``cache`` is a :class:`kvabi.KVCache` (ABI 1.1) or, as in ABI 1.0, a plain list of
    planes; :func:`kvabi.as_cache` turns either into a checked handle and is the first
    thing a backend does with it.  A plan holds no layer-specific state: one plan serves
    every layer of its KV group, in any order.
    """

    #: dotted name, e.g. "cuda.triton"
    name: str = ""
    #: the ABI (major, minor) the backend was built for
    abi_version: tuple[int, int] = ABI_VERSION
    #: the framework of the backend's arrays: "numpy", "torch" or "jax"
    framework: str = "numpy"

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

    def device(self):
        """The device arrays are placed on (None: the framework's default)."""
        return None

    def allocate(self, layout):
        """A zeroed :class:`kvabi.KVCache` for ``layout`` in this backend's framework."""
        return KVCache.allocate(layout, self.framework, device=self.device())

    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        """Per-step plan from metadata; reused by every layer of the group.

        ``num_q_heads`` (1.1; None: learned from the query) lets a backend plan for the
        GQA group size; ``sinks`` is the default of every layer (1.1 ``attention`` may
        override it per layer)."""
        raise NotImplementedError

    def warmup(self, spec, layout, limits, *, num_q_heads=None, progress=None) -> None:
        """Prepare every step within ``limits`` (a :class:`kvabi.StepLimits`) for ``spec``
        over ``layout`` ahead of time (1.2), so that no step within them pays a compile.

        A backend that compiles per shape builds all its buckets here and states what a
        step outside the limits does (refused or compiled once); ``progress``, when given,
        is called as ``progress(done, total, what)`` after each piece.  The base class has
        nothing to prepare: it checks its arguments and returns."""
        from .step_limits import StepLimits

        if not isinstance(limits, StepLimits):
            raise KVABIError(f"limits: must be a kvabi.StepLimits, got {type(limits).__name__}")

    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        """Write new K/V at ``plan``'s slot mapping (slot -1 skipped); returns the cache.

        numpy and torch caches are written in place.  A jax cache is consumed (its buffers
        are donated to the update): use the returned cache, never the argument."""
        raise NotImplementedError

    def attention(self, query, cache, layout, plan, *, layer: int = 0, sinks=None,
                  out=None, return_lse=False):
        """Attention of the step's queries over the cache; ``(out, lse)`` if return_lse.

        ``sinks`` (1.1) overrides the plan's sinks for this layer; ``out`` (1.1), an array
        [T, Hq, Dv] of the query's dtype, receives the output in place where the framework
        allows (numpy, torch) and is returned."""
        raise NotImplementedError

    def asarray(self, x):
        """``x`` in this backend's framework (ABI 1.0 compatibility; the kit now uses
        :func:`kvabi.tensors.convert` with :attr:`framework`)."""
        return convert(x, self.framework, device=self.device())

    def to_numpy(self, x):
        return to_numpy(x)
