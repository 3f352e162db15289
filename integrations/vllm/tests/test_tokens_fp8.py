"""vLLM's engine with an fp8 KV cache (``kv_cache_dtype="fp8"``, per-tensor scales) on kvabi
backends: greedy tokens identical to vLLM's own fp8 run on its CPU attention.

Each attention layer gets its own static scales (set on vLLM's layers as a checkpoint's
``k_scale``/``v_scale`` would), so the tokens show that every layer's scales reach kvabi's
writes and reads: vLLM's own run with other scales, and its unquantized run, give other
tokens (negative controls).  The reference and cpu.vllm write vLLM's own rounding (toward
zero), so their caches hold vLLM's own bytes."""
import functools

import pytest

from kvabi_vllm.attention import STATS
from kvabi_vllm.tools import checkpoints as ck
from kvabi_vllm.tools import engine as E

PROMPTS = ck.prompts(4)
MAX_TOKENS = 12
#: per layer (key scale, value scale): generic values, every layer its own
SCALES = ((0.031, 0.043), (0.057, 0.027), (0.022, 0.061), (0.049, 0.035))


def run(model_dir, backend, *, scales=True, kv_cache_dtype="fp8"):
    with E.engine(model_dir, backend=backend, kv_cache_dtype=kv_cache_dtype) as llm:
        if scales:
            assert llm.apply_model(functools.partial(E.set_kv_scales, pairs=SCALES)) == [4]
        return E.greedy(llm, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return ck.write_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama")


@pytest.fixture(scope="module")
def own(llama):
    return run(llama, None)


def test_scales_and_fp8_show_in_vllms_own_tokens(llama, own):
    assert ck.distinct_tokens(own) >= 4, own
    assert run(llama, None, scales=False) != own  # the scales matter
    assert run(llama, None, scales=False, kv_cache_dtype="auto") != own  # fp8 matters


@pytest.mark.parametrize("backend", ["reference", "cpu.vllm"])
def test_fp8_tokens_equal_vllms_own(llama, own, backend):
    plans = STATS["plans"]
    out = run(llama, backend)
    assert STATS["plans"] > plans, "kvabi planned nothing: vLLM ran its own attention"
    assert out == own
