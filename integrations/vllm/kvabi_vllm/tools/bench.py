"""``kvabi bench vllm``: vLLM generating through kvabi, measured side by side in one run.

1. Throughput: one batch of prompts, greedy, through vLLM's own engine with its own CPU
   attention, with kvabi over ``cpu.vllm`` (vLLM's compiled kernels behind kvabi's ABI) and
   over ``reference`` (numpy float64): generated tokens per second, median of ``--repeat``
   runs after a warm-up, and whether the tokens match vLLM's own.
2. Prefill skip: a Gemma-3n-like model whose second half of layers reads the first half's
   caches, long prompts, one new token: the prefill with and without
   ``kv_sharing_fast_prefill`` (the KV-shared layers' metadata from
   ``kvabi.transforms.prefill_skip``), on one kvabi backend.
3. P/D (KvabiConnector against vLLM's NixlConnector, and P/D per request against the
   decode engine's own decode): :mod:`kvabi_vllm.tools.bench_pd`.
4. Connector tax: a request that moves no KV with KvabiConnector configured (each role)
   against none: :mod:`kvabi_vllm.tools.bench_tax`.
5. Serving: time to first token and tokens/s through ``kvabi-vllm proxy`` over HTTP against
   one server: :mod:`kvabi_vllm.tools.bench_serving`.

Engines run in this process, all of a section's engines open at once and taking turns
(median of the rounds); prefix caching is off so that every run computes its prompts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

DEFAULTS = dict(prompts=8, prompt_len=64, new_tokens=32, layers=4, hidden=256,
                head_dim=64, prefill_prompts=4, prefill_len=512, prefill_layers=8,
                repeat=3, prefill_backend="cpu.vllm", block_size=32)
PATHS = (("vllm", None), ("kvabi cpu.vllm", "cpu.vllm"), ("kvabi reference", "reference"))


def parser() -> argparse.ArgumentParser:
    from kvabi.util.argtypes import int_arg

    pos = int_arg(1, 1 << 16)
    p = argparse.ArgumentParser(
        prog="kvabi bench vllm",
        description="vLLM on kvabi, side by side in one run: tokens/s of vLLM's own CPU "
                    "attention, kvabi over cpu.vllm and over reference on the same batch; "
                    "prefill time with and without prefill skip on a Gemma-3n-like model "
                    "with half of its layers KV-shared; P/D transfer per request "
                    "(KvabiConnector, vLLM's NixlConnector) and against the engine's own "
                    "decode; a configured connector's cost to a request that moves no KV; "
                    "time to first token and tokens/s through kvabi-vllm proxy over HTTP "
                    "against one server. Tiny random float32 checkpoints; about a quarter "
                    "of an hour on 2 CPU cores.")
    a = p.add_argument
    a("--prompts", type=pos, default=DEFAULTS["prompts"], help="throughput batch size")
    a("--prompt-len", type=pos, default=DEFAULTS["prompt_len"], help="throughput prompt tokens")
    a("--new-tokens", type=pos, default=DEFAULTS["new_tokens"],
      help="tokens generated per prompt (throughput)")
    a("--layers", type=pos, default=DEFAULTS["layers"], help="layers of the Llama-like model")
    a("--hidden", type=pos, default=DEFAULTS["hidden"], help="model width (both models)")
    a("--head-dim", type=pos, default=DEFAULTS["head_dim"], help="head size (both models)")
    a("--prefill-prompts", type=pos, default=DEFAULTS["prefill_prompts"],
      help="prompts of the prefill-skip batch")
    a("--prefill-len", type=pos, default=DEFAULTS["prefill_len"],
      help="tokens per prompt of the prefill-skip batch")
    a("--prefill-layers", type=pos, default=DEFAULTS["prefill_layers"],
      help="layers of the Gemma-3n-like model (the second half KV-shared)")
    a("--prefill-backend", default=DEFAULTS["prefill_backend"],
      help="kvabi backend of the prefill-skip runs (falls back to example.torch if absent)")
    a("--block-size", type=pos, default=DEFAULTS["block_size"], help="vLLM block size")
    a("--repeat", type=pos, default=DEFAULTS["repeat"], help="timed runs (median reported)")
    a("--skip-prefill", action="store_true",
      help="leave out the prefill-skip section (to time the throughput section alone, e.g. "
           "on a model of a real layer count: --layers 32)")
    a("--skip-pd", action="store_true", help="leave out the P/D section")
    a("--skip-tax", action="store_true",
      help="leave out the connector-tax section (a configured connector, no transfer)")
    a("--skip-serving", action="store_true",
      help="leave out the serving section (P/D servers behind the proxy, over HTTP)")
    a("--json", action="store_true", help="print JSON instead of a report")
    return p


def _check(args) -> None:
    from kvabi.util.errors import KVABIError

    if args.prefill_layers < 4 or args.prefill_layers % 2:
        raise KVABIError(f"--prefill-layers: must be an even number >= 4, got "
                         f"{args.prefill_layers}")


def _interleaved(engines: dict, prompts, new_tokens, repeat, tick) -> dict:
    """Per engine: greedy tokens and the median seconds of ``repeat`` runs after one
    warm-up, the engines taking turns each round (a shared machine's load drifts; taking
    turns spreads it over every path alike)."""
    from .engine import greedy

    tokens, times = {}, {k: [] for k in engines}
    for k, llm in engines.items():
        tokens[k] = greedy(llm, prompts, new_tokens)
        tick()
    for _ in range(repeat):
        for k, llm in engines.items():
            t = time.perf_counter()
            again = greedy(llm, prompts, new_tokens)
            times[k].append(time.perf_counter() - t)
            tick()
            if again != tokens[k]:
                raise RuntimeError(f"{k}: greedy tokens changed between runs of one engine")
    return {k: (tokens[k], statistics.median(times[k])) for k in engines}


def throughput(args, root: Path, tick) -> dict:
    import kvabi

    from . import checkpoints as ck
    from ..attention import STATS
    from .engine import engine

    model = ck.write_checkpoint("llama", root / "llama", layers=args.layers,
                                hidden=args.hidden, head_dim=args.head_dim,
                                heads=max(1, args.hidden // args.head_dim), kv_heads=2)
    prompts = ck.prompts(args.prompts, lengths=(args.prompt_len,), shared_prefix=0)
    names = kvabi.backend_names()
    out, engines = {}, {}
    with contextlib.ExitStack() as stack:
        for label, backend in PATHS:
            if backend is not None and backend not in names:
                out[label] = {"backend": backend,
                              "skipped": f"{backend} is not registered here"}
                tick(args.repeat + 1)
                continue
            engines[label] = stack.enter_context(engine(
                model, backend=backend, block_size=args.block_size,
                enable_prefix_caching=False,
                max_model_len=args.prompt_len + args.new_tokens + 8,
                max_num_seqs=args.prompts))
        plans = STATS["plans"]
        res = _interleaved(engines, prompts, args.new_tokens, args.repeat, tick)
        plans = STATS["plans"] - plans
    ref = res["vllm"][0]
    for label, backend in PATHS:
        if label in res:
            tokens, secs = res[label]
            out[label] = {"backend": backend, "seconds": secs,
                          "tokens_per_s": args.prompts * args.new_tokens / secs,
                          "tokens_match_vllm": tokens == ref,
                          "time_vs_vllm": secs / res["vllm"][1]}
    return {"model": {"family": "llama", "layers": args.layers, "hidden": args.hidden,
                      "head_dim": args.head_dim},
            "batch": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                      "new_tokens": args.new_tokens, "block_size": args.block_size},
            "kvabi_plans": plans, "paths": out}


def prefill_skip(args, root: Path, tick) -> dict:
    import kvabi

    from . import checkpoints as ck
    from ..attention import STATS
    from .engine import engine

    backend = args.prefill_backend
    if backend not in kvabi.backend_names():
        backend = "example.torch"
    model = ck.write_checkpoint("gemma3n", root / "gemma3n", layers=args.prefill_layers,
                                hidden=args.hidden, head_dim=args.head_dim,
                                heads=max(1, args.hidden // args.head_dim), kv_heads=2,
                                shared=args.prefill_layers // 2, window=256)
    prompts = ck.prompts(args.prefill_prompts, lengths=(args.prefill_len,), shared_prefix=0)
    # vLLM's own CPU attention with and without its fast prefill: the model's own ceiling
    # for the same skip, beside kvabi's.
    runs = (("full", backend, False), ("prefill_skip", backend, True),
            ("vllm_full", None, False), ("vllm_fast_prefill", None, True))
    with contextlib.ExitStack() as stack:
        engines = {label: stack.enter_context(engine(
            model, backend=b, block_size=args.block_size, fast_prefill=fast,
            enable_prefix_caching=False, max_model_len=args.prefill_len + 8,
            max_num_seqs=args.prefill_prompts,
            max_num_batched_tokens=args.prefill_prompts * args.prefill_len))
            for label, b, fast in runs}
        dropped = STATS["prefill_skip_tokens_dropped"]
        res = _interleaved(engines, prompts, 1, args.repeat, tick)
        dropped = STATS["prefill_skip_tokens_dropped"] - dropped
    (full_tok, full_s), (skip_tok, skip_s) = res["full"], res["prefill_skip"]
    own_full, own_fast = res["vllm_full"][1], res["vllm_fast_prefill"][1]
    return {"backend": backend,
            "model": {"family": "gemma3n", "layers": args.prefill_layers,
                      "kv_shared_layers": args.prefill_layers // 2},
            "batch": {"prompts": args.prefill_prompts, "prompt_len": args.prefill_len},
            "full_s": full_s, "prefill_skip_s": skip_s, "speedup": full_s / skip_s,
            "tokens_match": full_tok == skip_tok == res["vllm_full"][0],
            "tokens_dropped_per_run": dropped // (args.repeat + 1),
            "vllm_own": {"full_s": own_full, "fast_prefill_s": own_fast,
                         "speedup": own_full / own_fast}}


def run(args, tick=lambda n=1: None) -> dict:
    from .engine import setup_env

    setup_env(quiet=True)
    out = {"repeat": args.repeat}
    with tempfile.TemporaryDirectory(prefix="kvabi-bench-vllm-") as tmp:
        out["throughput"] = throughput(args, Path(tmp), tick)
        if not args.skip_prefill:
            out["prefill_skip"] = prefill_skip(args, Path(tmp), tick)
    quiet = (lambda *_: None) if args.json else print
    if not args.skip_pd:
        from . import bench_pd

        out["pd"] = bench_pd.run(args)
    with tempfile.TemporaryDirectory(prefix="kvabi-bench-vllm-") as tmp:
        from .checkpoints import write_checkpoint

        model = write_checkpoint("llama", Path(tmp) / "llama", tokenizer=True)
        if not args.skip_tax:
            from . import bench_tax

            out["tax"] = bench_tax.run(model, progress=quiet)
        if not args.skip_serving:
            from . import bench_serving

            out["serving"] = bench_serving.run(model, Path(tmp) / "serving", progress=quiet)
    return out


def report(r) -> str:
    t, p = r["throughput"], r.get("prefill_skip")
    m, b = t["model"], t["batch"]
    lines = [f"vLLM (in-process engine, CPU, float32), Llama-like random model: {m['layers']} "
             f"layers, hidden {m['hidden']}, head size {m['head_dim']}",
             f"batch: {b['prompts']} prompts x {b['prompt_len']} tokens, {b['new_tokens']} new "
             f"tokens each, block size {b['block_size']}; median of {r['repeat']} runs after "
             f"a warm-up",
             "",
             f"{'attention':22} {'generate':>11} {'tokens/s':>10} {'vs vLLM':>8} {'tokens':>7}"]
    for label, _ in PATHS:
        v = t["paths"][label]
        if "skipped" in v:
            lines.append(f"{label:22} ({v['skipped']})")
            continue
        match = "-" if v["backend"] is None else ("same" if v["tokens_match_vllm"] else "differ")
        lines.append(f"{label:22} {v['seconds'] * 1e3:8.0f} ms {v['tokens_per_s']:10.1f} "
                     f"{v['time_vs_vllm']:7.2f}x {match:>7}")
    cpu = t["paths"].get("kvabi cpu.vllm", {})
    if "time_vs_vllm" in cpu:
        lines.append(f"goal: kvabi over cpu.vllm within 1.05x of vLLM's own step time "
                     f"(vllm.cpu: vLLM's cache read in place); "
                     f"measured: {cpu['time_vs_vllm']:.2f}x")
    if p is not None:
        pm, pb = p["model"], p["batch"]
        lines += ["",
                  f"prefill skip: Gemma-3n-like random model, {pm['layers']} layers "
                  f"({pm['kv_shared_layers']} KV-shared), {pb['prompts']} prompts x "
                  f"{pb['prompt_len']} tokens, 1 new token; kvabi backend {p['backend']}",
                  f"prefill without skip: {p['full_s'] * 1e3:.0f} ms; with kvabi prefill_skip "
                  f"(kv_sharing_fast_prefill): {p['prefill_skip_s'] * 1e3:.0f} ms; tokens "
                  f"{'same' if p['tokens_match'] else 'differ'}; "
                  f"{p['tokens_dropped_per_run']} tokens skipped per run",
                  f"goal: >= 1.6x (limit 2x); measured: {p['speedup']:.2f}x",
                  f"vLLM's own CPU attention, same model and batch: "
                  f"{p['vllm_own']['full_s'] * 1e3:.0f}"
                  f" ms without, {p['vllm_own']['fast_prefill_s'] * 1e3:.0f} ms with its fast "
                  f"prefill ({p['vllm_own']['speedup']:.2f}x)"]
    if "pd" in r and hasattr(r["pd"], "get") and r["pd"].get("report"):
        lines += ["", r["pd"]["report"]]
    if "tax" in r:
        from .bench_tax import report as tax_report

        lines += ["", tax_report(r["tax"])]
    if "serving" in r:
        from .bench_serving import report as serving_report

        lines += ["", serving_report(r["serving"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Entry point of ``kvabi bench vllm`` (and ``kvabi-vllm bench``)."""
    from kvabi import KVABIError

    args = parser().parse_args(argv)
    from .engine import setup_env

    setup_env(quiet=True)  # before vLLM is first imported
    try:
        _check(args)
        from tqdm import tqdm

        total = (len(PATHS) + 4) * (args.repeat + 1)
        with tqdm(total=total, desc="bench vllm", unit="run", file=sys.stderr,
                  disable=args.json) as bar:
            r = run(args, bar.update)
    except KVABIError as e:
        print(f"kvabi bench vllm: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2, default=str))
    else:
        print(report(r))
    return 0
