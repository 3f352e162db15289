"""transformers' continuous batching under the P/D conformance kit
(``kvabi conformance --pd kvabi_transformers.tools.pd_kit:TransformersEngine``,
:class:`kvabi.testing.PDConformance`): the kit's harness over a manager serving a tiny random
Llama on a kvabi backend, speaking P/D through :mod:`kvabi_transformers.connector`.

The harness reads, never changes, what the adapter does: the KV a consumer received is read
when its pull arrived (before the request computes anything), the KV a producer holds where
transformers' allocator keeps the held request's blocks, both through the layout the adapter
serves.  ``planted`` plants a fault in the adapter (the kit must catch it):
``shifted_blocks`` (a consumer tells kvabi.pd the block after each of its own) or
``early_free`` (a producer frees a held request's blocks at once).
"""
from __future__ import annotations

import time

from transformers import GenerationConfig

from kvabi.pd import ASK, token_slots
from kvabi.testing.pd import EngineUnderTest, ModelFacts, Outcome, kv_values

from .. import use
from ..connector import PDOptions, model_identity
from ..connector.producer import HELD
from .tiny_models import tiny_model

PLANTED = ("shifted_blocks", "early_free")
#: seconds a decode waits beyond the pull deadline
SLACK = 20.0


class TransformersEngine(EngineUnderTest):
    """The kit's harness over transformers' continuous batching on ``backend``/``layout``
    with ``block_size``-token blocks (see the module docstring)."""

    def __init__(self, backend: str = "example.torch", layout: str | None = "flash_attn",
                 block_size: int = 32, dtype: str = "float32", planted: str | None = None):
        if planted not in (None,) + PLANTED:
            raise ValueError(f"planted: one of {PLANTED}, got {planted!r}")
        self.backend, self.layout, self.block_size = backend, layout, block_size
        self.dtype, self.planted = dtype, planted
        self.name = f"transformers({backend}, {layout}, {block_size}-token blocks" + \
            (f", {planted})" if planted else ")")
        self._model = tiny_model("llama", layers=2, seed=1, dtype=dtype)
        self._mgr = None
        self._seen: dict = {}   # consumer: request id -> KV at arrival

    def facts(self) -> ModelFacts:
        return ModelFacts(windows=(None,), num_layers=2, num_kv_heads=2, head_dim=16,
                          dtype=self.dtype, vocab=128, block_size=self.block_size,
                          max_tokens=512, model_id=model_identity(self._model.config))

    # -- life ------------------------------------------------------------------------------
    def start(self, role: str, settings) -> None:
        import attrs

        s = attrs.evolve(settings, role=role)
        use(self._model, self.backend, self.layout, block_size=self.block_size, memory="4MiB",
            pd=PDOptions(s, max_model_len=512))
        config = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=-1,
                                  pad_token_id=0)
        self._mgr = self._model.init_continuous_batching(generation_config=config)
        self._mgr.start()
        deadline = time.monotonic() + 120
        while self._mgr.connector is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no connector within 120 s")
            time.sleep(0.02)
        self._instrument(self._mgr.connector)

    def stop(self) -> None:
        if self._mgr is not None:
            self._mgr.stop(block=True, timeout=30)
            self._mgr = None

    def _instrument(self, conn) -> None:
        resume = conn.consumer.resume

        def seen(state, n):  # the KV as it arrived, before anything is computed on it
            self._seen[state.request_id] = self._values(conn, state.request_id, n)
            resume(state, n)
        conn.consumer.resume = seen
        if self.planted == "shifted_blocks":
            blocks_of = conn.caches.kvabi_blocks
            conn.caches.kvabi_blocks = lambda t: [[b + 1 for b in g] for g in blocks_of(t)]
        elif self.planted == "early_free":
            finish = conn.producer.finish

            def early(state, params):
                held = finish(state, params)
                if held:  # freed at once: the blocks go to the next request
                    conn.cache.free_blocks(conn.producer.held.pop(state.request_id))
                return held
            conn.producer.finish = early

    def _values(self, conn, table_name: str, n: int) -> list:
        alloc = next(iter(conn.cache.cache_allocators.values()))
        blocks = [int(b) - conn.caches.session.first_block
                  for b in alloc.block_table.get(table_name, [])]
        return [kv_values(c, token_slots(blocks, self.block_size, 0, n))
                for c in conn.caches.caches]

    def _results(self, ids, timeout: float) -> dict:
        got, deadline = {}, time.monotonic() + timeout
        while set(ids) - set(got) and time.monotonic() < deadline:
            r = self._mgr.get_result(timeout=0.5)
            if r is not None:
                got[r.request_id] = r
        return got

    # -- producer ----------------------------------------------------------------------------
    def prefill(self, prompts: list) -> list:
        """One prompt after the other (a block a producer frees too early then goes to the
        next prompt)."""
        out = []
        for i, p in enumerate(prompts):
            rid = f"kit-p{time.monotonic_ns()}-{i}"
            self._mgr.add_request(list(p), request_id=rid, max_new_tokens=1,
                                  kv_transfer_params=dict(ASK))
            out.append(getattr(self._results([rid], 120).get(rid), "kv_transfer_params", None))
        return out

    def kv(self, answer: dict) -> list:
        conn = self._mgr.connector
        return self._values(conn, HELD + answer["remote_request_id"],
                            int(answer["remote_num_tokens"]))

    # -- consumer ----------------------------------------------------------------------------
    def decode(self, requests: list) -> dict:
        t0 = time.monotonic()
        for rid, prompt, params in requests:
            self._mgr.add_request(list(prompt), request_id=rid, max_new_tokens=1,
                                  kv_transfer_params=params)
        wait = self._mgr.integration.pd.settings.pull_timeout_s + SLACK
        got = self._results([r for r, _, _ in requests], wait)
        out = {}
        for rid, _, params in requests:
            r = got.get(rid)
            if r is None:
                out[rid] = Outcome(f"kit: no answer within {wait:g} s")
            else:
                out[rid] = Outcome(r.error, self._seen.pop(rid, None), time.monotonic() - t0)
        return out

    def step(self, seconds: float = 0.0) -> None:
        time.sleep(seconds)  # the generation loop steps on its own

    def tables(self) -> dict:
        return self._mgr.connector.table_sizes() if self._mgr is not None else {}


__all__ = ["PLANTED", "TransformersEngine"]
