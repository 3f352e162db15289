"""kvabi-vllm's environment: the kvabi variables (``KVABI_VLLM_BACKEND``,
``KVABI_VLLM_LAYOUT``) read and checked, the refusal type of every configuration check, and
logging through vLLM's handlers.  The bottom of kvabi_vllm: it imports nothing of vLLM."""
from __future__ import annotations

import logging
import os

import kvabi
from kvabi.util.errors import KVABIError

# a child of vLLM's logger: its handler, format and level apply, and vLLM's command line,
# which reconfigures logging and disables the loggers it does not know, keeps it
log = logging.getLogger("vllm.kvabi")

#: The kvabi backend vLLM's attention runs on (unset: the plugin changes nothing).
ENV_BACKEND = "KVABI_VLLM_BACKEND"
#: Optional: one of vLLM's six layout names to allocate (default: the backend's first fit).
ENV_LAYOUT = "KVABI_VLLM_LAYOUT"
#: vLLM's CPU worker: GiB of KV cache (unset: a fraction of the NUMA node's memory).
ENV_SPACE = "VLLM_CPU_KVCACHE_SPACE"
#: vLLM's six layout names (kvabi_vllm.layouts.VLLM_LAYOUTS; here without importing kvabi's
#: layout code into every vLLM process that only checks the environment).
VLLM_LAYOUTS = ("LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC")
CONNECTOR = "KvabiConnector"


class ConfigError(KVABIError):
    """A configuration kvabi-vllm refuses at engine start; the message names the variable
    or option, its value and the fix."""


def _registered() -> str:
    return ", ".join(kvabi.backend_names()) or "(none)"


def backend_from_env(environ=None) -> str | None:
    """The kvabi backend named by ``KVABI_VLLM_BACKEND`` (None: unset, vLLM's own
    attention), after checking both kvabi variables; :class:`ConfigError` otherwise."""
    env = os.environ if environ is None else environ
    name, layout = env.get(ENV_BACKEND), env.get(ENV_LAYOUT)
    if name is not None and not name.strip():
        raise ConfigError(f"{ENV_BACKEND}: set but empty; name a kvabi backend "
                          f"({_registered()}) or unset it for vLLM's own attention")
    if layout is not None and layout not in VLLM_LAYOUTS:
        raise ConfigError(f"{ENV_LAYOUT}={layout!r}: not one of vLLM's layout names "
                          f"{', '.join(VLLM_LAYOUTS)}; set one of them or unset it (the "
                          f"backend's first preferred layout is used)")
    if name is None:
        if layout is not None:
            raise ConfigError(f"{ENV_LAYOUT}={layout}: takes effect only with {ENV_BACKEND}; "
                              f"set {ENV_BACKEND} to a kvabi backend ({_registered()}), or "
                              f"unset {ENV_LAYOUT} (vLLM's own attention takes its layout "
                              f"from VLLM_KV_CACHE_LAYOUT)")
        return None
    backend_of(name)
    return name


def backend_of(name: str) -> kvabi.Backend:
    """The registered, available kvabi backend ``name``, as ``KVABI_VLLM_BACKEND`` names it;
    :class:`ConfigError` naming the variable otherwise."""
    try:
        backend = kvabi.get_backend(name)
    except KVABIError as e:
        # the registry's message says more only when a plugin was refused or failed
        why = "" if str(e).endswith(f"known: {_registered()}") else f" ({e})"
        raise ConfigError(f"{ENV_BACKEND}={name}: not a kvabi backend registered here"
                          f"{why}; set it to one of {_registered()} (`kvabi backends` "
                          f"lists them with their capabilities)") from None
    ok, why = backend.available()
    if not ok:
        raise ConfigError(f"{ENV_BACKEND}={name}: not available here: {why}; choose "
                          f"another backend (`kvabi backends`)")
    return backend


_said: set[str] = set()


def say_once(message: str, *args) -> None:
    """Log ``message`` at INFO once per process (an in-process engine is main process and
    worker at once)."""
    text = message % args if args else message
    if text not in _said:
        _said.add(text)
        log.info(text)


def log_with_vllm() -> None:
    """Let kvabi-vllm's module loggers (``kvabi_vllm.*``, e.g. the connector's) write
    through vLLM's handlers, in vLLM's format and at its level (``VLLM_LOGGING_LEVEL``): a
    vLLM process configures only its own logger, so their INFO lines went nowhere."""
    ours, theirs = logging.getLogger("kvabi_vllm"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)
