"""kvabi-transformers checks each cache it makes with kvabi.probe.verify_layout: a backend
whose kernel writes another order than its layout declares is refused before any token."""
import numpy as np
import pytest

import kvabi
import kvabi_transformers
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing.writers import layout_writer
from kvabi_transformers.tools.compare import cb_config, run_batch

from tf_cases import model_of, prompts


class Liar(ReferenceBackend):
    """Declares vllm.LBHNC but writes each block-head as all keys then all values."""

    name = "reference"

    def write(self, plan, cache, key, value, layer):
        layout = plan.layout
        real = kvabi.Layout(order=("L", "B", "H", "KV", "N", "D"), sizes=layout.sizes,
                            dtype=layout.dtype)
        layout_writer(real, list(cache))(layer, plan.meta.slot_mapping, np.asarray(key),
                                         np.asarray(value))
        return cache


def test_lying_backend_refused_when_the_cache_is_made():
    model = kvabi_transformers.use(model_of("llama"), Liar(), "vllm.LBHNC")
    with pytest.raises(kvabi.KVABIError, match=r"^value of layer 0, block 0, token 0, head 0, "
                       r"dim 0 found \d+ bytes from where vllm.LBHNC puts it"):
        run_batch(model, prompts()[:1], 2, config=cb_config())
