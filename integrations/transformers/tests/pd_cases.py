"""Continuous-batching managers speaking P/D in this process (NIXL loopback), for the tests:
a tiny random Llama served on a kvabi backend and layout, requests added with their
``kv_transfer_params`` and their outputs awaited by id (every wait names what it waited
for)."""
import time

from transformers import GenerationConfig

import kvabi_transformers
from kvabi_transformers.tools.tiny_models import tiny_model

NEW_TOKENS = 8
WAIT_S = 180.0


def manager(backend, layout, block_size, *, dtype="float32", **pd):
    """A started manager of the tiny Llama (seed 1: every manager holds the same weights)
    on ``backend``/``layout``/``block_size``, P/D role kv_both with ``pd`` settings."""
    model = tiny_model("llama", layers=2, seed=1, dtype=dtype)
    kvabi_transformers.use(model, backend, layout, block_size=block_size, memory="4MiB",
                           pd={"kv_role": "kv_both", "kv_connector_extra_config": pd})
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    mgr = model.init_continuous_batching(generation_config=config)
    mgr.start()
    deadline = time.monotonic() + WAIT_S
    while mgr.connector is None:  # the loop makes its batch processor (and connector)
        assert time.monotonic() < deadline, f"{backend}: no batch processor within {WAIT_S} s"
        assert mgr.background_thread_status.fatal_error is None, \
            mgr.background_thread_status.fatal_error
        time.sleep(0.05)
    return mgr


def results(mgr, ids, what: str, timeout: float = WAIT_S) -> dict:
    """{request id: output} of requests ``ids`` of ``mgr``."""
    want, got = set(ids), {}
    deadline = time.monotonic() + timeout
    while want - set(got):
        left = deadline - time.monotonic()
        assert left > 0, f"{what}: no output within {timeout:g} s for {sorted(want - set(got))}"
        r = mgr.get_result(timeout=min(left, 1.0))
        if r is not None:
            got[r.request_id] = r
    return got


def generate(mgr, prompts, tag: str, *, params=None, max_new_tokens=NEW_TOKENS) -> dict:
    """Outputs by request id (``tag`` + index) of ``prompts`` on ``mgr``; ``params``: one
    ``kv_transfer_params`` per prompt (or None)."""
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        mgr.add_request(p, request_id=rid, max_new_tokens=max_new_tokens,
                        kv_transfer_params=None if params is None else params[i])
    return results(mgr, ids, f"{tag} on {mgr.integration.backend.name}")


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what}"
        time.sleep(0.05)


def idle(mgr) -> bool:
    """Whether ``mgr``'s connector and kvabi.pd hold nothing for any request."""
    sizes = mgr.connector.table_sizes()
    keep = ("peers", "pull_stats", "used_grants", "answers", "refusals")  # bounded history
    return all(v == 0 for k, v in sizes.items() if k not in keep)
