"""vLLM's own engine, scheduler, block manager and model code, attention on kvabi backends:
greedy tokens identical to vLLM's own CPU attention for four model families, each kvabi
backend on two block sizes, and Gemma 3n's KV-shared layers with and without
``kv_sharing_fast_prefill`` (kvabi's prefill skip).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one at a time; vLLM's
own tokens are computed once per model and shared."""
import pytest

import kvabi
from kvabi_vllm.tools import checkpoints as ck
from kvabi_vllm.tools import engine as E
from kvabi_vllm.attention import STATS

BACKENDS = ("reference", "example.torch", "cpu.vllm")
BLOCK_SIZES = (32, 64)  # vLLM's CPU kernels take multiples of 32
PROMPTS = ck.prompts(4)
MAX_TOKENS = 12
_native: dict = {}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: ck.write_checkpoint(f, root / f) for f in ck.FAMILIES}


def native(models, family, **kw):
    """vLLM's own CPU attention (no kvabi): the tokens every kvabi run must reproduce."""
    key = (family, tuple(sorted(kw.items())))
    if key not in _native:
        _native[key], _ = E.generate(models[family], PROMPTS, max_tokens=MAX_TOKENS,
                                     backend=None, **kw)
    return _native[key]


def needs(backend):
    if backend not in kvabi.backend_names():
        pytest.skip(f"{backend} is not registered in this environment")


@pytest.mark.parametrize("family", ck.FAMILIES)
def test_checkpoints_give_varied_continuations(models, family):
    out = native(models, family)
    assert ck.distinct_tokens(out) >= 4, out  # a repeated token would compare nothing
    assert len({tuple(o) for o in out}) == len(out)


def test_the_window_shows_in_the_tokens(models):
    """Negative control: the Mistral-like checkpoint is the Llama-like one plus a sliding
    window, and their tokens differ, so a backend ignoring the window fails the tests."""
    assert native(models, "mistral") != native(models, "llama")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("family", ck.FAMILIES)
def test_greedy_tokens_equal_vllms_own(models, family, block_size, backend):
    needs(backend)
    plans = STATS["plans"]
    out, _ = E.generate(models[family], PROMPTS, max_tokens=MAX_TOKENS, backend=backend,
                        block_size=block_size)
    assert STATS["plans"] > plans, "kvabi planned nothing: vLLM ran its own attention"
    assert out == native(models, family)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma3n_fast_prefill_is_kvabi_prefill_skip(models, backend):
    needs(backend)
    dropped = STATS["prefill_skip_tokens_dropped"]
    out, _ = E.generate(models["gemma3n"], PROMPTS, max_tokens=MAX_TOKENS, backend=backend,
                        fast_prefill=True)
    assert STATS["prefill_skip_tokens_dropped"] > dropped, "prefill skip dropped no token"
    assert out == native(models, "gemma3n")
    assert native(models, "gemma3n", fast_prefill=True) == out


@pytest.mark.parametrize("backend, reason", [("no.such", "KVABI_VLLM_BACKEND=no.such: not a"),
                                              ("tpu.jax", "fits vLLM's KV cache")])
def test_an_unservable_backend_fails_at_engine_start(models, backend, reason):
    if backend != "no.such":
        needs(backend)
    with pytest.raises(kvabi.KVABIError, match=reason):
        with E.engine(models["llama"], backend=backend):
            pytest.fail("the engine started")


def test_a_bfloat16_model_runs_on_the_numpy_reference(models):
    """vLLM hands bfloat16 tensors, which torch cannot give numpy: the plugin views them as
    ml_dtypes bfloat16 (it failed at the first forward)."""
    plans = STATS["plans"]
    out, _ = E.generate(models["llama"], PROMPTS, max_tokens=MAX_TOKENS, backend="reference",
                        dtype="bfloat16")
    assert STATS["plans"] > plans
    assert all(len(o) == MAX_TOKENS for o in out) and ck.distinct_tokens(out) > 1, out
