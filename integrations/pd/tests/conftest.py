"""P/D between engines of different makes, each in its own environment, served as people
serve them: ``make test-pd`` (the core environment runs the tests and the transformers
server; vLLM's server runs from its own environment, ``KVABI_VLLM_PYTHON``)."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of vLLM's environment (``KVABI_VLLM_PYTHON``, else the checkout's
    ``.venv-vllm``)."""
    path = os.environ.get("KVABI_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    assert Path(path).exists(), (f"vLLM's environment is needed at {path} (make setup-vllm, "
                                 "or KVABI_VLLM_PYTHON)")
    return path
