"""Greedy tokens and per-step logits of generate_batch through kvabi backends equal
transformers' own continuous batching (its default attention) on tiny random models."""
import pytest
import kvabi
import kvabi_transformers
from kvabi_transformers.tools.compare import cb_config, run_batch, worst_step_error

from tf_cases import NEW_TOKENS, baseline, model_of, prompts

#: float32 logits after a few layers: attention agrees to ~1e-6 relative (specs/
#: conformance.md: 1e-5); per-step logits carry that through the MLPs and the LM head.
LOGITS_TOL = 1e-5

CASES = [
    # backend, family, layout (None: the backend's preferred one)
    ("reference", "llama", None), ("reference", "llama", "vllm.BLHNC"),
    ("reference", "mistral", "flashinfer.HND"), ("reference", "mistral", "kvbm.fully_contiguous"),
    ("reference", "gpt_oss", None), ("reference", "gpt_oss", "vllm.LBHNC"),
    ("reference", "gemma4", None), ("reference", "gemma4", "vllm.BLHNC"),
    ("tpu.jax", "gemma4", "tpu.combined"), ("tpu.jax", "gpt_oss", "tpu.hidden"),
    ("tpu.jax", "mistral", "tpu.combined"),
    ("cuda.triton", "llama", "flash_attn"), ("cuda.triton", "llama", "vllm.BLHNC"),
    ("cuda.triton", "gemma4", "flashinfer.NHD"), ("cuda.triton", "gpt_oss", None),
    ("tpu.pallas", "llama", "tpu.combined"), ("tpu.pallas", "llama", "tpu.hidden"),
]


def _available(name):
    ok, why = kvabi.get_backend(name).available()
    if not ok:
        pytest.skip(f"{name}: {why}")


def test_baselines_vary():
    # A comparison of constant continuations would prove nothing.
    for family in ("llama", "mistral", "gpt_oss", "gemma4"):
        tokens, _ = baseline(family)
        assert len({t for seq in tokens for t in seq}) > 5, (family, tokens)
        assert len({tuple(seq) for seq in tokens}) == len(tokens), (family, tokens)


@pytest.mark.parametrize("backend,family,layout", CASES)
def test_tokens_and_logits_match_transformers(backend, family, layout):
    _available(backend)
    want_tokens, want_logits = baseline(family)
    model = kvabi_transformers.use(model_of(family), backend, layout)
    tokens, logits = run_batch(model, prompts(), NEW_TOKENS, config=cb_config())
    assert tokens == want_tokens
    err = worst_step_error(logits, want_logits)
    assert err <= LOGITS_TOL, f"{backend} {family} {layout}: logits relative error {err:.3g}"


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma4"])
def test_chunked_prefill_and_prefix_sharing(family, sessions):
    # 16 tokens per step: prompts are prefilled in chunks longer than the window (8) with
    # cached context; 4-token blocks let later requests reuse the shared prefix's blocks
    # where transformers shares them (full attention only).
    config = cb_config(max_batch_tokens=16, num_blocks=128, page_size=4)
    want_tokens, want_logits = run_batch(model_of(family), prompts(), NEW_TOKENS,
                                         config=config)
    model = kvabi_transformers.use(model_of(family), "reference", "vllm.BLHNC", block_size=4)
    tokens, logits = run_batch(model, prompts(), NEW_TOKENS, config=config)
    assert tokens == want_tokens
    assert worst_step_error(logits, want_logits) <= LOGITS_TOL
    computed = sessions[-1].stats["tokens"]
    total = sum(map(len, prompts())) + len(prompts()) * (NEW_TOKENS - 1)
    if family == "llama":  # two later requests reused the three blocks of the prefix
        assert computed == total - 2 * 12
    else:
        assert computed == total


def test_generate_with_paged_cache_goes_through_kvabi(sessions):
    # transformers routes generate(cache_implementation="paged") to generate_batch
    import torch

    want = baseline("gemma4")[0]
    model = kvabi_transformers.use(model_of("gemma4"), "reference", prefill_skip=True)
    for i in (0, 5):
        p = prompts()[i]
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             cache_implementation="paged", eos_token_id=-1, pad_token_id=0)
        assert out.reshape(-1)[len(p):].tolist() == want[i]
        assert sessions[-1].stats["steps"] == NEW_TOKENS


def test_bfloat16_cache_of_a_float32_model():
    # kv_dtype stores K/V in bfloat16: the prefill step's logits are within bfloat16 rounding
    # (about 2**-8 relative per stored value) of transformers' float32 cache, and two
    # backends holding the same bfloat16 cache agree with each other to float32 precision.
    _available("tpu.jax")
    want_tokens, want_logits = baseline("llama")
    runs = []
    for backend in ("reference", "tpu.jax"):
        model = kvabi_transformers.use(model_of("llama"), backend, kv_dtype="bfloat16")
        assert {g.spec.dtype for g in model._kvabi_integration.model_kv.groups} == {"bfloat16"}
        runs.append(run_batch(model, prompts(), NEW_TOKENS, config=cb_config()))
    (ref_tokens, ref_logits), (jax_tokens, jax_logits) = runs
    assert 1e-4 < worst_step_error(ref_logits[:1], want_logits[:1]) <= 2e-2
    assert jax_tokens == ref_tokens
    assert worst_step_error(jax_logits, ref_logits) <= LOGITS_TOL
