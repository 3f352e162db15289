"""vLLM general plugin (entry point group ``vllm.general_plugins``): runs in every vLLM
process (main, engine core, worker).  Unless ``KVABI_VLLM_BACKEND`` names a kvabi backend it
changes nothing in vLLM; then vLLM's attention runs on that backend
(:mod:`kvabi_vllm.attention`).  Either way it checks the kvabi variables and, where vLLM
builds its configuration, what kvabi is asked to serve (:mod:`kvabi_vllm.startup`)."""
from __future__ import annotations

import sys

from .env import backend_from_env, log_with_vllm
from .startup import install

BACKEND_CLASS = "kvabi_vllm.attention.KvabiAttentionBackend"


def register() -> None:
    """Route vLLM's attention to kvabi when ``KVABI_VLLM_BACKEND`` is set.

    vLLM's CPU platform ignores a user-selected attention backend and always takes
    ``CPU_ATTN``, so the plugin replaces that entry (and ``CUSTOM``, for platforms that
    honour a selection); the backend is read again when an engine starts.  A kvabi variable
    set wrong raises :class:`~kvabi_vllm.env.ConfigError` here, before vLLM builds its
    configuration."""
    if "vllm.logger" in sys.modules:
        log_with_vllm()
    if "vllm.engine.arg_utils" in sys.modules:  # this process builds an engine config
        install()
    if backend_from_env() is None:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_CLASS)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)


def unregister() -> None:
    """Give ``CPU_ATTN`` and ``CUSTOM`` back to vLLM (for switching in one process)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM):
        if _ATTN_OVERRIDES.get(member) == BACKEND_CLASS:
            member.clear_override()
