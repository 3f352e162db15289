"""Fixtures of the kvabi-transformers tests (cases live in tf_cases.py)."""
import logging
import os

# Triton's interpreter must be on before triton.language is first imported (transformers
# imports it); without a CUDA device kvabi-cuda runs its kernels there.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass

import pytest

pytest.importorskip("transformers")

from kvabi_transformers.session import Session  # noqa: E402

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture
def sessions(monkeypatch):
    """Every Session that begins a step, in order."""
    seen = []
    orig = Session.begin_step

    def begin_step(self, kwargs, skip):
        seen.append(self)
        return orig(self, kwargs, skip)

    monkeypatch.setattr(Session, "begin_step", begin_step)
    return seen
