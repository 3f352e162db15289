"""``kvabi-transformers demo``: a Gemma-4-like model with KV-shared layers generates for a
batch of prompts through transformers' continuous batching on several kvabi backends."""
from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_BACKENDS = ("reference", "tpu.jax")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvabi-transformers demo",
        description="Generate with a tiny random Gemma-4-like model (half of its layers read "
                    "the others' caches) through transformers' generate_batch on kvabi "
                    "backends: tokens/s, whether the tokens equal transformers' own "
                    "attention, and the prefill-skip speedup.")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="comma-separated kvabi backends (unavailable ones are reported)")
    p.add_argument("--prompts", type=int, default=8, help="prompts in the batch")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--skip-prompt-len", type=int, default=512,
                   help="prompt length of the prefill-skip measurement (8 prompts)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def run(args, say=print) -> dict:
    import numpy as np
    import torch

    import kvabi
    import kvabi_transformers
    from .compare import cb_config, run_batch
    from .tiny_models import tiny_model
    from .timing import timed_runs

    model = tiny_model("gemma4", layers=6, hidden=128, window=32, shared=3, vocab=256, seed=0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 160, args.prompts)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in lengths]
    say(f"model: Gemma-4-like, 6 layers (3 read earlier layers' caches), hidden 128, window 32;"
        f" {args.prompts} prompts of {int(lengths.min())}..{int(lengths.max())} tokens, "
        f"{args.new_tokens} new tokens each")
    out = {"prompts": args.prompts, "new_tokens": args.new_tokens, "backends": {}}
    with torch.no_grad():
        t0 = time.perf_counter()
        want, _ = run_batch(model, prompts, args.new_tokens, config=cb_config(), logits=False)
        base = time.perf_counter() - t0
        generated = sum(len(t) for t in want)
        say(f"transformers' own attention (paged|eager): {generated / base:8.1f} tokens/s")
        out["transformers_tokens_per_s"] = generated / base
        for name in [b for b in args.backends.split(",") if b]:
            try:
                ok, why = kvabi.get_backend(name).available()
            except kvabi.KVABIError as e:
                ok, why = False, str(e)
            if not ok:
                say(f"{name}: skipped ({why})")
                out["backends"][name] = {"available": False, "reason": why}
                continue
            kvabi_transformers.use(model, name)
            layout = model._kvabi_integration.layout_names
            # First run with a progress bar (jax compiles its shapes here), then timed.
            got, _ = run_batch(model, prompts, args.new_tokens, config=cb_config(),
                               logits=False, progress_bar=not args.json)
            t0 = time.perf_counter()
            again, _ = run_batch(model, prompts, args.new_tokens, config=cb_config(),
                                 logits=False)
            sec = time.perf_counter() - t0
            same = got == want and again == want
            say(f"{name:12} layouts {', '.join(sorted(set(layout))):28} "
                f"{generated / sec:8.1f} tokens/s   tokens {'match' if same else 'DIFFER from'}"
                f" transformers' own attention")
            out["backends"][name] = {"available": True, "layouts": layout,
                                     "tokens_per_s": generated / sec, "tokens_match": same}
        # Prefill skip on a prefill-heavy batch (8 prompts of 512 tokens, one new token)
        # of a wider model, where the layers rather than the bookkeeping take the time.
        fast = [b for b, r in out["backends"].items() if r.get("available")]
        if fast:
            name = fast[-1]
            wide = tiny_model("gemma4", layers=8, hidden=256, window=128, shared=4,
                              vocab=256, seed=0)
            n = args.skip_prompt_len
            heavy = [rng.integers(3, 256, n).tolist() for _ in range(8)]
            cfg = cb_config(max_batch_tokens=8 * n, num_blocks=8 * (n // 16 + 2), page_size=16)
            kvabi_transformers.use(wide, name, block_size=16)
            plain = timed_runs(wide, heavy, 1, cfg, warmup=1)
            kvabi_transformers.use(wide, name, block_size=16, prefill_skip=True)
            skip = timed_runs(wide, heavy, 1, cfg, warmup=1)
            speedup = plain["prefill_s"] / skip["prefill_s"]
            say(f"prefill skip ({name}; 8 layers, 4 KV-shared, hidden 256; 8 x {n}-token "
                f"prompts): prefill forward "
                f"{plain['prefill_s'] * 1e3:.0f} ms -> {skip['prefill_s'] * 1e3:.0f} ms, "
                f"{speedup:.2f}x; tokens {'match' if plain['tokens'] == skip['tokens'] else 'DIFFER'}")
            out["prefill_skip"] = {"backend": name, "speedup": speedup,
                                   "tokens_match": plain["tokens"] == skip["tokens"]}
    return out


def main(argv=None) -> int:
    """Entry point of ``kvabi-transformers demo``."""
    from kvabi import KVABIError

    from .bench import quiet_transformers

    args = parser().parse_args(argv)
    if min(args.prompts, args.new_tokens, args.skip_prompt_len) < 1:
        print("kvabi-transformers demo: error: --prompts, --new-tokens and "
              "--skip-prompt-len must be >= 1",
              file=sys.stderr)
        return 2
    quiet_transformers()
    try:
        r = run(args, say=(lambda *a: None) if args.json else print)
    except KVABIError as e:
        print(f"kvabi-transformers demo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r, indent=2))
    ok = all(b.get("tokens_match", True) for b in r["backends"].values())
    return 0 if ok else 1
