"""``kvabi bench SUITE [ARGS...]``: run a built-in or plugin-provided benchmark suite.

A suite parses its own arguments with argparse; while it runs, argparse's usage errors are
raised as :class:`kvabi.commands.cli.UsageError`, so every suite's (plugins' included) prints the
one-line ``kvabi: error: bench SUITE: ...`` form of ``specs/security.md``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys

from ..util.errors import KVABIError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("suite", nargs="?", help="suite name (omit to list the suites)")
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="arguments passed to the suite (e.g. --json)")


def _builtin_transforms(argv):
    from ..bench import transforms

    return transforms.run(argv)


def _builtin_layout(argv):
    from ..bench import layout

    return layout.run(argv)


def _builtin_overhead(argv):
    from ..bench import overhead

    return overhead.run(argv)


def _builtin_transfer(argv):
    from ..bench import transfer

    return transfer.run(argv)


def _builtin_probe(argv):
    from ..bench import probe

    return probe.run(argv)


def _builtin_quant(argv):
    from ..bench import quant

    return quant.run(argv)


def suites() -> dict:
    """{name: callable(argv) -> int}: the built-in suites plus those of plugins."""
    found = {"transforms": _builtin_transforms, "layout": _builtin_layout,
             "overhead": _builtin_overhead, "transfer": _builtin_transfer, "probe": _builtin_probe,
             "quant": _builtin_quant}
    try:
        from ..backend import registry
    except ImportError:  # registry not available: built-in suites only
        return found
    # One hook implementation at a time, so that a broken plugin cannot hide the others.
    for impl in registry.plugin_manager().hook.kvabi_bench_suites.get_hookimpls():
        try:
            contributed = impl.function()
            items = list((contributed or {}).items())
        except Exception as e:  # noqa: BLE001 - foreign code; report and go on
            print(f"kvabi: warning: plugin {impl.plugin_name!r} failed to list bench suites: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
            continue
        for name, fn in items:
            if isinstance(name, str) and callable(fn):
                found.setdefault(name, fn)
    return found


@contextlib.contextmanager
def _one_line_usage_errors(suite: str):
    """argparse's ``error`` raising UsageError (printed by ``kvabi.commands.cli.main`` as one line)
    instead of printing the usage block and exiting, for as long as a suite runs."""
    from .cli import UsageError

    def error(parser, message):
        raise UsageError(f"bench {suite}: {message} (see '{parser.prog} --help')")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def run(args) -> int:
    available = suites()
    if args.suite is None:
        for name in sorted(available):
            print(name)
        return 0
    if args.suite not in available:
        raise KVABIError(f"suite: unknown benchmark suite {args.suite!r}; available: "
                         f"{', '.join(sorted(available))}")
    with _one_line_usage_errors(args.suite):
        return int(available[args.suite](list(args.args)) or 0)
