"""Start vLLM in this process, on its own CPU attention or on a kvabi backend, and generate
greedy token ids (tests, demo, benchmark).

vLLM's CPU build needs ``VLLM_CPU_KVCACHE_SPACE`` (it otherwise sizes the cache from the
NUMA node's memory and fails its utilisation check on a small machine), and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps engine core and worker in this process (seconds
to start instead of tens, and the attention backend chosen here reaches the worker).  Callers
that start vLLM must sit under an ``if __name__ == "__main__":`` guard: the CPU platform
spawns.
"""
from __future__ import annotations

import contextlib
import gc
import os
import time

from kvabi.util.errors import KVABIError

from ..startup import ENV_BACKEND, ENV_LAYOUT
#: Environment every in-process engine here runs with (set unless already set).
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def setup_env(quiet: bool = False) -> None:
    """Set :data:`ENGINE_ENV` where the caller has not; ``quiet``: vLLM logs errors only
    (its log goes to stdout, where a report or JSON is printed)."""
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    if quiet:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def use_backend(backend: str | None, layout: str | None = None) -> None:
    """Route vLLM's attention in this process to kvabi ``backend`` (None: vLLM's own CPU
    attention), optionally on vLLM layout name ``layout``; takes effect at the next engine
    start.  Sets or clears ``KVABI_VLLM_BACKEND``/``KVABI_VLLM_LAYOUT`` and the registry
    entry, and drops vLLM's cached backend choice."""
    from vllm.v1.attention import selector

    from .. import vllm_plugin

    for var, val in ((ENV_BACKEND, backend), (ENV_LAYOUT, layout)):
        if val:
            os.environ[var] = val
        else:
            os.environ.pop(var, None)
    if backend:
        vllm_plugin.register()
    else:
        vllm_plugin.unregister()
    selector._cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def engine(model_dir, *, backend: str | None = None, layout: str | None = None,
           block_size: int = 32, fast_prefill: bool = False, max_model_len: int = 512,
           max_num_seqs: int = 16, **llm_kwargs):
    """An in-process ``vllm.LLM`` over checkpoint ``model_dir`` (float32, no tokenizer,
    eager), attention on kvabi ``backend`` or vLLM's own (None); shut down on exit."""
    setup_env()
    use_backend(backend, layout)
    from vllm import LLM

    kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                  block_size=block_size, max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, enforce_eager=True, seed=0,
                  enable_prefix_caching=True)
    if fast_prefill:
        kwargs["kv_sharing_fast_prefill"] = True
    kwargs.update(llm_kwargs)
    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def set_kv_scales(model, pairs) -> int:
    """Give the vLLM attention layers of ``model`` per-tensor KV scales ``pairs`` (``(k, v)``
    per layer, cycled), held as a checkpoint's loaded ``k_scale``/``v_scale`` are; returns
    how many layers.  Run it on an engine's model (``llm.apply_model``), or as the model
    loads (:func:`scales_at_load`) so that a KV connector sees them."""
    from vllm.model_executor.layers.attention import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for i, m in enumerate(layers):
        k, v = (float(x) for x in pairs[i % len(pairs)])
        m._k_scale.fill_(k)
        m._v_scale.fill_(v)
        m._k_scale_float, m._v_scale_float = k, v
    return len(layers)


def scales_at_load(pairs) -> None:
    """In this process, every CPU engine's model gets :func:`set_kv_scales` ``pairs`` right
    after its weights load (before its KV cache and connector are made)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load = CPUModelRunner.load_model

    def load_model(self, *args, **kwargs):
        load(self, *args, **kwargs)
        set_kv_scales(self.model, pairs)

    CPUModelRunner.load_model = load_model


def greedy(llm, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    """Greedy continuations (token ids) of ``prompts`` (token id lists), EOS ignored."""
    from vllm import SamplingParams

    if not prompts or not all(isinstance(p, list) and p for p in prompts):
        raise KVABIError("prompts: must be a non-empty list of non-empty token id lists")
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate(model_dir, prompts, *, max_tokens: int = 16, **engine_kwargs):
    """Start an engine (:func:`engine`), generate greedily, shut it down; returns
    (token ids, seconds spent generating)."""
    with engine(model_dir, **engine_kwargs) as llm:
        t = time.perf_counter()
        out = greedy(llm, prompts, max_tokens)
        return out, time.perf_counter() - t
