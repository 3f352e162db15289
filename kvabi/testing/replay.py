"""Standalone reproducers of conformance failures.

On a failure the kit writes a Python file holding the minimal failing example as literal
constructor calls (plain lists and numbers, no numpy reprs), the arrays the backend is
handed, and the check call.  ``python FILE`` reruns exactly that example: it prints the
failure and exits with status 1 while the bug is there, 0 once it is fixed.  It finds
the backend by its registered name, or else by importing the class that was tested
(``module:Class``, constructed without arguments).

Files go to :func:`replay_dir`: ``$KVABI_REPLAY_DIR`` or a fresh temporary directory (never
the working directory, unless asked with ``kvabi conformance --replay DIR``).
"""
from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np

#: environment variable: the directory reproducers are written to
REPLAY_ENV = "KVABI_REPLAY_DIR"
#: the literal arrays are left out of a reproducer above this many values
MAX_LITERAL_VALUES = 4096

_dir: list[Path] = []


def replay_dir() -> Path:
    """``$KVABI_REPLAY_DIR`` (created), else one temporary directory per process."""
    env = os.environ.get(REPLAY_ENV)
    if env:
        p = Path(env)
        p.mkdir(parents=True, exist_ok=True)
        return p
    if not _dir:
        _dir.append(Path(tempfile.mkdtemp(prefix="kvabi-replay-")))
    return _dir[0]


class Unrenderable(TypeError):
    """A value the reproducer cannot write as a literal."""


class _Code:
    """Python source for values, collecting the imports it needs."""

    def __init__(self):
        self.imports: set[tuple[str, str]] = set()

    def _name(self, cls) -> str:
        mod, qual = cls.__module__, cls.__qualname__
        if "<" in qual or "." in qual or mod == "__main__":
            raise Unrenderable(f"{mod}.{qual} cannot be imported by name")
        try:
            if getattr(importlib.import_module(mod), qual) is not cls:
                raise Unrenderable(f"{mod}.{qual} is not importable as such")
        except ImportError as e:
            raise Unrenderable(str(e)) from None
        self.imports.add((mod, qual))
        return qual

    def __call__(self, v, indent: int = 0) -> str:
        pad = " " * (indent + 4)
        if v is None or isinstance(v, (bool, str)):
            return repr(v)
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, int):
            return repr(int(v))
        if isinstance(v, float):
            return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
        if isinstance(v, np.ndarray):
            return self.array(v)
        if isinstance(v, (list, tuple)):
            items = [self(x, indent) for x in v]
            body = ", ".join(items)
            if isinstance(v, tuple):
                return f"({body},)" if len(items) == 1 else f"({body})"
            return f"[{body}]"
        if isinstance(v, Mapping):
            return "{" + ", ".join(f"{self(k)}: {self(x, indent)}" for k, x in v.items()) + "}"
        if attrs.has(type(v)):
            return self.attrs_call(v, indent, pad)
        return self.plain_call(v, indent, pad)

    def array(self, a: np.ndarray) -> str:
        """``np.array([...], dtype=...)`` with the values as plain Python numbers."""
        name = a.dtype.name
        if name == "bfloat16" or name.startswith("float8"):  # ml_dtypes: name them
            self.imports.add(("kvabi.util.dtypes", "numpy_dtype"))
            dt = f"numpy_dtype({name!r})"
            values = a.astype(np.float64).tolist()
        else:
            dt = repr(name)
            values = a.tolist()
        return f"np.array({_literal(values)}, dtype={dt})"

    def attrs_call(self, v, indent, pad) -> str:
        name = self._name(type(v))
        args = []
        for f in attrs.fields(type(v)):
            if not f.init:
                continue
            x = getattr(v, f.name)
            if isinstance(x, np.ndarray):
                x = x.tolist()  # attrs converters take plain lists
            if f.default is not attrs.NOTHING and not isinstance(f.default, attrs.Factory) \
                    and _same(x, f.default):
                continue
            key = f.alias if getattr(f, "alias", None) else f.name
            args.append(f"{key}={self(x, indent + 4)}")
        return _call(name, args, indent, pad)

    def plain_call(self, v, indent, pad) -> str:
        """An object whose ``__init__`` parameters are kept as (maybe private) attributes."""
        try:
            params = list(inspect.signature(type(v)).parameters.values())
        except (TypeError, ValueError):
            raise Unrenderable(f"cannot write a {type(v).__name__} literally") from None
        state = getattr(v, "__dict__", {})
        args = []
        for p in params:
            for attr in (p.name, "_" + p.name):
                if attr in state:
                    args.append(f"{p.name}={self(state[attr], indent + 4)}")
                    break
            else:
                raise Unrenderable(f"cannot write a {type(v).__name__} literally "
                                   f"(no attribute for {p.name!r})")
        return _call(self._name(type(v)), args, indent, pad)

    def header(self) -> str:
        by_module: dict[str, list[str]] = {}
        for mod, name in sorted(self.imports):
            by_module.setdefault(mod, []).append(name)
        return "\n".join(f"from {mod} import {', '.join(names)}"
                         for mod, names in by_module.items())


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - arrays and odd types: just write them
        return False


def _call(name, args, indent, pad) -> str:
    one = f"{name}({', '.join(args)})"
    if len(one) + indent <= 88:
        return one
    return f"{name}(\n{pad}" + f",\n{pad}".join(args) + f",\n{' ' * indent})"


def _literal(values) -> str:
    """Nested lists of numbers as source (floats exact; inf/nan spelled as floats)."""
    if isinstance(values, list):
        return "[" + ", ".join(_literal(x) for x in values) + "]"
    if isinstance(values, float) and not math.isfinite(values):
        return f"float({str(values)!r})"
    return repr(values)


def _wrap(text: str, width: int = 96) -> str:
    """Break a long literal after commas so the file stays readable."""
    out, line = [], ""
    for piece in re.split(r"(?<=, )", text):
        if len(line) + len(piece) > width and line:
            out.append(line.rstrip())
            line = "    "
        line += piece
    out.append(line)
    return "\n".join(out)


def _arrays(case) -> list[tuple[str, np.ndarray]]:
    inputs = case.inputs()
    return [(f.name.upper(), getattr(inputs, f.name)) for f in attrs.fields(type(inputs))
            if getattr(inputs, f.name) is not None]


def _comment(text: str) -> str:
    import textwrap

    out = []
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        out += textwrap.wrap(line, 92, initial_indent="# ",
                             subsequent_indent="# " + " " * (indent + 2)) or ["#"]
    return "\n".join(out)


_TEMPLATE = '''\
"""kvabi conformance reproducer: backend {backend!r}, check {check!r}.

Found with profile {profile}, seed {seed}; the minimal failing example is written out
below.  Run it with `python {filename}`:
it exits with status 1 while the failure is there and 0 once it is fixed.
Rerun the whole check: {rerun}
"""
import sys

import numpy as np

import kvabi
from kvabi.testing import get_check
{imports}

BACKEND = {backend!r}
#: the class that was tested, used when no installed plugin registers BACKEND
FACTORY = {factory!r}
CHECK = {check!r}

# The failure it reproduced:
{failure}

PARAMS = {params}

OPTIONS = {options}

{arrays}


def load_backend():
    """The backend under test: the registered one, else FACTORY() (module:Class)."""
    try:
        return kvabi.get_backend(BACKEND)
    except kvabi.KVABIError:
        if not FACTORY:
            raise
        import importlib

        module, _, name = FACTORY.partition(":")
        return getattr(importlib.import_module(module), name)()


def main() -> int:
    backend = load_backend()
    reference = kvabi.get_backend("reference")
    case = getattr(PARAMS, "case", PARAMS)
    for name, want in ARRAYS.items():  # the arrays the check hands the backend
        got = getattr(case.inputs(), name.lower())
        assert got.shape == want.shape and np.array_equal(
            got.astype(np.float64), want.astype(np.float64), equal_nan=True), name
    try:
        error = get_check(CHECK).function(backend, reference, PARAMS, OPTIONS)
    except Exception as e:  # noqa: BLE001 - report whatever the backend raised
        print(f"FAILED {{BACKEND}} {{CHECK}}: {{type(e).__name__}}: {{e}}")
        return 1
    print(f"passed {{BACKEND}} {{CHECK}}: error {{float(error):.3g}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def render_reproducer(res, backend, options) -> str:
    """The source of the reproducer of a failed check result."""
    from .failure import failure_report, rerun_command

    code = _Code()
    params = code(res.params)
    opts = {f.name: getattr(options, f.name) for f in attrs.fields(type(options))
            if f.name != "specs" and getattr(options, f.name) != f.default}
    options_src = code(type(options)(**opts))
    case = getattr(res.params, "case", res.params)
    arrays = _arrays(case) if hasattr(case, "inputs") else []
    n = sum(a.size for _, a in arrays)
    if n <= MAX_LITERAL_VALUES:
        body = ["# The arrays the check hands the backend (the case's seed makes them; the",
                "# reproducer checks they are still these).",
                "ARRAYS = {"]
        for name, a in arrays:
            body.append(_wrap(f"    {name!r}: {code(a)},"))
        body.append("}")
        arrays_src = "\n".join(body)
    else:
        arrays_src = (f"# The case's arrays ({n} values) come from its seed; too many to list.\n"
                      "ARRAYS = {}")
    cls = type(backend)
    factory = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<" in cls.__qualname__:
        factory = ""
    report = failure_report(attrs.evolve(res, reproducer="", example=""))
    return _TEMPLATE.format(backend=res.backend, check=res.check, profile=res.profile,
                            seed=res.seed, filename=_filename(res), rerun=rerun_command(res),
                            imports=code.header(), factory=factory,
                            failure=_comment(report), params=params, options=options_src,
                            arrays=arrays_src)


def _filename(res) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{res.backend}-{res.check}-seed{res.seed}")
    return f"repro_{safe.replace('.', '_')}.py"


def write_reproducer(res, backend, options, directory) -> Path:
    """Write the reproducer of ``res`` into ``directory``; returns its path."""
    path = Path(directory) / _filename(res)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_reproducer(res, backend, options))
    return path
