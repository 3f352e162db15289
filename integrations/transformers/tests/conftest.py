"""Shared fixtures: tiny models and transformers' own continuous-batching results."""
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

from kvabi_transformers.compare import cb_config, run_batch  # noqa: E402
from kvabi_transformers.session import Session  # noqa: E402
from kvabi_transformers.tiny_models import tiny_model, tiny_prompts  # noqa: E402

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
logging.getLogger("transformers").setLevel(logging.ERROR)

NEW_TOKENS = 6
#: layers per family: Gemma 4 needs owners of both kinds before its KV-shared half
LAYERS = {"llama": 2, "mistral": 2, "gpt_oss": 2, "gemma4": 4}
_BASELINES: dict = {}


def prompts():
    """7 prompts of 3..29 tokens (window 8: most are longer), three sharing a prefix."""
    return tiny_prompts(7)


def model_of(family):
    return tiny_model(family, layers=LAYERS[family], seed=1)


def baseline(family):
    """transformers' own generate_batch (its default CB attention) on the tiny model."""
    if family not in _BASELINES:
        _BASELINES[family] = run_batch(model_of(family), prompts(), NEW_TOKENS,
                                       config=cb_config())
    return _BASELINES[family]


@pytest.fixture
def family_baseline():
    return baseline


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
