"""vLLM general plugin (entry point group ``vllm.general_plugins``): runs in every vLLM process.
A no-op unless ``KVABI_VLLM_BACKEND`` names a kvabi backend."""
from __future__ import annotations


def register() -> None:
    # Filled in by the attention-backend plugin work.
    return None
