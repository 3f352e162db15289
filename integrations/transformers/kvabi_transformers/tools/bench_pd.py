"""``kvabi bench transformers-pd``: what P/D costs in transformers' continuous batching.

1. **Per step, no transfer**: the same decode-heavy batch through a manager without P/D
   and one speaking it (role both, nothing to pull or hold), taking turns, medians of
   ``--repeat`` runs: the generation time ratio (goal <= 1.05x) and the connector's own
   time per loop iteration (kvabi.pd's step: notifications, expiry, results).
2. **Per request** (``--vllm-python``: servers of both makes over HTTP through ``kvabi
   proxy``): a prompt prefilled by vLLM and decoded by transformers (cross-engine) against
   the same prompt prefilled by another transformers server and decoded by the same
   transformers server (the same pair within one engine): the request's time through the
   proxy, and the consumer's pull (seconds in all, in READs, bytes, regions) and the
   relayout it negotiated (regions and staging bytes per block, from its log).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

#: the adapter's per-step goal: generation with P/D on, nothing moving, over without
STEP_GOAL = 1.05


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvabi bench transformers-pd",
        description="P/D in transformers' continuous batching: the adapter's per-step cost "
                    "when nothing moves, and per request the cross-engine P/D (vLLM -> "
                    "transformers) against the same pair within one engine.")
    p.add_argument("--prompts", type=int, default=8, help="batch of the per-step run")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="tokens generated per prompt in the per-step run")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per side (median)")
    p.add_argument("--backend", default="example.torch", help="kvabi backend")
    p.add_argument("--layout", default=None, help="layout preset (default: the backend's)")
    p.add_argument("--vllm-python", default=None,
                   help="the Python of vLLM's environment: also measure P/D across engines "
                        "over HTTP (starts three servers; minutes)")
    p.add_argument("--requests", type=int, default=4, help="P/D requests measured")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def step_cost(a, progress=print) -> dict:
    """Generation time without and with P/D on (nothing moving), and the connector's time
    per loop iteration."""
    import numpy as np
    from transformers import GenerationConfig

    import kvabi_transformers
    from .tiny_models import tiny_model

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, a.prompt_len).tolist() for _ in range(a.prompts)]
    config = GenerationConfig(max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    managers, spent = {}, {"s": 0.0, "n": 0}
    for side, pd in (("off", None), ("on", "kv_both")):
        model = tiny_model("llama", layers=4, hidden=128, vocab=256, seed=0)
        kvabi_transformers.use(model, a.backend, a.layout, memory="16MiB", pd=pd)
        mgr = model.init_continuous_batching(generation_config=config)
        mgr.start()
        while mgr.batch_processor is None:
            time.sleep(0.01)
        managers[side] = mgr
    conn = managers["on"].connector
    step = conn.step

    def timed_step():
        t0 = time.perf_counter()
        step()
        spent["s"] += time.perf_counter() - t0
        spent["n"] += 1
    conn.step = timed_step

    def run(mgr) -> float:
        t0 = time.perf_counter()
        ids = [mgr.add_request(p, max_new_tokens=a.new_tokens) for p in prompts]
        got = set()
        while len(got) < len(ids):
            r = mgr.get_result(timeout=60)
            if r is None:
                raise RuntimeError("no output within 60 s")
            got.add(r.request_id)
        return time.perf_counter() - t0

    times = {"off": [], "on": []}
    for side in ("off", "on"):  # warm-up
        run(managers[side])
    spent.update(s=0.0, n=0)
    for i in range(a.repeat):
        for side in (("off", "on") if i % 2 == 0 else ("on", "off")):
            times[side].append(run(managers[side]))
        progress(f"  run {i + 1}/{a.repeat}: without P/D {times['off'][-1]:.3f} s, with "
                 f"{times['on'][-1]:.3f} s")
    for mgr in managers.values():
        mgr.stop(block=True, timeout=30)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"off_s": off, "on_s": on, "ratio": on / off, "goal": STEP_GOAL,
            "connector_us_per_step": 1e6 * spent["s"] / max(spent["n"], 1),
            "connector_steps": spent["n"]}


def negotiations(log: str) -> list[str]:
    """What a consumer negotiated, as it logged it (``log``: the log's text)."""
    return [m.group(1) for m in re.finditer(r"reads producer ranks \S+ of \d+: (.*)", log)]


def per_request(a, progress=print) -> dict:
    """Per request: vLLM -> transformers against transformers -> transformers, over HTTP."""
    import subprocess

    from .pd_servers import MODEL, Engine, call, pd_servers

    work = Path(tempfile.mkdtemp(prefix="kvabi-bench-pd-"))
    model = work / "llama"
    subprocess.run([a.vllm_python, "-m", "kvabi_vllm.tools.checkpoints", str(model)],
                   check=True, capture_output=True, timeout=600)
    consumer = Engine("transformers", block_size=16, backend=a.backend, layout=a.layout)
    engines = {"t": consumer, "t2": consumer, "v": Engine("vllm", block_size=32)}
    prompts = [f"Request {i}: " + "move the prompt's KV, keep the tokens. " * 6
               for i in range(a.requests)]
    out = {}
    progress("  starting a vLLM server and two transformers servers ...")
    with pd_servers(model, work, engines, {"vt": ("v", "t"), "tt": ("t2", "t")},
                    vllm_python=a.vllm_python) as run:
        urls, logs = run["urls"], run["logs"]
        for name, via in (("cross-engine (vLLM -> transformers)", "vt"),
                          ("within one engine (transformers -> transformers)", "tt")):
            # None until the server's first request starts its batching manager
            before = len(call(urls["t"] + "/kvabi/status")[1]["models"][0]["pd"]["pulls"]
                         or [])
            seen = len(logs["t"].read_text())
            rows = []
            for p in [prompts[0]] + prompts:  # the first: connect and negotiate (not counted)
                t0 = time.perf_counter()
                status, got = call(urls[via] + "/v1/completions", {
                    "model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0.0})
                if status != 200:
                    raise RuntimeError(f"{via}: {status} {got}")
                rows.append(time.perf_counter() - t0)
            pulls = call(urls["t"] + "/kvabi/status")[1]["models"][0]["pd"]["pulls"]
            pulls = pulls[before + 1:]
            out[name] = {"request_s": statistics.median(rows[1:]), "pulls": pulls,
                         "negotiated": negotiations(logs["t"].read_text()[seen:])}
    return out


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    say = (lambda *_: None) if a.json else print
    say(f"P/D in transformers' continuous batching ({a.backend}); per step, nothing moving: "
        f"{a.prompts} prompts x {a.prompt_len} tokens, {a.new_tokens} new")
    res = {"step": step_cost(a, say)}
    s = res["step"]
    say(f"  generation without P/D {s['off_s']:.3f} s, with {s['on_s']:.3f} s: "
        f"{s['ratio']:.3f}x (goal <= {STEP_GOAL}x); the connector {s['connector_us_per_step']:.0f}"
        f" us per loop iteration ({s['connector_steps']} iterations)")
    if a.vllm_python:
        res["requests"] = per_request(a, say)
        for name, r in res["requests"].items():
            say(f"  {name}: request through the proxy {r['request_s'] * 1e3:.0f} ms (median)")
            for p in r["pulls"]:
                say(f"    pull {p['seconds'] * 1e3:.1f} ms (READs {p['read_s'] * 1e3:.1f} ms, "
                    f"record {p['grant_s'] * 1e3:.1f} ms, checksums {p['checksum_s'] * 1e3:.1f}"
                    f" ms), {p['bytes'] / 1024:.0f} KiB in {p['regions']} regions")
            for line in sorted(set(r["negotiated"])):
                say(f"    negotiated: {line}")
    if a.json:
        print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
