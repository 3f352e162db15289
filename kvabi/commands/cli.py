"""The ``kvabi`` command.  Each subcommand lives in ``kvabi.commands.<name>`` and provides
``configure(parser)`` and ``run(args) -> int``; only the one invoked is imported, so a
subcommand that needs a heavy or missing dependency never breaks the others.

Errors: a :class:`~kvabi.KVABIError` (bad input: a file, a config, a descriptor) or a usage
error (an unknown option, a bad option value; see :mod:`kvabi.util.argtypes`) prints one
line, ``kvabi: error: <message>``, on stderr and exits with status 2.  ``--debug`` (before
or after the command) or ``KVABI_DEBUG=1`` also prints the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from ..util.errors import KVABIError

SUBCOMMANDS = {
    "backends": "list attention backends, their availability and capabilities",
    "plan": "plan KV cache memory for model configs",
    "conformance": "run the conformance kit against a backend",
    "bench": "run a benchmark suite (transforms, tpu, cuda, ...)",
    "probe": "infer the layout a backend's write_kv really produces; compare to its declared one",
    "layout": "draw one block of a layout (a preset or a descriptor file) as a byte map",
    "proxy": "an OpenAI-compatible P/D front for a producer and a consumer server",
}

#: exit status of a KVABIError or a usage error
EXIT_USAGE = 2


class UsageError(KVABIError):
    """A command line argparse refused (unknown option, bad value, missing argument)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are raised (and printed by :func:`main` as one line)
    instead of printing the usage and exiting."""

    def error(self, message):
        cmd = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        where = f"{cmd}: " if cmd else ""
        raise UsageError(f"{where}{message} (see '{self.prog} --help')")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only``, just that subcommand is configured."""
    p = Parser(
        prog="kvabi", description="kvabi: the KV cache ABI: specs, layouts, metadata, backends.")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of an error (also KVABI_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, help_ in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if only is None or name == only:
            mod = importlib.import_module(f"kvabi.commands.{name}")
            mod.configure(sp)
            if not any("--debug" in a.option_strings for a in sp._actions):
                sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                help="print the traceback of an error")
            sp.set_defaults(_run=mod.run)
    return p


def main(argv=None) -> int:
    """Run the command; returns the exit status (2 for bad input or usage)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Known before parsing, so that a usage error's traceback can be shown too.
    debug = "--debug" in argv or os.environ.get("KVABI_DEBUG", "") not in ("", "0")
    only = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(only if only in SUBCOMMANDS else "").parse_args(argv)
        return int(args._run(args) or 0)
    except KVABIError as e:
        if debug:
            traceback.print_exc()
        print(f"kvabi: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
