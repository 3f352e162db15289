"""The plugin registry: which attention backends exist here, and which were refused.

Backends come from pluggy plugins of the project ``kvabi``: the core ``reference`` plugin
(always loaded), the setuptools entry points of group ``kvabi`` (built-in and third-party
backends register the same way), and plugins registered programmatically with
:func:`register`.  The environment variable ``KVABI_PLUGINS`` (comma-separated entry-point
names) restricts which entry points load; unset loads all.

A plugin that fails to import, an entry point that loads but implements no kvabi hook, a
hook that raises, an object that is not a :class:`kvabi.Backend`, a backend built for
another ABI major version (the reason names both versions), a backend that overrides a
method the base class runs (``plan``, ``write_kv``, ``attention``...), and a second
backend with an already-taken name are all *refused*: kvabi keeps working, and the reason is listed by :func:`refused` and ``kvabi
backends`` and raised by :func:`get_backend`.

Mistakes that register nothing without failing are *warnings* (:func:`warnings`, listed by
``kvabi backends``): a ``kvabi_*`` function without ``@kvabi.hookimpl`` (pluggy ignores
it), a ``kvabi_*`` name that is no kvabi hook (``def kvabi_backend``: a misspelling), and a
``kvabi_backends`` hook that returns no backend.
"""
from __future__ import annotations

import difflib
import importlib.metadata
import inspect
import os
import re
import threading

import attrs
import pluggy

from ..util.errors import KVABIError
from ..util.version import ABI_VERSION
from .base import BOUNDARY, Backend
from .hookspecs import PROJECT, HookSpecs

#: the entry-point group (and pluggy project name) of kvabi plugins
ENTRY_POINT_GROUP = PROJECT
#: environment variable: comma-separated allow-list of entry-point names
ENV_ALLOW = "KVABI_PLUGINS"
#: name of the core plugin, loaded whatever the allow-list says
CORE_PLUGIN = "reference"

_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")


@attrs.frozen
class Refused:
    """A plugin or backend kvabi did not accept, and why.

    ``name`` is the backend name when known, else the plugin (entry-point) name;
    ``plugin`` is the plugin it came from.
    """

    name: str
    plugin: str
    reason: str


@attrs.frozen
class RegistryWarning:
    """Something in a plugin that looks meant for kvabi but registers nothing, and why."""

    plugin: str
    reason: str


#: the hooks a kvabi plugin may implement
HOOK_NAMES = tuple(n for n in vars(HookSpecs) if n.startswith(PROJECT + "_"))


def _marked(fn) -> bool:
    """Whether ``fn`` carries ``@kvabi.hookimpl`` (pluggy's marker attribute)."""
    return hasattr(fn, PROJECT + "_impl")


def plugin_problems(plugin) -> list[str]:
    """What in a plugin object looks meant for kvabi but registers nothing: ``kvabi_*``
    functions that are no kvabi hook (misspellings) or lack ``@kvabi.hookimpl``."""
    out = []
    for attr in sorted(dir(plugin)):
        if not attr.startswith(PROJECT + "_") or attr == PROJECT + "_impl":
            continue
        try:
            fn = getattr(plugin, attr)
        except Exception:  # noqa: BLE001 - a property of foreign code may raise
            continue
        if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            continue
        if attr not in HOOK_NAMES:
            close = difflib.get_close_matches(attr, HOOK_NAMES, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else \
                f" (kvabi hooks: {', '.join(HOOK_NAMES)})"
            out.append(f"{attr} is not a kvabi hook{hint}; it is never called")
        elif not _marked(fn):
            out.append(f"{attr} lacks @kvabi.hookimpl, so pluggy ignores it")
    return out


class _State:
    """The process-wide plugin manager and what it produced; rebuilt by :func:`reset`."""

    def __init__(self):
        self.pm: pluggy.PluginManager | None = None
        self.backends: dict[str, Backend] | None = None
        self.load_refused: list[Refused] = []  # plugins that failed to load/register
        self.backend_refused: list[Refused] = []  # from the last backend collection
        self.disabled: list[str] = []  # entry points left out by the allow-list
        self.load_warnings: list[RegistryWarning] = []  # from loading/registering plugins
        self.backend_warnings: list[RegistryWarning] = []  # from the last collection


_STATE = _State()
_LOCK = threading.RLock()


def allow_list() -> frozenset[str] | None:
    """Entry-point names allowed by ``KVABI_PLUGINS``, or None (all) when it is unset."""
    raw = os.environ.get(ENV_ALLOW)
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def _entry_point_names() -> list[str]:
    """Names of the ``kvabi`` entry points of the installed distributions, first seen first."""
    names: list[str] = []
    for dist in list(importlib.metadata.distributions()):
        for ep in dist.entry_points:
            if ep.group == ENTRY_POINT_GROUP and ep.name not in names:
                names.append(ep.name)
    return names


def _build() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    from . import reference_plugin

    # The core oracle is always present, even from a source tree without entry points;
    # registering it first makes pluggy skip the "reference" entry point.
    pm.register(reference_plugin, name=CORE_PLUGIN)
    allowed = allow_list()
    for name in _entry_point_names():
        if pm.has_plugin(name):
            continue
        if allowed is not None and name not in allowed:
            pm.set_blocked(name)
            _STATE.disabled.append(name)
            continue
        try:
            # One name at a time, so that one broken plugin cannot stop the others.
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        except Exception as e:  # noqa: BLE001 - any failure of foreign code is a refusal
            pm.set_blocked(name)  # do not retry it, and never half-register it
            _STATE.load_refused.append(Refused(name, name, f"plugin failed to load: "
                                               f"{type(e).__name__}: {e}"))
            continue
        _diagnose(pm, name)
    return pm


def _diagnose(pm: pluggy.PluginManager, name: str) -> None:
    """Record what a just-registered plugin does wrong: an entry point implementing no kvabi
    hook is refused (with the likely reason); misspelled or unmarked hooks are warnings."""
    plugin = pm.get_plugin(name)
    if plugin is None:
        return
    problems = plugin_problems(plugin)
    hooks = [h.name for h in (pm.get_hookcallers(plugin) or ()) if h.name in HOOK_NAMES]
    if not hooks:
        module = getattr(plugin, "__name__", type(plugin).__name__)
        why = "; ".join(problems) or "it defines no kvabi_backends function"
        _STATE.load_refused.append(Refused(name, name, f"plugin {module} loads but provides "
                                           f"no backend and implements no kvabi hook: {why}"))
        return
    _STATE.load_warnings.extend(RegistryWarning(name, p) for p in problems)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide pluggy manager (built on first use; :func:`reset` drops it)."""
    with _LOCK:
        if _STATE.pm is None:
            _STATE.pm = _build()
        return _STATE.pm


def reset() -> None:
    """Forget the manager, programmatic registrations and refusals (for tests)."""
    global _STATE
    with _LOCK:
        _STATE = _State()


def register(plugin, name: str | None = None) -> str:
    """Register a plugin object (module or instance with ``@kvabi.hookimpl`` methods).

    Returns the name it was registered under.  Raises :class:`KVABIError` when pluggy
    refuses it (name taken, already registered, hook signature not matching the spec).
    """
    with _LOCK:
        pm = plugin_manager()
        try:
            got = pm.register(plugin, name=name)
        except Exception as e:  # pluggy raises ValueError / PluginValidationError
            raise KVABIError(f"plugin: cannot register {name or plugin!r}: {e}") from e
        if got is None:
            raise KVABIError(f"plugin: {name!r} is blocked (not in {ENV_ALLOW}?)")
        _STATE.load_warnings.extend(RegistryWarning(got, p) for p in plugin_problems(plugin))
        _STATE.backends = None
        return got


def _check_backend(b, plugin: str) -> str | None:
    """Why backend object ``b`` is refused, or None."""
    if not isinstance(b, Backend):
        return f"not a kvabi.Backend: {type(b).__module__}.{type(b).__qualname__}"
    if not isinstance(b.name, str) or not _NAME_RE.fullmatch(b.name):  # no final "\n"
        return f"invalid backend name {b.name!r} (want dotted words, e.g. 'cuda.triton')"
    v = b.abi_version
    if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        return f"abi_version must be a (major, minor) tuple of non-negative ints, got {v!r}"
    if v[0] != ABI_VERSION[0]:
        return (f"built for kvabi ABI {v[0]}.{v[1]}, but this kvabi speaks ABI "
                f"{ABI_VERSION[0]}.{ABI_VERSION[1]} (major versions must match)")
    own = [m for m in BOUNDARY if getattr(type(b), m, None) is not getattr(Backend, m)]
    if own:
        return (f"overrides {', '.join(f'Backend.{m}' for m in own)}, which the base class "
                f"runs (its checks are every backend's); implement prepare, write and "
                f"attend instead")
    return None


def _collect() -> dict[str, Backend]:
    pm = plugin_manager()
    backends: dict[str, Backend] = {}
    refused: list[Refused] = []
    warned: list[RegistryWarning] = []
    # Call each plugin's hook separately so that one raising cannot hide the others;
    # get_hookimpls() lists them in registration order (the core plugin first).
    for impl in pm.hook.kvabi_backends.get_hookimpls():
        plugin = impl.plugin_name
        try:
            got = impl.function()
            items = list(got or ())
        except Exception as e:  # noqa: BLE001
            refused.append(Refused(plugin, plugin, f"kvabi_backends() raised "
                                   f"{type(e).__name__}: {e}"))
            continue
        if not items:
            warned.append(RegistryWarning(plugin, "kvabi_backends() returned no backend (a "
                                          "backend that cannot run here should still be "
                                          "returned, saying why in available())"))
        for b in items:
            name = getattr(b, "name", None)
            label = name if isinstance(name, str) and name else plugin
            why = _check_backend(b, plugin)
            if why is None and name in backends:
                why = f"duplicate backend name {name!r} (already provided by another plugin)"
            if why is not None:
                refused.append(Refused(label, plugin, why))
            else:
                backends[name] = b
    _STATE.backend_refused = refused
    _STATE.backend_warnings = warned
    return backends


def _backends() -> dict[str, Backend]:
    with _LOCK:
        if _STATE.backends is None:
            plugin_manager()
            _STATE.backends = _collect()
        return _STATE.backends


def all_backends() -> list[Backend]:
    """Every accepted backend (available here or not), the core ``reference`` first."""
    return list(_backends().values())


def backend_names() -> list[str]:
    """Names of every accepted backend, the core ``reference`` first."""
    return list(_backends())


def refused() -> list[Refused]:
    """Plugins and backends that were refused, with reasons."""
    _backends()
    return list(_STATE.load_refused) + list(_STATE.backend_refused)


def warnings() -> list[RegistryWarning]:
    """Plugin mistakes that register nothing without failing (see the module docstring)."""
    _backends()
    return list(_STATE.load_warnings) + list(_STATE.backend_warnings)


def disabled_plugins() -> list[str]:
    """Entry-point names left out by ``KVABI_PLUGINS``."""
    plugin_manager()
    return list(_STATE.disabled)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; :class:`KVABIError` if it is unknown or was refused."""
    backends = _backends()
    if name in backends:
        return backends[name]
    for r in refused():
        if r.name == name:
            raise KVABIError(f"backend: {name!r} was refused (plugin {r.plugin!r}): {r.reason}")
    msg = f"backend: no backend named {name!r}; known: {', '.join(backends) or '(none)'}"
    failed = [f"{r.name} ({r.reason})" for r in _STATE.load_refused]
    if failed:
        msg += f"; plugins that failed to load or provide nothing: {'; '.join(failed)}"
    warned = [f"{w.plugin}: {w.reason}" for w in warnings()]
    if warned:
        msg += f"; plugin warnings: {'; '.join(warned)}"
    if _STATE.disabled:
        msg += f"; not in {ENV_ALLOW}: {', '.join(_STATE.disabled)}"
    raise KVABIError(msg)
