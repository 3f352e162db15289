"""The ``kvabi-vllm`` command."""
from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> (module:function, what it does); each parses (and documents) its options
COMMANDS = {
    "serve": ("kvabi_vllm.serve:main",
              "vLLM's OpenAI-compatible server (`vllm serve`, startable from vLLM's CPU "
              "build), attention on the kvabi backend KVABI_VLLM_BACKEND names"),
    "proxy": ("kvabi_vllm.proxy:main",
              "an OpenAI-compatible front for a prefill and a decode server on "
              "KvabiConnector: prefill, hand the KV over, stream the decode"),
    "demo": ("kvabi_vllm.tools.demo:main",
             "vLLM generating through kvabi backends, tokens compared with vLLM's own"),
    "bench": ("kvabi_vllm.tools.bench:main", "the same as `kvabi bench vllm`"),
    "guard": ("kvabi_vllm.tools.pd_guard:main",
              "a P/D pair under attack: every hostile request refused alone, honest ones "
              "served beside them"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        module, func = COMMANDS[argv[0]][0].split(":")
        return getattr(importlib.import_module(module), func)(argv[1:])
    parser = argparse.ArgumentParser(
        prog="kvabi-vllm", description="vLLM on kvabi. Each subcommand takes --help.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {k:6s} {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("command", choices=tuple(COMMANDS), help="see below")
    parser.parse_args(argv)
    return 2


if __name__ == "__main__":
    sys.exit(main())
