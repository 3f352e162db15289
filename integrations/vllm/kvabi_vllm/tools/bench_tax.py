"""``kvabi bench vllm``'s connector-tax section: what configuring KvabiConnector costs a
request that moves no KV.

One engine per configuration (no connector; KvabiConnector as kv_consumer, as kv_producer,
as kv_both), each in its own process with the engine in that process, on the same tiny
checkpoint.  They take turns: while one is timed, every other is stopped (SIGSTOP), so that
a thread one of them keeps busy (NIXL's progress thread spun on a core until kvabi gave it a
pause) slows that one only, as it would on its own machine.  Per round, each engine serves
``--requests`` identical requests back to back (one prompt, greedy, no KV moved);
reported: the median over rounds of each engine's median time per request, and its ratio
to the engine without a connector; beside it the engine process's CPU time per request
(all its threads: a spinning thread shows there even where other load on the machine
blurs the wall-clock figure).
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time

#: (label, kv_role or None)
CONFIGS = (("no connector", None), ("KvabiConnector kv_consumer", "kv_consumer"),
           ("KvabiConnector kv_producer", "kv_producer"),
           ("KvabiConnector kv_both", "kv_both"))


def _child(model: str, role: str | None, prompt_len: int, new_tokens: int) -> int:
    """One engine; per line 'go' on stdin: one request, its wall-clock and process CPU
    seconds on stdout."""
    from .checkpoints import prompts
    from .pd import _sampling, make_llm

    llm = make_llm(model, block_size=32, role=role or None)
    prompt = [{"prompt_token_ids": prompts(1, lengths=(prompt_len,), shared_prefix=0)[0]}]
    sp = _sampling(new_tokens)
    llm.generate(prompt, sp, use_tqdm=False)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t, c = time.perf_counter(), time.process_time()
        llm.generate(prompt, sp, use_tqdm=False)
        print(time.perf_counter() - t, time.process_time() - c, flush=True)
    return 0


def run(model, *, rounds: int = 8, requests: int = 3, prompt_len: int = 24,
        new_tokens: int = 16, progress=print) -> dict:
    """{label: {"per_request_s", "ratio"}} and the goal line (module docstring)."""
    from .serving import reap

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    env = {k: v for k, v in env.items() if not k.startswith("KVABI_VLLM")}
    procs = {}
    try:
        for label, role in CONFIGS:
            progress(f"  connector tax: starting the engine with {label} ...")
            p = subprocess.Popen(
                [sys.executable, "-m", "kvabi_vllm.tools.bench_tax", "--child", str(model),
                 role or "", str(prompt_len), str(new_tokens)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, env=env)
            procs[label] = p
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"connector tax: the engine with {label} did not start")
            p.send_signal(signal.SIGSTOP)
        times = {label: [] for label in procs}
        cpu = {label: [] for label in procs}
        order = list(procs)
        for r in range(rounds):
            for label in order[r % len(order):] + order[:r % len(order)]:  # rotate: drift
                p = procs[label]
                p.send_signal(signal.SIGCONT)
                one = []
                for _ in range(requests):
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    one.append(tuple(map(float, p.stdout.readline().split())))
                p.send_signal(signal.SIGSTOP)
                times[label].append(statistics.median(w for w, _ in one))
                cpu[label].append(statistics.median(c for _, c in one))
            progress(f"  connector tax: round {r + 1}/{rounds}")
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGCONT)
            p.stdin.close()  # a child exits at the end of its input
        reap(procs)
    base = statistics.median(times["no connector"])
    base_cpu = statistics.median(cpu["no connector"])
    out = {label: {"per_request_s": statistics.median(t),
                   "ratio": statistics.median(t) / base,
                   "cpu_per_request_s": statistics.median(cpu[label]),
                   "cpu_ratio": statistics.median(cpu[label]) / base_cpu}
           for label, t in times.items()}
    worst = max(v["ratio"] for k, v in out.items() if k != "no connector")
    out["goal"] = ("a request that moves no KV, connector configured <= 1.05x without it "
                   "(worst role)", worst, 1.05)
    out["setting"] = {"rounds": rounds, "requests": requests, "prompt_len": prompt_len,
                      "new_tokens": new_tokens}
    return out


def report(out: dict) -> str:
    s = out["setting"]
    lines = [f"Connector tax: one engine per configuration, taking turns (the others "
             f"stopped); one request of {s['prompt_len']} prompt tokens, {s['new_tokens']} "
             f"greedy tokens, no KV moved; median over {s['rounds']} rounds of "
             f"{s['requests']} requests:",
             f"  {'engine':30s} {'ms/request':>10s} {'vs none':>8s} {'CPU ms':>8s} "
             f"{'vs none':>8s}"]
    for label, _ in CONFIGS:
        v = out[label]
        lines.append(f"  {label:30s} {v['per_request_s'] * 1e3:10.1f} {v['ratio']:7.2f}x "
                     f"{v['cpu_per_request_s'] * 1e3:8.1f} {v['cpu_ratio']:7.2f}x")
    what, measured, goal = out["goal"]
    lines.append(f"  goal: {what}: <= {goal:g}x; measured: {measured:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        model, role, prompt_len, new_tokens = argv[1:5]
        return _child(model, role, int(prompt_len), int(new_tokens))
    import argparse
    import tempfile
    from pathlib import Path

    from kvabi.util.argtypes import int_arg

    ap = argparse.ArgumentParser(prog="python -m kvabi_vllm.tools.bench_tax",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int_arg(1, 1000), default=8,
                    help="rounds of turns (default 8)")
    ap.add_argument("--requests", type=int_arg(1, 1000), default=3,
                    help="requests per engine per round (default 3)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args(argv)
    from .checkpoints import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="kvabi-bench-tax-") as tmp:
        model = write_checkpoint("llama", Path(tmp) / "llama")
        out = run(model, rounds=a.rounds, requests=a.requests,
                  progress=(lambda *_: None) if a.json else print)
    print(json.dumps(out, indent=1) if a.json else report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
