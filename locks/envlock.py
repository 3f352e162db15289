"""Lock files for the repository's two test environments (``.venv`` and ``.venv-vllm``).

A lock lists every third-party distribution, at the exact version ``make test`` passed with
(``name==version`` per line, ``#`` comments).  The packages' own metadata keeps honest ranges;
the lock is what the project tests.  A ``# removed: a b`` line names distributions the setup
uninstalls on purpose (their requirements are then allowed to be unmet).

    python locks/envlock.py check LOCK    exit 1, naming each difference, unless the running
                                          interpreter's environment is exactly LOCK
    python locks/envlock.py diff LOCK     print the differences, exit 0
    python locks/envlock.py freeze OUT [--removed NAMES] [--note TEXT]
                                          write the running environment as a lock

The repository's own distributions (installed editable from the checkout) are not locked.
Standard library only: it runs before anything else is installed.
"""
from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

#: The checkout's own distributions: installed from the working tree, never locked.
OWN = {"kvabi", "kvabi-cuda", "kvabi-tpu", "kvabi-example-torch", "kvabi-transformers",
       "kvabi-vllm"}


def norm(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path) -> tuple[dict[str, str], set[str]]:
    """({normalized name: version}, {removed names}) of a lock file."""
    pins, removed = {}, set()
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if line.startswith("# removed:"):
            removed |= {norm(x) for x in line.split(":", 1)[1].split()}
            continue
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{path}:{n}: not a 'name==version' line: {raw!r}")
        pins[norm(name.strip())] = version.strip()
    return pins, removed


def _env_distributions():
    """The distributions installed in this environment's site-packages.  Not
    ``sys.path``: an imported setuptools puts its vendored distributions there."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return metadata.distributions(path=paths)


def installed() -> dict[str, str]:
    """{normalized name: version} of every distribution of the running environment
    (the checkout's own excluded)."""
    out = {}
    for dist in _env_distributions():
        name = dist.metadata["Name"]
        if name and norm(name) not in OWN:
            out[norm(name)] = dist.version
    return out


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    """One line per distribution that differs: missing, unexpected or another version."""
    lines = []
    for name in sorted(set(pins) | set(have)):
        want, got = pins.get(name), have.get(name)
        if want == got:
            continue
        if got is None:
            lines.append(f"{name}: locked {want}, not installed")
        elif want is None:
            lines.append(f"{name}: installed {got}, not in the lock")
        else:
            lines.append(f"{name}: locked {want}, installed {got}")
    return lines


def unmet_requirements(removed: set[str]) -> list[str]:
    """Requirements of the checkout's own distributions (and of everything installed) that
    the environment does not satisfy, ignoring names the lock removes on purpose and
    requirements behind extras or markers that do not apply."""
    try:
        from packaging.requirements import Requirement
    except ImportError:          # nothing to check requirements with: the version check stands
        return []
    have = {norm(d.metadata["Name"]): d.version for d in _env_distributions()
            if d.metadata["Name"]}
    lines = []
    for dist in _env_distributions():
        owner = dist.metadata["Name"]
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            name = norm(req.name)
            if name in removed:
                continue
            if name not in have:
                lines.append(f"{owner} requires {req}: not installed")
            elif req.specifier and not req.specifier.contains(have[name], prereleases=True):
                lines.append(f"{owner} requires {req}: installed {have[name]}")
    return sorted(set(lines))


def check(lock) -> list[str]:
    """Every way the running environment differs from ``lock`` (empty: it is the lock)."""
    pins, removed = read_lock(lock)
    return differences(pins, installed()) + unmet_requirements(removed)


def freeze(out, removed=(), note="") -> None:
    """Write the running environment as a lock file."""
    have = installed()
    lines = [f"# The exact third-party distributions the tests ran with ({Path(out).name}).",
             "# Written by `make lock`; installed with `pip install --no-deps -r` by make setup.",
             f"# Python {sys.version.split()[0]}."]
    if note:
        lines.append(f"# {note}")
    if removed:
        lines.append("# removed: " + " ".join(sorted(norm(r) for r in removed)))
    lines += [f"{name}=={have[name]}" for name in sorted(have)]
    Path(out).write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="envlock", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for cmd, what in (("check", "exit 1 unless this environment is exactly LOCK"),
                      ("diff", "print how this environment differs from LOCK")):
        sp = sub.add_parser(cmd, help=what)
        sp.add_argument("lock", help="a lock file, e.g. locks/core.txt")
    sp = sub.add_parser("freeze", help="write this environment as a lock file")
    sp.add_argument("out", help="the lock file to write")
    sp.add_argument("--removed", default="", help="distributions the setup removes on purpose")
    sp.add_argument("--note", default="", help="a comment line for the header")
    args = p.parse_args(argv)
    if args.cmd == "freeze":
        freeze(args.out, args.removed.split(), args.note)
        return 0
    lines = check(args.lock)
    for line in lines:
        print(line)
    if args.cmd == "diff":
        print(f"{len(lines)} difference(s) from {args.lock}" if lines
              else f"this environment is exactly {args.lock}")
        return 0
    if lines:
        print(f"this environment ({sys.prefix}) differs from {args.lock} in {len(lines)} "
              f"place(s); recreate it (make clean setup) or refresh the lock (make lock)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
