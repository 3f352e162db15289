"""``kvabi conformance``: run the conformance kit against backends, outside pytest.

Prints one progress line per check to stderr as it runs, then a table (check, examples,
result, worst error) to stdout, and the report of every failure: its details, the seed,
and the path of a standalone reproducer (``python FILE``).  ``--json`` prints the results
as JSON instead of the table; ``--junit-xml PATH`` also writes them as JUnit XML.  Exit
status 0 when no check failed, 1 when one did, 2 on bad usage (unknown or unavailable
backend, invalid option value).
"""
from __future__ import annotations

import argparse
import sys

from ..util.argtypes import directory_arg, float_arg, int_arg, output_file_arg, positive_int
from ..util.dtypes import DTYPES

PROFILES = ("ci", "thorough", "quick")


def _check_name(text: str) -> str:
    try:
        from ..testing.checks import CHECK_NAMES
        from ..testing.pd.checks import CHECK_NAMES as PD_CHECK_NAMES
    except ImportError:  # reported by run() with the install hint
        return text
    if text not in CHECK_NAMES + PD_CHECK_NAMES:
        raise argparse.ArgumentTypeError(f"unknown check {text!r}; checks are "
                                         f"{', '.join(CHECK_NAMES)}; with --pd "
                                         f"{', '.join(PD_CHECK_NAMES)}")
    return text


def configure(parser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="backend names")
    parser.add_argument("--pd", default=None, metavar="ENGINE",
                        help="run the P/D kit (specs/pd.md section 12) instead, against an "
                             "engine's adapter: 'reference', or MODULE:CALLABLE returning a "
                             "kvabi.testing.pd.EngineUnderTest (e.g. kvabi_vllm.tools."
                             "pd_kit:engine); --check, --json and --seed apply")
    parser.add_argument("--all", action="store_true",
                        help="every registered backend (unavailable ones are skipped)")
    parser.add_argument("--max-examples", type=positive_int, default=None, metavar="N",
                        help="examples per check (default: the profile's)")
    parser.add_argument("--seed", type=int_arg(0, 2**32 - 1, name="seed"), default=None, metavar="S",
                        help="seed (default: $KVABI_SEED, else the profile's: 0 for ci and "
                             "quick, random for thorough; always printed)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: few examples per check (profile quick)")
    parser.add_argument("--profile", default=None, choices=PROFILES,
                        help="kit profile (default: $KVABI_HYPOTHESIS_PROFILE or ci)")
    parser.add_argument("--time-budget", type=float_arg(lo=0, name="seconds"), default=None, metavar="SECONDS",
                        help="per check, stop starting examples after this long "
                             "(default: the profile's; 0: no limit)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first failing example without shrinking it")
    parser.add_argument("--check", action="append", default=None, metavar="CHECK",
                        type=_check_name, help="run only this check (repeatable)")
    parser.add_argument("--dtype", action="append", default=None, choices=DTYPES,
                        help="draw only this cache dtype (repeatable)")
    parser.add_argument("--replay", default=None, metavar="DIR", type=directory_arg,
                        help="write the reproducer of each failure into DIR (default: "
                             "$KVABI_REPLAY_DIR, else a new temporary directory)")
    parser.add_argument("--json", action="store_true",
                        help="print the results as JSON (one object per backend and check) "
                             "instead of the table")
    parser.add_argument("--junit-xml", default=None, metavar="PATH", type=output_file_arg,
                        help="also write the results as JUnit XML (one test case per "
                             "backend and check)")


def run_pd(args) -> int:
    """The P/D kit against ``args.pd``."""
    import json

    from ..util.errors import KVABIError
    from ..testing.pd import CHECK_NAMES, load_engine, report, run_kit

    bad = [c for c in args.check or () if c not in CHECK_NAMES]
    if bad:
        raise KVABIError(f"check: {bad[0]!r} is not a P/D check; they are "
                         f"{', '.join(CHECK_NAMES)}")
    if args.names or args.all:
        raise KVABIError("names: --pd runs the P/D kit against one engine, not backends")
    engine = load_engine(args.pd)
    print(f"kvabi conformance --pd: {engine.name}", file=sys.stderr)

    def show(r):
        print(f"  {r.name} {'ok' if r.ok else 'FAILED'} ({r.seconds:.1f} s)", file=sys.stderr,
              flush=True)
    results = run_kit(engine, args.check, seed=args.seed or 0, progress=show)
    failed = [r for r in results if not r.ok]
    if args.json:
        print(json.dumps([{"check": r.name, "ok": r.ok, "problems": list(r.problems),
                           "notes": list(r.notes), "seconds": round(r.seconds, 3)}
                          for r in results], indent=1))
    else:
        print("\n".join(report(results)))
        print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed ({engine.name})")
    return 1 if failed else 0


def run(args) -> int:
    from ..util.errors import KVABIError

    if args.pd is not None:
        return run_pd(args)

    try:
        from ..backend import registry
        from ..testing import checks as kit
        from ..testing import report_json, report_junit, report_table
        from ..testing.failure import failure_report
        from ..testing.profiles import kit_profile, kit_seed
        from ..testing.runner import DEFAULT, run_backend
    except ImportError as e:  # hypothesis is in the test extra
        raise KVABIError(f"conformance: the kit needs the test extra "
                         f"(pip install 'kvabi[test]'): {e}") from None
    profile = kit_profile(args.profile or ("quick" if args.quick else None))
    seed = kit_seed(args.seed, profile)
    if args.all:
        backends = registry.all_backends()
    else:
        if not args.names:
            raise KVABIError("names: give backend names or --all")
        backends = [registry.get_backend(n) for n in args.names]
        for b in backends:
            ok, why = b.available()
            if not ok:
                raise KVABIError(f"backend: {b.name!r} is unavailable here: {why}")
    checks = kit.CHECKS if not args.check else tuple(kit.get_check(c) for c in args.check)
    options = kit.KitOptions(dtypes=tuple(args.dtype) if args.dtype else None)
    print(f"kvabi conformance: profile {profile}, seed {seed} "
          f"(rerun with --seed {seed})", file=sys.stderr)

    def progress(backend_name):
        def show(check, res):
            if res is None:
                print(f"  {backend_name}  {check} ...", end="", file=sys.stderr, flush=True)
            else:
                print(f" {report_table.result_cell(res)} "
                      f"({report_table.examples_cell(res)} examples, {res.seconds:.1f} s)",
                      file=sys.stderr, flush=True)
        return show

    budget = "profile" if args.time_budget is None else (args.time_budget or None)
    results = []
    for b in backends:
        results += run_backend(b, checks=checks, options=options,
                               max_examples=args.max_examples, seed=seed, profile=profile,
                               time_budget=budget, shrink=not args.no_shrink,
                               replay=args.replay or DEFAULT,
                               progress=progress(b.name))
    failed = [r for r in results if r.failed]
    if args.junit_xml:
        try:  # the option's type checked the path's kind; permissions show only now
            path = report_junit.write(args.junit_xml, results, profile=profile, seed=seed)
        except OSError as e:
            raise KVABIError(f"junit_xml: cannot write {args.junit_xml!r}: "
                             f"{e.strerror or e}") from None
        print(f"kvabi conformance: JUnit XML written to {path}", file=sys.stderr)
    if args.json:
        print(report_json.dumps(results, profile=profile, seed=seed))
        for r in failed:
            print(failure_report(r), file=sys.stderr)
        return 1 if failed else 0
    print(report_table.table(results))
    print(report_table.LEGEND)
    for r in results:
        if r.status in ("n/a", "skipped"):
            print(f"\n{r.backend} {r.check}: {r.status}: {r.message}")
    for r in failed:
        print()
        print(failure_report(r))
    n = len([r for r in results if r.status == "passed"])
    print(f"\n{n} passed, {len(failed)} failed, "
          f"{len(results) - n - len(failed)} not applicable or skipped "
          f"(profile {profile}, seed {seed})")
    return 1 if failed else 0
