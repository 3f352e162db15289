"""The tree keeps its architecture: no import circles anywhere in the project's packages, and
kvabi's packages import only what their ``__init__`` says they may (the layering: helpers <-
model <- layout <- memory <- step <- backend <- transfer/probe/testing <- bench <- commands).

Read from the source (every ``import`` statement, at module level or inside a function), so
a lazy import cannot hide a circle; nothing is imported or run.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: every importable package of the project: (source folder, top-level package)
PACKAGES = [(ROOT, "kvabi"), (ROOT / "backends/cuda", "kvabi_cuda"),
            (ROOT / "backends/tpu", "kvabi_tpu"),
            (ROOT / "integrations/vllm", "kvabi_vllm"),
            (ROOT / "integrations/transformers", "kvabi_transformers"),
            (ROOT / "examples/thirdparty-backend", "kvabi_example_torch")]
MAY_IMPORT = re.compile(r"^May import: (.*)\.$", re.M)


def modules(base: Path, top: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of package ``top`` under ``base``."""
    out = {}
    for path in sorted((base / top).rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[tuple[str, int]]:
    """(module imported, line) for every import statement of module ``name``, resolved to
    the most specific module of ``known`` (``from pkg import mod`` names ``pkg.mod``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:  # an attribute of a module
                t = t.rpartition(".")[0]
            if t in known and t != name:
                found.add((t, node.lineno))
    return found


def graph() -> dict[str, set[tuple[str, int]]]:
    known = {}
    for base, top in PACKAGES:
        found = modules(base, top)
        assert found, f"no package {top} under {base.relative_to(ROOT)}"
        known.update(found)
    return {name: imports(name, path, known) for name, path in known.items()}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``edges`` (a list of nodes, first == last) or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                hit = visit(m)
                if hit:
                    return hit
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state:
            hit = visit(n)
            if hit:
                return hit
    return None


def declared_layers() -> dict[str, set[str]]:
    """kvabi package -> the kvabi packages its ``__init__`` docstring says it may import."""
    out = {}
    for init in sorted((ROOT / "kvabi").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        m = MAY_IMPORT.search(doc)
        assert m, f"{init.relative_to(ROOT)}: its docstring lacks a 'May import: ...' line"
        words = m.group(1)
        out[init.parent.name] = (set() if words == "nothing of kvabi"
                                 else {w.strip() for w in words.split(",")})
    return out


def test_no_import_circles():
    edges = {n: {t for t, _ in ts} for n, ts in graph().items()}
    circle = find_circle(edges)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_kvabi_packages_keep_their_layers():
    layers = declared_layers()
    unknown = {p: ws - set(layers) for p, ws in layers.items() if ws - set(layers)}
    assert not unknown, f"'May import' names packages that do not exist: {unknown}"
    circle = find_circle(layers)
    assert circle is None, "the declared layers form a circle: " + " -> ".join(circle)
    wrong = []
    for name, targets in graph().items():
        parts = name.split(".")
        if parts[0] != "kvabi":
            continue
        for t, line in sorted(targets):
            tp = t.split(".")
            if tp[0] != "kvabi":
                continue
            if len(tp) == 1:  # the facade: nothing inside kvabi imports it
                wrong.append(f"{name}:{line} imports kvabi itself")
            elif len(parts) > 1 and tp[1] != parts[1] and tp[1] not in layers[parts[1]]:
                wrong.append(f"{name}:{line} imports {t} (kvabi.{parts[1]} may import "
                             f"{', '.join(sorted(layers[parts[1]])) or 'nothing of kvabi'})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_flat_modules_in_kvabi():
    """kvabi/ holds packages and its facade; a new module goes into the package it belongs to."""
    flat = sorted(p.name for p in (ROOT / "kvabi").glob("*.py") if p.name != "__init__.py")
    assert not flat, f"modules directly under kvabi/: {flat}"


@pytest.mark.parametrize("edges, circle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}, ["a2", "b", "a2"]),
])
def test_the_circle_finder_finds_circles(edges, circle):
    assert find_circle(edges) == circle


def test_imports_are_resolved_from_the_source(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import g\n    from . import c\n")
    (pkg / "b.py").write_text("import p.sub.a\n")
    (pkg / "sub" / "c.py").write_text("")
    known = modules(tmp_path, "p")
    got = imports("p.sub.a", known["p.sub.a"], known)
    assert got == {("p.b", 2), ("p.sub.c", 3)}
    assert imports("p.b", known["p.b"], known) == {("p.sub.a", 1)}
