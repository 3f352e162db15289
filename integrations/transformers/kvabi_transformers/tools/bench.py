"""``kvabi bench transformers``: prefill skip and kvabi's per-step overhead, measured side
by side in one run on a prefill-heavy batch through transformers' continuous batching.

A Gemma-4-like random model whose second half of layers reads the first half's caches runs
one batch of long prompts three ways: transformers' own paged path (its sdpa attention over
its paged cache), kvabi, and kvabi with prefill skip.  Reported: the prefill step's whole
forward for each (median of ``--repeat`` runs), the skip speedup, decode steps, and the time
kvabi spends per step building metadata and plans.  The decode step is also compared on a
torch backend (``--decode-backend``, default ``example.torch``): kvabi's decode step against
transformers' own, in wall and in process CPU time (the goal: at most 1.2x).
"""
from __future__ import annotations

import argparse
import json
import sys

DEFAULTS = dict(prompts=8, prompt_len=1024, layers=8, hidden=256, window=256,
                new_tokens=3, repeat=1, backend="tpu.jax", decode_backend="example.torch")
#: kvabi's decode step on a torch backend, as a multiple of transformers' own (issue 18)
DECODE_GOAL = 1.2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvabi bench transformers",
        description="Prefill skip and kvabi overhead in transformers' continuous batching "
                    "(tiny random Gemma-4-like model, half of its layers KV-shared). The "
                    "defaults (8 prompts x 1024 tokens, one timed run per path) take about a minute on 2 CPU cores.")
    p.add_argument("--prompts", type=int, default=DEFAULTS["prompts"], help="batch size")
    p.add_argument("--prompt-len", type=int, default=DEFAULTS["prompt_len"],
                   help="tokens per prompt")
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"],
                   help="decoder layers; the second half reads the first half's caches")
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"], help="model width")
    p.add_argument("--window", type=int, default=DEFAULTS["window"],
                   help="sliding window of the sliding layers")
    p.add_argument("--new-tokens", type=int, default=DEFAULTS["new_tokens"],
                   help="tokens generated per prompt (decode steps + 1)")
    p.add_argument("--repeat", type=int, default=DEFAULTS["repeat"],
                   help="timed runs per path (median reported)")
    p.add_argument("--backend", default=DEFAULTS["backend"], help="kvabi backend")
    p.add_argument("--layout", default=None, help="layout preset (default: the backend's)")
    p.add_argument("--decode-backend", default=DEFAULTS["decode_backend"],
                   help="torch backend whose decode step is compared with transformers' "
                        f"(goal <= {DECODE_GOAL}x); the same as --backend reuses its run")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _positive(args) -> None:
    from kvabi import KVABIError

    for name in ("prompts", "prompt_len", "layers", "hidden", "window", "new_tokens", "repeat"):
        v = getattr(args, name)
        if v < 1:
            raise KVABIError(f"--{name.replace('_', '-')}: must be >= 1, got {v}")
    if args.layers < 4 or args.layers % 2:
        raise KVABIError(f"--layers: must be an even number >= 4, got {args.layers}")


def run(args, progress=None) -> dict:
    import numpy as np
    import torch

    import kvabi_transformers
    from .compare import cb_config
    from .tiny_models import tiny_model
    from .timing import timed_runs

    vocab = 256
    model = tiny_model("gemma4", layers=args.layers, hidden=args.hidden, window=args.window,
                       shared=args.layers // 2, vocab=vocab, seed=0)
    model.set_attn_implementation("sdpa")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    block = 16
    need = args.prompts * (-(-(args.prompt_len + args.new_tokens) // block) + 1)
    config = lambda: cb_config(max_batch_tokens=args.prompts * args.prompt_len,  # noqa: E731
                               num_blocks=need, page_size=block)
    out = {"model": {"family": "gemma4", "layers": args.layers,
                     "kv_shared_layers": args.layers // 2, "hidden": args.hidden,
                     "window": args.window},
           "batch": {"prompts": args.prompts, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens},
           "backend": args.backend, "repeat": args.repeat, "threads": torch.get_num_threads()}
    with torch.no_grad():
        hf = timed_runs(model, prompts, args.new_tokens, config(), repeat=args.repeat,
                        progress=progress)
        kvabi_transformers.use(model, args.backend, args.layout, block_size=block)
        plain = timed_runs(model, prompts, args.new_tokens, config(), repeat=args.repeat,
                           warmup=1, progress=progress)
        kvabi_transformers.use(model, args.backend, args.layout, block_size=block,
                               prefill_skip=True)
        skip = timed_runs(model, prompts, args.new_tokens, config(), repeat=args.repeat,
                          warmup=1, progress=progress)
        layout = model._kvabi_integration.layout_names[0]
        if args.decode_backend == args.backend:
            dec = plain
        else:
            kvabi_transformers.use(model, args.decode_backend, block_size=block)
            dec = timed_runs(model, prompts, args.new_tokens, config(), repeat=args.repeat,
                             warmup=1, progress=progress)
    out["layout"] = layout
    for name, r in (("transformers_paged", hf), ("kvabi", plain), ("kvabi_prefill_skip", skip)):
        out[name] = {k: v for k, v in r.items() if k != "tokens"}
    out["tokens_match"] = {"kvabi": plain["tokens"] == hf["tokens"],
                           "kvabi_prefill_skip": skip["tokens"] == hf["tokens"]}
    out["prefill_skip_speedup"] = plain["prefill_s"] / skip["prefill_s"]
    out["kvabi_vs_transformers_prefill"] = hf["prefill_s"] / plain["prefill_s"]
    out["kvabi_overhead_per_step_s"] = plain["overhead_s"]
    if plain["decode_s"] is not None and hf["decode_s"] is not None:
        out["kvabi_decode_step_minus_transformers_s"] = plain["decode_s"] - hf["decode_s"]
    out["decode_backend"] = args.decode_backend
    out["kvabi_decode_backend"] = {k: v for k, v in dec.items() if k != "tokens"}
    out["tokens_match"]["kvabi_decode_backend"] = dec["tokens"] == hf["tokens"]
    if dec["decode_s"] is not None and hf["decode_s"] is not None:
        out["decode_step_ratio"] = {"goal": DECODE_GOAL,
                                    "wall": dec["decode_s"] / hf["decode_s"],
                                    "cpu": dec["decode_cpu_s"] / hf["decode_cpu_s"]}
    return out


def _ms(s):
    return "-" if s is None else f"{s * 1e3:9.1f} ms"


def report(r) -> str:
    m, b = r["model"], r["batch"]
    lines = [
        f"transformers continuous batching, Gemma-4-like random model: {m['layers']} layers "
        f"({m['kv_shared_layers']} KV-shared), hidden {m['hidden']}, window {m['window']}",
        f"batch: {b['prompts']} prompts x {b['prompt_len']} tokens, {b['new_tokens']} new "
        f"tokens each; kvabi backend {r['backend']} ({r['layout']}); median of "
        f"{r['repeat']} runs; {r['threads']} threads",
        "",
        f"{'path':34} {'prefill forward':>16} {'decode/step':>12} {'kvabi meta+plan/step':>21}"
        f" {'tokens':>7}"]
    rows = (("transformers paged (sdpa)", "transformers_paged", None),
            (f"kvabi {r['backend']}", "kvabi", r["tokens_match"]["kvabi"]),
            (f"kvabi {r['backend']} + prefill skip", "kvabi_prefill_skip",
             r["tokens_match"]["kvabi_prefill_skip"]))
    for label, key, match in rows:
        x = r[key]
        lines.append(f"{label:34} {_ms(x['prefill_s']):>16} {_ms(x['decode_s']):>12} "
                     f"{_ms(x['overhead_s']):>21} "
                     f"{'-' if match is None else ('same' if match else 'DIFFER'):>7}")
    if r["decode_backend"] != r["backend"]:
        x = r["kvabi_decode_backend"]
        match = r["tokens_match"]["kvabi_decode_backend"]
        lines.append(f"{'kvabi ' + r['decode_backend']:34} {_ms(x['prefill_s']):>16} "
                     f"{_ms(x['decode_s']):>12} {_ms(x['overhead_s']):>21} "
                     f"{'same' if match else 'DIFFER':>7}")
    over = r["kvabi_overhead_per_step_s"]
    lines += [
        "",
        f"prefill skip speedup (whole prefill forward): {r['prefill_skip_speedup']:.2f}x "
        f"(goal >= 1.6x; ideal about 2x "
        f"when half of the layers skip)",
        f"kvabi prefill forward vs transformers' paged path: "
        f"{r['kvabi_vs_transformers_prefill']:.2f}x faster; kvabi's metadata + plans: "
        f"{over * 1e3:.2f} ms per step "
        f"({100 * over / r['kvabi']['prefill_s']:.2f}% of its prefill forward)"]
    extra = r.get("kvabi_decode_step_minus_transformers_s")
    if extra is not None:
        lines.append(f"decode step: kvabi {r['kvabi']['decode_s'] * 1e3:.1f} ms vs transformers' "
                     f"paged path {r['transformers_paged']['decode_s'] * 1e3:.1f} ms "
                     f"({extra * 1e3:+.1f} ms per step; the split per layer call below)")
    x = r["kvabi"]
    if x.get("handover_per_layer_s") is not None:
        lines.append(f"per layer call ({r['backend']}, mean over all steps): torch <-> "
                     f"backend arrays {x['handover_per_layer_s'] * 1e3:.3f} ms (CPU jax: "
                     f"DLPack, no copy), the backend's write_kv + attention "
                     f"{x['backend_per_layer_s'] * 1e3:.3f} ms")
    ratio = r.get("decode_step_ratio")
    if ratio is not None:
        hf, dec = r["transformers_paged"], r["kvabi_decode_backend"]
        lines += [
            f"decode step on a torch backend: goal kvabi <= {ratio['goal']}x transformers' "
            f"own paged path",
            f"  measured ({r['decode_backend']}): {ratio['wall']:.2f}x wall "
            f"({dec['decode_s'] * 1e3:.1f} vs {hf['decode_s'] * 1e3:.1f} ms), "
            f"{ratio['cpu']:.2f}x process CPU time ({dec['decode_cpu_s'] * 1e3:.1f} vs "
            f"{hf['decode_cpu_s'] * 1e3:.1f} ms); CPU time moves less on a shared machine"]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Entry point of ``kvabi bench transformers`` (and ``kvabi-transformers bench``)."""
    from kvabi import KVABIError
    from tqdm import tqdm

    args = parser().parse_args(argv)
    try:
        _positive(args)
        quiet_transformers()
        extra = int(args.decode_backend != args.backend)  # one more path, with its warm-up
        with tqdm(total=(3 + extra) * args.repeat + 2 + extra, desc="bench transformers", unit="run",
                  file=sys.stderr, disable=args.json) as bar:
            r = run(args, bar)
    except KVABIError as e:
        print(f"kvabi bench transformers: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if args.json else report(r))
    return 0


def quiet_transformers() -> None:
    """Silence transformers' CB logger (it warns about psutil on every run on CPU)."""
    import logging

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
    except ImportError:
        pass
