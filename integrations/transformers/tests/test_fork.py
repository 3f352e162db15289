"""Forked requests (num_return_sequences) get their parent's K/V: transformers copies its
bookkeeping rows, kvabi copies the blocks in its own caches (any layout, any framework)."""
import pytest
import kvabi
import kvabi_transformers
from kvabi_transformers.tools.compare import cb_config

from tf_cases import model_of, prompts

_WANT = {}


def config():
    from transformers import GenerationConfig

    # top_k=1 sampling is greedy, and lets transformers fork each prompt into two requests
    return GenerationConfig(max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=-1,
                            pad_token_id=0, num_return_sequences=2)


def tokens(model):
    out = model.generate_batch(inputs=prompts(), generation_config=config(),
                               continuous_batching_config=cb_config())
    return {k: list(v.generated_tokens) for k, v in out.items()}


@pytest.mark.parametrize("backend,layout", [("reference", "vllm.BLHNC"),
                                            ("tpu.jax", "tpu.combined")])
def test_forked_children_match_transformers(backend, layout):
    ok, why = kvabi.get_backend(backend).available()
    if not ok:
        pytest.skip(why)
    if "llama" not in _WANT:
        _WANT["llama"] = tokens(model_of("llama"))
    want = _WANT["llama"]
    assert len(want) == 2 * len(prompts())
    model = kvabi_transformers.use(model_of("llama"), backend, layout, block_size=4)
    assert tokens(model) == want
