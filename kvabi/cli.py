"""The ``kvabi`` command.  Each subcommand lives in ``kvabi.commands.<name>`` and provides
``configure(parser)`` and ``run(args) -> int``; only the one invoked is imported, so a
subcommand that needs a heavy or missing dependency never breaks the others."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import KVABIError

SUBCOMMANDS = {
    "backends": "list attention backends, their availability and capabilities",
    "plan": "plan KV cache memory for model configs",
    "conformance": "run the conformance kit against a backend",
    "bench": "run a benchmark suite (transforms, tpu, cuda, ...)",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that subcommand is configured."""
    p = argparse.ArgumentParser(
        prog="kvabi", description="kvabi: the KV cache ABI: specs, layouts, metadata, backends.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, help_ in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if only is None or name == only:
            mod = importlib.import_module(f"kvabi.commands.{name}")
            mod.configure(sp)
            sp.set_defaults(_run=mod.run)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    only = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only if only in SUBCOMMANDS else "").parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KVABIError as e:
        print(f"kvabi: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
