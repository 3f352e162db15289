"""What the integration cannot serve fails at use(), naming the model, option or backend."""
import pytest
import kvabi
import kvabi_transformers
from kvabi.backend.reference import ReferenceBackend
from kvabi_transformers.tools.tiny_models import tiny_config, tiny_model

from tf_cases import model_of


class NoSinks(ReferenceBackend):
    """A backend that refuses attention sinks."""

    name = "vendor.nosinks"

    def capabilities(self, spec=None):
        import attrs

        return attrs.evolve(super().capabilities(spec), sinks=False)


def test_unknown_layout_names_it_and_the_supported_ones():
    with pytest.raises(kvabi.KVABIError, match=r"layout: tpu.jax does not support "
                       r"'flash_attn' for llama layers .*it supports tpu.combined"):
        kvabi_transformers.use(model_of("llama"), "tpu.jax", "flash_attn")


def test_dtype_the_backend_refuses():
    model = tiny_model("llama", layers=2, dtype="bfloat16")
    with pytest.raises(kvabi.UnsupportedError, match=r"llama layers .*cuda.triton: "
                       r"unsupported: dtype 'bfloat16'"):
        kvabi_transformers.use(model, "cuda.triton")


def test_sinks_the_backend_refuses():
    with pytest.raises(kvabi.UnsupportedError, match="gpt_oss .*attention sinks not supported"):
        kvabi_transformers.use(model_of("gpt_oss"), NoSinks())


def test_unavailable_backend():
    b = kvabi.get_backend("cuda.flashinfer")
    if b.available()[0]:
        pytest.skip("FlashInfer is available here")
    with pytest.raises(kvabi.KVABIError, match="backend: cuda.flashinfer is not available"):
        kvabi_transformers.use(model_of("llama"), "cuda.flashinfer")


def test_model_kvabi_cannot_read():
    import transformers as tf

    config = tiny_config("gemma4", layers=4)
    config.attention_k_eq_v = True
    model = tf.Gemma4ForCausalLM(config)
    with pytest.raises(kvabi.KVABIError, match="model: kvabi cannot read the 'gemma4_text' "
                       "config: attention_k_eq_v"):
        kvabi_transformers.use(model)


@pytest.mark.parametrize("bad, match", [
    (0, "must be >= 4, got 0"), (3, "must be >= 4, got 3"), (2.5, "must be an integer"),
    (8.0, "must be an integer"), (True, "must be an integer"), ("16", "must be an integer"),
    ([8], "must be an integer")])
def test_bad_block_size(bad, match):
    with pytest.raises(kvabi.KVABIError, match=f"^block_size: {match}"):
        kvabi_transformers.use(model_of("llama"), block_size=bad)


def test_numpy_and_torch_integer_block_sizes():
    """security.md: Python, numpy and torch integers are welcome wherever kvabi takes one."""
    import numpy as np
    import torch

    for size in (np.int64(8), np.int32(8), torch.tensor(8)):
        model = kvabi_transformers.use(model_of("llama"), block_size=size)
        bs = model._kvabi_integration.block_size
        assert bs == 8 and type(bs) is int


@pytest.mark.parametrize("size", [2**40, 2**62, 2**63 - 1])
def test_block_size_beyond_memory_is_refused_at_use_by_name(size):
    """One block of every layer must fit in the memory there is; named block_size (not the
    layout it would have failed in, nor a MemoryError in generate_batch)."""
    from kvabi_transformers.integration import memory_here

    model = model_of("llama")
    here, _ = memory_here(model)
    assert here is not None and here < 2**50  # this machine's RAM, as the OS states it
    with pytest.raises(kvabi.KVABIError, match=f"^block_size: {size} tokens per block: one "
                       f"block of every layer takes .* more than the {here} bytes"):
        kvabi_transformers.use(model, block_size=size)
    with pytest.raises(kvabi.KVABIError, match="^block_size: must be <= "):
        kvabi_transformers.use(model, block_size=2**63)


@pytest.mark.parametrize("field, factor", [("num_key_value_heads", 2),
                                           ("num_key_value_heads", 0.5),
                                           ("num_attention_heads", 2)])
def test_config_heads_against_the_modules(field, factor):
    """A config that disagrees with the modules it built fails at use(), naming the field."""
    model = model_of("llama")
    setattr(model.config, field, int(getattr(model.config, field) * factor))
    with pytest.raises(kvabi.KVABIError, match=f"^(model: kvabi cannot read .*)?{field}: "):
        kvabi_transformers.use(model)


def test_a_backend_that_implements_nothing():
    with pytest.raises(kvabi.KVABIError, match="^backend: Backend does not implement "
                       "capabilities, preferred_layouts, write, attend$"):
        kvabi_transformers.use(model_of("llama"), kvabi.Backend())

    class Half(kvabi.Backend):
        name = "vendor.half"

        def capabilities(self, spec=None):
            return ReferenceBackend().capabilities(spec)

        def preferred_layouts(self, spec):
            return ("flash_attn",)

    with pytest.raises(kvabi.KVABIError, match="^backend: vendor.half does not implement "
                       "write, attend$"):
        kvabi_transformers.use(model_of("llama"), Half())


def test_bad_backend_and_kv_dtype():
    with pytest.raises(kvabi.KVABIError, match="no-such-backend"):
        kvabi_transformers.use(model_of("llama"), "no-such-backend")
    with pytest.raises(kvabi.KVABIError, match="kv_dtype"):
        kvabi_transformers.use(model_of("llama"), kv_dtype="float64")


def test_kvabi_attention_outside_continuous_batching():
    import torch

    model = kvabi_transformers.use(model_of("llama"))
    model.set_attn_implementation("kvabi")
    with pytest.raises(kvabi.KVABIError, match="generate_batch"):
        model(torch.tensor([[5, 6, 7]]))


def test_memory_that_holds_nothing_fails_at_use():
    with pytest.raises(kvabi.KVABIError, match="memory_bytes: must hold one block"):
        kvabi_transformers.use(model_of("llama"), memory="1KiB")


def test_memory_too_small_for_the_longest_request():
    from kvabi_transformers.tools.compare import cb_config, greedy_config

    model = kvabi_transformers.use(model_of("llama"), block_size=4, memory="4KiB")
    with pytest.raises(kvabi.KVABIError, match=r"memory: 4096 bytes hold \d+ blocks of 4 "
                       r"tokens per layer, but a request of 106 tokens needs 27"):
        model.generate_batch(inputs=[[5] * 100], generation_config=greedy_config(6),
                             continuous_batching_config=cb_config())


def test_not_a_transformers_model_and_non_bool_option():
    import torch

    with pytest.raises(kvabi.KVABIError, match="model: must be a transformers causal LM .*"
                       "got Linear"):
        kvabi_transformers.use(torch.nn.Linear(2, 2))
    with pytest.raises(kvabi.KVABIError, match="prefill_skip: must be true or false, got 'yes'"):
        kvabi_transformers.use(model_of("gemma4"), prefill_skip="yes")
    with pytest.raises(kvabi.KVABIError, match="layout: reference does not support 7"):
        kvabi_transformers.use(model_of("llama"), layout=7)
