"""``kvabi-transformers demo|bench|serve|pd-demo``."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    # Without a CUDA device kvabi-cuda's Triton kernels run interpreted; the interpreter
    # must be on before transformers imports triton.language.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(
        prog="kvabi-transformers",
        description="kvabi inside Hugging Face transformers' continuous batching.")
    p.add_argument("command", choices=("demo", "bench", "serve", "pd-demo"),
                   help="demo: generation on several backends; bench: prefill skip and "
                        "per-step overhead (same as `kvabi bench transformers`); serve: "
                        "transformers serve on kvabi, with P/D (serve --help); pd-demo: one "
                        "prompt prefilled by vLLM and decoded by transformers, and the "
                        "reverse, over HTTP")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's arguments (--help)")
    ns = p.parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    rest = argv[1:]
    if ns.command == "demo":
        from .tools.demo import main as run
    elif ns.command == "serve":
        from .serving.serve import main as run
    elif ns.command == "pd-demo":
        from .tools.pd_demo import main as run
    else:
        from .tools.bench import main as run
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
