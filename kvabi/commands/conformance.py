"""``kvabi conformance``: run the conformance kit against backends, outside pytest.

Prints one progress line per check to stderr as it runs, then a table (check, examples,
result, worst error) to stdout, and the minimal failing example of every failure.  Exit
status 1 when any check fails, 2 on bad usage (unknown or unavailable backend).
"""
from __future__ import annotations

import random
import sys

from ..dtypes import DTYPES


def configure(parser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="backend names")
    parser.add_argument("--all", action="store_true",
                        help="every registered backend (unavailable ones are skipped)")
    parser.add_argument("--max-examples", type=int, default=None, metavar="N",
                        help="examples per check (default: the profile's)")
    parser.add_argument("--seed", type=int, default=None, metavar="S",
                        help="Hypothesis seed (default: random, printed for reruns)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: few examples per check")
    parser.add_argument("--profile", default=None,
                        help="Hypothesis profile: ci, thorough, quick (default: "
                             "$KVABI_HYPOTHESIS_PROFILE or ci)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="per check, stop starting examples after this long "
                             "(default: the profile's; 0: no limit)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first failing example without shrinking it")
    parser.add_argument("--check", action="append", default=None, metavar="CHECK",
                        help="run only this check (repeatable)")
    parser.add_argument("--dtype", action="append", default=None, choices=DTYPES,
                        help="draw only this cache dtype (repeatable)")


def _fmt_err(r) -> str:
    if r.status in ("n/a", "skipped") or r.examples == 0:
        return "-"
    if r.refused == r.examples:
        return "- (all refused)"
    if r.exact:
        return "0 (byte-exact)" if r.worst == 0 else f"{r.worst:.2e}"
    if r.closest is None:
        return f"{r.worst:.2e}"
    err, tol, dtype = r.closest
    return f"{err:.2e} (tol {tol:.0e} {dtype})"


def _fmt_examples(r) -> str:
    if r.budget_hit:
        return f"{r.examples}/{r.max_examples}"
    return str(r.examples)


def _result(r) -> str:
    if r.status == "passed" and r.refused:
        return f"passed ({r.refused} refused)"
    return r.status


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args) -> int:
    from ..errors import KVABIError

    try:
        from .. import registry
        from ..testing import checks as kit
        from ..testing.profiles import load_profile
        from ..testing.runner import run_backend
    except ImportError as e:  # hypothesis is in the test extra
        raise KVABIError(f"conformance: the kit needs the test extra "
                         f"(pip install 'kvabi[test]'): {e}") from None
    profile = load_profile("quick" if args.quick and not args.profile else args.profile)
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
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"kvabi conformance: profile {profile}, seed {seed} "
          f"(rerun with --seed {seed})", file=sys.stderr)

    def progress(backend_name):
        def show(check, res):
            if res is None:
                print(f"  {backend_name}  {check} ...", end="", file=sys.stderr, flush=True)
            else:
                print(f" {_result(res)} ({_fmt_examples(res)} examples, {res.seconds:.1f} s)",
                      file=sys.stderr, flush=True)
        return show

    budget = "profile" if args.time_budget is None else (args.time_budget or None)
    results = []
    for b in backends:
        results += run_backend(b, checks=checks, options=options,
                               max_examples=args.max_examples, seed=seed, time_budget=budget,
                               shrink=not args.no_shrink, progress=progress(b.name))
    rows = [["BACKEND", "CHECK", "EXAMPLES", "RESULT", "WORST ERROR", "SECONDS"]]
    for r in results:
        rows.append([r.backend, r.check, _fmt_examples(r), _result(r), _fmt_err(r),
                     f"{r.seconds:.1f}"])
    print(_table(rows))
    print("(worst error: the example closest to its tolerance; relative L2 of the output or "
          "absolute lse error; n/m examples: the time budget stopped the check early)")
    failed = [r for r in results if r.failed]
    for r in results:
        if r.status in ("n/a", "skipped"):
            print(f"\n{r.backend} {r.check}: {r.status}: {r.message}")
    for r in failed:
        print(f"\nFAILED {r.backend} {r.check}: {r.message}")
        if r.example:
            print(r.example)
    n = len([r for r in results if r.status == "passed"])
    print(f"\n{n} passed, {len(failed)} failed, "
          f"{len(results) - n - len(failed)} not applicable or skipped (seed {seed})")
    return 1 if failed else 0
