"""Two vLLM engines of different tensor-parallel sizes serving each other's prefills with
KvabiConnector (``kv_role="kv_both"``), for the tests: each engine prefills its own prompts
for the other, then decodes the other's (one pair shows ``TP a -> b`` and ``TP b -> a``),
then computes the same prompts alone (the single-engine reference), and reports its tokens
and whether it got back every block it held for the other.

``python -m kvabi_vllm.tools.pd_tp engine --help``: one engine per process;
:func:`run_tp_pair` drives two of them and lets a test rewrite the prefill outputs
(``kv_transfer_params``) before the other side reads them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .pd import ENV, _prompts, _sampling, make_llm


def _wait(path: Path, deadline: float, what: str) -> None:
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"pd_tp: no {what} ({path.name}) in time")
        time.sleep(0.05)


def _free_blocks(llm) -> int:
    """Free blocks of the engine's block pool (the engine core runs in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool \
        .get_num_free_blocks()


def engine_main(a) -> int:
    """One engine: prefill ``--mine`` for the peer, decode the peer's prefills, compute them
    alone, serve until ``--work``/stop exists; results in ``--work``/NAME.out.json."""
    work = Path(a.work)
    deadline = time.monotonic() + a.timeout
    llm = make_llm(a.model, block_size=a.block_size, role="kv_both", layout=a.layout, tp=a.tp,
                   module=a.module, extra={"pull_timeout_s": a.pull_timeout})
    free0 = _free_blocks(llm)
    mine = json.loads(Path(a.mine).read_text())
    outs = llm.generate(_prompts(a.mine), [_sampling(1, {"do_remote_decode": True})
                                           for _ in mine], use_tqdm=False)
    held = free0 - _free_blocks(llm)  # kept for the peer to read
    tmp = work / f"{a.name}.params.tmp"
    tmp.write_text(json.dumps([o.kv_transfer_params for o in outs]))
    tmp.rename(work / f"{a.name}.params.json")
    _wait(work / f"{a.peer}.params.go", deadline, "go from the driver")
    theirs = json.loads((work / f"{a.peer}.params.json").read_text())
    peer_prompts = _prompts(str(work / f"{a.peer}.prompts.json"))
    t0 = time.perf_counter()
    pd = llm.generate(peer_prompts, [_sampling(a.max_tokens, p) for p in theirs],
                      use_tqdm=False)
    pd_s = time.perf_counter() - t0
    single = llm.generate(peer_prompts, [_sampling(a.max_tokens) for _ in theirs],
                          use_tqdm=False)
    (work / f"{a.name}.out.json").write_text(json.dumps({
        "pd": [list(o.outputs[0].token_ids) for o in pd],
        "finish": [str(o.outputs[0].finish_reason) for o in pd],
        "single": [list(o.outputs[0].token_ids) for o in single], "generate_s": pd_s,
        "held": held}))
    # serve the peer's reads; the blocks held for it come back as its ranks say they are done
    while not (work / "stop").exists() and time.monotonic() < deadline:
        llm.llm_engine.step()
        if _free_blocks(llm) == free0 and not (work / f"{a.name}.freed.json").exists():
            (work / f"{a.name}.freed.json").write_text(json.dumps({"held": held}))
        time.sleep(0.02)
    return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvabi_vllm.tools.pd_tp",
                                 description="one engine of a pair of vLLM engines (any "
                                             "tensor-parallel sizes) serving each other's "
                                             "prefills with KvabiConnector (kv_both)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("engine", help="run one engine of the pair")
    p.add_argument("--name", required=True, help="this engine's name (file prefix)")
    p.add_argument("--peer", required=True, help="the other engine's name")
    p.add_argument("--work", required=True, help="the pair's shared directory")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--mine", required=True, help="JSON file: token-id lists this engine "
                                                 "prefills for the peer")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--block-size", type=int, default=32, help="KV cache block size")
    p.add_argument("--layout", default=None, help="vLLM KV cache layout, e.g. BLHNC")
    p.add_argument("--module", default="kvabi_vllm.connector",
                   help="module of the connector (default kvabi_vllm.connector)")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens decoded per prompt")
    p.add_argument("--pull-timeout", type=float, default=30.0,
                   help="kv_connector_extra_config pull_timeout_s (default 30)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this long")
    return ap


def main(argv=None) -> int:
    return engine_main(_parser().parse_args(argv))


def run_tp_pair(model, workdir, sides: dict, *, max_tokens: int = 12, timeout: float = 600,
                pull_timeout: float = 30.0, edit_params=None, expect_free=()) -> dict:
    """Run two engines ``sides = {name: {"tp", "block_size", "layout", "module", "env",
    "prompts", "pull_timeout"}}`` (``pull_timeout``: that engine's, default
    ``pull_timeout``)
    serving each other; ``edit_params(name, params)`` (tests) may rewrite what engine
    ``name`` produced before its peer reads it.  Returns per name its ``out`` (``pd`` and
    ``single`` tokens of the peer's prompts, ``finish`` reasons, ``generate_s``, ``held``)
    and, for the names in ``expect_free``, ``freed``: the blocks it held for its peer once
    all came back (None when they did not within ``pull_timeout`` + 30 s)."""
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    names = list(sides)
    procs, logs = {}, {}
    base = {**os.environ, **ENV}
    try:
        for name, side in sides.items():
            peer = names[1 - names.index(name)]
            (work / f"{name}.prompts.json").write_text(json.dumps(side["prompts"]))
            args = ["engine", "--name", name, "--peer", peer, "--work", str(work),
                    "--model", str(model), "--mine", str(work / f"{name}.prompts.json"),
                    "--tp", str(side.get("tp", 1)),
                    "--block-size", str(side.get("block_size", 32)),
                    "--max-tokens", str(max_tokens),
                    "--pull-timeout", str(side.get("pull_timeout", pull_timeout)),
                    "--timeout", str(timeout)]
            if side.get("layout"):
                args += ["--layout", side["layout"]]
            if side.get("module"):
                args += ["--module", side["module"]]
            logs[name] = open(work / f"{name}.log", "w")  # a file: a pipe would fill
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "kvabi_vllm.tools.pd_tp"] + args,
                env={**base, **side.get("env", {})}, stdout=logs[name],
                stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout

        def wait(path, name):
            while not path.exists():
                if procs[name].poll() is not None or time.monotonic() > deadline:
                    why = f"it exited {procs[name].returncode}" \
                        if procs[name].poll() is not None else "the deadline passed"
                    raise RuntimeError(f"waiting for engine {name} to write {path.name}: "
                                       f"{why}:\n" +
                                       (work / f"{name}.log").read_text()[-6000:])
                time.sleep(0.1)

        for name in names:
            wait(work / f"{name}.params.json", name)
            if edit_params is not None:
                path = work / f"{name}.params.json"
                path.write_text(json.dumps(edit_params(name, json.loads(path.read_text()))))
            (work / f"{name}.params.go").touch()
        out = {}
        for name in names:
            wait(work / f"{name}.out.json", name)
            out[name] = {"out": json.loads((work / f"{name}.out.json").read_text())}
        deadline = min(deadline, time.monotonic() + pull_timeout + 30)
        for name in expect_free:  # frees what it held once its peer's ranks are done
            try:
                wait(work / f"{name}.freed.json", name)
                out[name]["freed"] = json.loads((work / f"{name}.freed.json").read_text())
            except RuntimeError:
                out[name]["freed"] = None
        return out
    finally:
        (work / "stop").touch()
        for name, p in procs.items():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            logs[name].close()


if __name__ == "__main__":
    sys.exit(main())
