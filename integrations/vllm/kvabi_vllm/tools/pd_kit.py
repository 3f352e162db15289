"""vLLM's harness for kvabi's P/D kit (``kvabi conformance --pd
kvabi_vllm.tools.pd_kit:engine``, ``specs/pd.md`` section 12): a vLLM engine with
``KvabiConnector`` in a process of its own, driven by the kit as producer or consumer.

The engine process (``python -m kvabi_vllm.tools.pd_kit child ...``) runs vLLM's in-process
engine on a tiny random checkpoint and answers the kit's requests over its stdin/stdout: it
prefills prompts with the ask, reads the KV it holds for a request where vLLM's own block
table says (through the layout its adapter serves), decodes requests with parameters, and
reports its connector's tables and free blocks.  A decode's KV is taken when the connector
reports the pull done (:class:`KitConnector`), before vLLM computes from it.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvabi.testing.pd import EngineUnderTest, ModelFacts, Outcome

from ..connector import KvabiConnector as _Base
from ..connector.worker import KvabiConnectorWorker

#: the kit's engine: vLLM's own CPU attention (its CPU cache, keys stored transposed)
BLOCK_SIZE = 32
#: the scheduler of this process's engine (the kit connector reads vLLM's block table)
_SCHEDULER = None
#: request id -> (per group KV values) taken when its pull was reported done
SNAPSHOTS: dict = {}


def _values(worker, blocks, n: int) -> list:
    from kvabi.pd.slots import token_slots
    from kvabi.testing.pd import kv_values

    bs = worker.config.block_size
    return [kv_values(g.kv, token_slots(b, bs, 0, n))
            for g, b in zip(worker.cache_side.caches.groups, blocks)]


def _blocks(req_id: str) -> list:
    from ..connector.meta import pd_blocks

    return pd_blocks(_SCHEDULER.kv_cache_manager.get_block_ids(req_id))


class KitWorker(KvabiConnectorWorker):
    """The worker side that, when a pull is done, takes the KV of the request's blocks
    from vLLM's own block table (what the engine will compute from)."""

    def get_transfer_results(self, finished_req_ids):
        r = super().get_transfer_results(finished_req_ids)
        for rid in set(r.finished_recving) - set(r.failed_recving):
            req = _SCHEDULER.requests.get(rid) if _SCHEDULER is not None else None
            params = getattr(req, "kv_transfer_params", None) or {}
            n = params.get("remote_num_tokens")
            if isinstance(n, int):
                SNAPSHOTS[rid] = _values(self, _blocks(rid), n)
        return r


class KitConnector(_Base):
    """KvabiConnector with the kit's worker side."""
    worker_class = KitWorker


KvabiConnector = KitConnector  # the class vLLM loads from this module


# -- the engine process ---------------------------------------------------------------------
def _send(obj) -> None:
    sys.stdout.write(base64.b64encode(pickle.dumps(obj)).decode() + "\n")
    sys.stdout.flush()


def child(role: str, model: str, settings: dict, block_size: int) -> int:
    """One engine; a pickled request per line on stdin, a pickled answer per line out."""
    global _SCHEDULER
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from kvabi.pd import ASK

    from .pd import _sampling, make_llm

    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the answers
    llm = make_llm(model, block_size=block_size, role={"producer": "kv_producer",
                                                        "consumer": "kv_consumer"}[role],
                   module="kvabi_vllm.tools.pd_kit", extra=settings, blocks=192)
    core = llm.llm_engine.engine_core.engine_core
    _SCHEDULER = core.scheduler
    sched = core.scheduler.connector.connector_scheduler
    worker = get_kv_transfer_group().connector_worker
    pool = core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    by_nonce = {}
    sys.stdout = out
    _send("ready")
    eng = llm.llm_engine
    for line in sys.stdin:
        cmd, args = pickle.loads(base64.b64decode(line))
        if cmd == "stop":
            break
        if cmd == "prefill":
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args],
                                [_sampling(1, dict(ASK)) for _ in args], use_tqdm=False)
            answers = [o.kv_transfer_params for o in outs]
            for o, a in zip(outs, answers):
                if a:
                    by_nonce[a["kvabi_grant"]["nonce"]] = (o.request_id,
                                                           a["remote_num_tokens"])
            _send(answers)
        elif cmd == "kv":
            rid, n = by_nonce[args["kvabi_grant"]["nonce"]]
            _send(_values(worker, _blocks(rid), n))
        elif cmd == "decode":
            t0, got, ids = time.monotonic(), {}, {}
            for rid, prompt, params in args:
                try:
                    eng.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                                    _sampling(1, params))
                except Exception as e:  # noqa: BLE001 - vLLM's front end refused it
                    got[rid] = Outcome(f"front end: {type(e).__name__}: {e}")
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        ids[o.request_id.rsplit("-", 1)[0]] = (o.request_id,
                                                               time.monotonic() - t0)
            reasons = {}
            for r, why in list(sched.refusals) + list(worker.refusals):
                reasons.setdefault(r.rsplit("-", 1)[0], why)
            for rid, _, _ in args:
                if rid in got:
                    continue
                inner, secs = ids.get(rid, (rid, 0.0))
                why = reasons.get(rid)
                got[rid] = Outcome(why, None if why else SNAPSHOTS.pop(inner, None), secs)
            _send(got)
        elif cmd == "step":
            end = time.monotonic() + args
            while True:
                eng.step()
                if time.monotonic() >= end:
                    break
                time.sleep(0.01)
            _send(None)
        elif cmd == "tables":
            _send({**sched.table_sizes(), **worker.table_sizes()})
        elif cmd == "blocks":
            _send((pool.get_num_free_blocks(), total))
    return 0


# -- the kit's side ---------------------------------------------------------------------------
class VllmEngine(EngineUnderTest):
    """vLLM (its CPU attention, ``block_size``-token blocks) with KvabiConnector, as the
    kit's engine under test; ``model``: a checkpoint directory (default: a tiny random
    Llama written once)."""

    name = "vllm"

    def __init__(self, model: str | None = None, *, block_size: int = BLOCK_SIZE):
        if model is None:
            from .checkpoints import write_checkpoint

            model = os.path.join(tempfile.mkdtemp(prefix="kvabi-pd-kit-"), "tiny-llama")
            write_checkpoint("llama", model, layers=2, kv_heads=2, heads=4, head_dim=32)
        self.model, self.block_size = model, block_size
        cfg = json.loads((Path(model) / "config.json").read_text())
        self._facts = ModelFacts(
            windows=(None,), num_layers=cfg["num_hidden_layers"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            dtype="float32", vocab=cfg["vocab_size"], block_size=block_size, tp_size=1,
            max_tokens=1024)
        self._proc = None

    def facts(self) -> ModelFacts:
        return self._facts

    def start(self, role: str, settings) -> None:
        extra = {k: getattr(settings, k) for k in ("pull_timeout_s", "hold_timeout_s",
                                                    "max_held", "max_pulls", "pull_threads",
                                                    "max_peers")}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvabi_vllm.tools.pd_kit", "child", role, self.model,
             json.dumps(extra), str(self.block_size)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True)
        if self._read(600) != "ready":
            raise RuntimeError("vLLM engine process: not ready")

    def _read(self, limit: float):
        import select

        r, _, _ = select.select([self._proc.stdout], [], [], limit)
        if not r:
            raise RuntimeError(f"vLLM engine process: no answer within {limit:g} s")
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM engine process exited ({self._proc.wait()})")
        return pickle.loads(base64.b64decode(line))

    def _call(self, cmd: str, args=None, limit: float = 300.0):
        self._proc.stdin.write(base64.b64encode(pickle.dumps((cmd, args))).decode() + "\n")
        self._proc.stdin.flush()
        return self._read(limit)

    def stop(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.write(base64.b64encode(pickle.dumps(("stop", None)))
                                       .decode() + "\n")
                self._proc.stdin.close()
                self._proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def prefill(self, prompts):
        return self._call("prefill", prompts)

    def kv(self, answer):
        return self._call("kv", answer)

    def decode(self, requests):
        return self._call("decode", list(requests))

    def step(self, seconds: float = 0.0) -> None:
        self._call("step", seconds, limit=seconds + 120)

    def tables(self) -> dict:
        return self._call("tables")

    def blocks(self):
        return self._call("blocks")


def engine() -> VllmEngine:
    """The engine ``kvabi conformance --pd kvabi_vllm.tools.pd_kit:engine`` runs."""
    return VllmEngine()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])))
    print(__doc__)
    print("usage: kvabi conformance --pd kvabi_vllm.tools.pd_kit:engine")
