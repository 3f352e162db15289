"""``kvabi-vllm demo``: vLLM generating through kvabi backends, tokens compared with vLLM's
own CPU attention.

A tiny random Gemma-3n-like checkpoint (sliding and full layers, the last half reading
earlier layers' caches) is written to a temporary directory; vLLM's own engine runs it on
its own CPU attention, then on two kvabi backends, then with ``kv_sharing_fast_prefill``
(kvabi's prefill skip for the KV-shared layers).  Greedy tokens must be identical.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_BACKENDS = ("cpu.vllm", "reference")


def parser() -> argparse.ArgumentParser:
    from kvabi.util.argtypes import int_arg

    pos = int_arg(1, 1 << 12)
    p = argparse.ArgumentParser(
        prog="kvabi-vllm demo",
        description="vLLM (in this process, CPU) generating through kvabi backends on a tiny "
                    "random Gemma-3n-like checkpoint; tokens compared with vLLM's own CPU "
                    "attention. About a minute on 2 cores.")
    p.add_argument("--backends", nargs="+", default=list(DEFAULT_BACKENDS),
                   help="kvabi backends to run vLLM's attention on (`kvabi backends` lists "
                        "them; a name not registered here is refused)")
    p.add_argument("--prompts", type=pos, default=4, help="prompts in the batch")
    p.add_argument("--new-tokens", type=pos, default=16, help="tokens generated per prompt")
    p.add_argument("--block-size", type=pos, default=32, help="vLLM block size")
    return p


def run(args, progress=None) -> list[dict]:
    """Rows (path, tokens, seconds, whether they match vLLM's own) of the demo."""
    import kvabi
    from kvabi import KVABIError

    from . import checkpoints as ck
    from ..attention import STATS
    from .engine import generate, setup_env

    setup_env(quiet=True)
    names = kvabi.backend_names()
    unknown = [b for b in args.backends if b not in names]
    if unknown:
        raise KVABIError(f"--backends: {', '.join(unknown)} not a kvabi backend registered "
                         f"here; registered: {', '.join(names)}")
    backends = list(dict.fromkeys(args.backends))
    prompts = ck.prompts(args.prompts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvabi-vllm-demo-") as tmp:
        model = ck.write_checkpoint("gemma3n", Path(tmp) / "gemma3n")
        runs = [("vLLM's own CPU attention", None, False)]
        runs += [(f"kvabi {b}", b, False) for b in backends]
        runs += [(f"kvabi {backends[0]} + prefill skip", backends[0], True)]
        for label, backend, fast in runs:
            plans, dropped = STATS["plans"], STATS["prefill_skip_tokens_dropped"]
            t = time.perf_counter()
            tokens, _ = generate(model, prompts, max_tokens=args.new_tokens, backend=backend,
                                 block_size=args.block_size, fast_prefill=fast)
            rows.append({"path": label, "tokens": tokens, "seconds": time.perf_counter() - t,
                         "plans": STATS["plans"] - plans,
                         "skipped": STATS["prefill_skip_tokens_dropped"] - dropped})
            if progress:
                progress(label)
    for r in rows:
        r["match"] = r["tokens"] == rows[0]["tokens"]
    return rows


def main(argv=None) -> int:
    from kvabi import KVABIError
    from tqdm import tqdm

    args = parser().parse_args(argv)
    from .engine import setup_env

    setup_env(quiet=True)  # before vLLM is first imported
    try:
        with tqdm(total=len(set(args.backends)) + 2, desc="kvabi-vllm demo", unit="engine",
                  file=sys.stderr) as bar:
            rows = run(args, lambda label: (bar.set_postfix_str(label), bar.update()))
    except KVABIError as e:
        print(f"kvabi-vllm demo: error: {e}", file=sys.stderr)
        return 2
    print(f"vLLM, Gemma-3n-like random checkpoint, {args.prompts} prompts, "
          f"{args.new_tokens} greedy tokens each, block size {args.block_size}")
    print(f"{'path':42} {'engine+generate':>15} {'kvabi plans':>11} {'skipped':>7}  tokens")
    for r in rows:
        same = "-" if r is rows[0] else ("same as vLLM's own" if r["match"] else "DIFFER")
        print(f"{r['path']:42} {r['seconds']:13.1f} s {r['plans']:11d} {r['skipped']:7d}  "
              f"{same}")
    print(f"first continuation: {rows[0]['tokens'][0]}")
    ok = all(r["match"] for r in rows)
    try:
        from . import demo_pd  # the P/D pair (KvabiConnector), where present
    except ImportError:
        demo_pd = None
    if demo_pd is not None:
        ok = demo_pd.main([]) == 0 and ok
    return 0 if ok else 1
