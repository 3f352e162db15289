"""``use()`` leaves the model as it was when it refuses, and a failed ``generate_batch``
leaves the model's own attention in place: plain ``generate()`` still gives the tokens it
gave before ``use()``."""
import pytest
import torch
import kvabi
import kvabi_transformers
from kvabi.backend.reference import ReferenceBackend
from kvabi_transformers.tools.compare import cb_config, run_batch
from kvabi_transformers.tools.tiny_models import tiny_prompts

from tf_cases import model_of, model_state

IDS = torch.tensor([[5, 6, 7, 8, 9]])


def _generate(model):
    return model.generate(IDS, max_new_tokens=4, do_sample=False)


class NoMemory(ReferenceBackend):
    """Fails where the caches are allocated (inside transformers' warmup)."""

    name = "vendor.nomemory"

    def allocate(self, layout):
        raise MemoryError("no memory for the cache")


class BrokenAttention(ReferenceBackend):
    """Fails in the first attention call (inside the generation loop)."""

    name = "vendor.brokenattention"

    def attend(self, **kwargs):
        raise kvabi.KVABIError("attention: broken on purpose")


@pytest.mark.parametrize("kwargs", [dict(block_size=2**40), dict(block_size=3),
                                    dict(backend=kvabi.Backend()), dict(memory="1KiB"),
                                    dict(layout="no-such-layout")])
def test_a_refused_use_changes_nothing(kwargs):
    model = model_of("llama")
    before = model_state(model)
    with pytest.raises(kvabi.KVABIError):
        kvabi_transformers.use(model, **kwargs)
    assert model_state(model) == before
    used = kvabi_transformers.use(model)  # an earlier integration survives a refusal too
    before = model_state(used)
    with pytest.raises(kvabi.KVABIError):
        kvabi_transformers.use(used, **kwargs)
    assert model_state(used) == before


@pytest.mark.parametrize("backend, error", [(NoMemory(), MemoryError),
                                            (BrokenAttention(), RuntimeError)])
def test_generate_still_works_after_a_failed_run(backend, error):
    model = model_of("llama")
    attn = model.config._attn_implementation
    want = _generate(model)
    kvabi_transformers.use(model, backend)
    with pytest.raises(error):
        run_batch(model, tiny_prompts(2), 3, config=cb_config())
    assert model.config._attn_implementation == attn
    assert torch.equal(_generate(model), want)


def test_a_workload_beyond_memory_is_refused_before_the_switch(monkeypatch):
    model = kvabi_transformers.use(model_of("llama"))
    attn = model.config._attn_implementation
    integration = model._kvabi_integration
    monkeypatch.setattr(integration, "memory_here", 10_000)
    with pytest.raises(kvabi.KVABIError, match=r"^memory: the KV cache would take \d+ bytes, "
                       "more than the 10000 bytes of this machine's RAM"):
        model.generate_batch(inputs=tiny_prompts(3), max_new_tokens=4,
                             continuous_batching_config=cb_config(num_blocks=None))
    assert model.config._attn_implementation == attn
