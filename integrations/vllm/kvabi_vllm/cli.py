"""The ``kvabi-vllm`` command."""
from __future__ import annotations

import argparse
import sys

COMMANDS = {"demo": "vLLM generating through kvabi backends, tokens compared with vLLM's own",
            "bench": "the same as `kvabi bench vllm`",
            "guard": "a P/D pair under attack: every hostile request refused alone, honest "
                     "ones served beside them"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:  # each subcommand parses (and documents) its own options
        if argv[0] == "demo":
            from .tools.demo import main as demo
            return demo(argv[1:])
        if argv[0] == "guard":
            from .tools.pd_guard import main as guard
            return guard(argv[1:])
        from .tools.bench import main as bench
        return bench(argv[1:])
    parser = argparse.ArgumentParser(
        prog="kvabi-vllm", description="vLLM on kvabi. Subcommands take --help.")
    parser.add_argument("command", choices=tuple(COMMANDS),
                        help="; ".join(f"{k}: {v}" for k, v in COMMANDS.items()))
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
