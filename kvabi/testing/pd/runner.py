"""Running the P/D kit: each role the engine speaks, its checks in order, the engine started
once per role; a report per check."""
from __future__ import annotations

import time

import attrs

from .checks import CHECKS, SETTINGS, CheckResult, Context
from .engine import EngineUnderTest


def check_name(role: str, fn) -> str:
    return f"{role}.{fn.__name__.split('_', 1)[1]}"


def run_kit(engine: EngineUnderTest, checks=None, *, settings=SETTINGS, seed: int = 0,
            progress=None) -> list[CheckResult]:
    """Every check (or those named in ``checks``) against ``engine``; ``progress(result)``
    after each."""
    out = []
    for role, fns in CHECKS.items():
        fns = [f for f in fns if checks is None or check_name(role, f) in checks]
        if not fns or role not in engine.roles:
            continue
        engine.start(role, settings)
        ctx = Context(engine, settings, seed)
        try:
            for f in fns:
                t0 = time.monotonic()
                try:
                    r = f(ctx)
                except Exception as e:  # noqa: BLE001 - a check that raises failed
                    r = CheckResult(check_name(role, f), (f"raised {type(e).__name__}: {e}",))
                r = attrs.evolve(r, name=check_name(role, f), seconds=time.monotonic() - t0)
                out.append(r)
                if progress is not None:
                    progress(r)
        finally:
            ctx.close()
            engine.stop()
    return out


def report(results) -> list[str]:
    """Lines of a report: one per check, then its problems."""
    lines = []
    for r in results:
        lines.append(f"{r.name:26} {'ok' if r.ok else 'FAILED':7} {r.seconds:6.1f} s"
                     + (f"  ({'; '.join(r.notes)})" if r.notes and r.ok else ""))
        lines += [f"    {p}" for p in r.problems]
    return lines


def load_engine(spec: str) -> EngineUnderTest:
    """The engine a command line names: ``reference``, or ``module:callable`` returning an
    :class:`EngineUnderTest` (a class or a factory)."""
    from ...util.errors import KVABIError

    if spec == "reference":
        from .reference import ReferenceEngine

        return ReferenceEngine(preset="flashinfer.HND", label="engine")
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise KVABIError(f"--pd: 'reference' or MODULE:CALLABLE, got {spec!r:.80}")
    import importlib

    try:
        target = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise KVABIError(f"--pd: cannot load {spec!r:.80}: {e}") from None
    engine = target()
    if not isinstance(engine, EngineUnderTest):
        raise KVABIError(f"--pd: {spec} gave a {type(engine).__name__}, not an "
                         "EngineUnderTest")
    return engine


__all__ = ["load_engine", "report", "run_kit"]
