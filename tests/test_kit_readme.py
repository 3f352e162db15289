"""README's "Writing a backend" stays true: its skeleton has the ABI's signatures, registers
and is refused what it does not claim (by the base class); it follows the worked example;
and README and specs/conformance.md say the same about the kit's three entry points."""
from __future__ import annotations

import importlib.metadata
import inspect
import re
import types
from pathlib import Path

import numpy as np
import pytest

import kvabi
from kvabi.backend import registry

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
SECTION = README.split("## Writing a backend", 1)[1].split("\n## ", 1)[0]
EXAMPLE = ROOT / "examples" / "thirdparty-backend"


def skeleton() -> types.ModuleType:
    code = re.search(r"```python\n(# mypkg/plugin.py.*?)```", SECTION, re.S).group(1)
    module = types.ModuleType("readme_plugin")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    return module


def params(fn) -> list[tuple]:
    """Names, kinds and defaults of a function's parameters (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def entry_points_text(text: str) -> str:
    block = re.search(r"(Run it three ways\..*?chooses where reproducers go\)\.)", text, re.S)
    assert block, "the entry-point paragraphs are missing"
    return " ".join(block.group(1).split())


def test_readme_and_spec_describe_the_entry_points_identically():
    spec = (ROOT / "specs" / "conformance.md").read_text()
    assert entry_points_text(SECTION) == entry_points_text(spec)


def test_skeleton_has_the_abi_signatures_and_registers(monkeypatch):
    mod = skeleton()
    cls = mod.MyBackend
    for name in ("capabilities", "preferred_layouts", "prepare", "write", "attend"):
        assert params(getattr(cls, name)) == params(getattr(kvabi.Backend, name)), name
    for name in ("plan", "write_kv", "attention"):  # the base class's, not overridden
        assert getattr(cls, name) is getattr(kvabi.Backend, name), name
    assert cls.abi_version == kvabi.ABI_VERSION
    monkeypatch.setenv(registry.ENV_ALLOW, "")
    registry.reset()
    try:
        assert registry.plugin_problems(mod) == []
        registry.register(mod, name="readme")
        assert "vendor.mine" in registry.backend_names()
        assert registry.refused() == [] and registry.warnings() == []
    finally:
        registry.reset()


def test_skeleton_is_refused_what_it_does_not_claim():
    backend = skeleton().MyBackend()
    meta = kvabi.CommonAttentionMetadata.from_lengths([2], [0], [[0]], 16, num_blocks=1)
    for dtype, refused in (("float32", True), ("bfloat16", False)):
        spec = kvabi.KVSpec("full", 16, 2, 64, dtype=dtype)
        layout = kvabi.Layout.preset("flashinfer.HND", spec, num_blocks=1)
        if refused:
            with pytest.raises(kvabi.UnsupportedError, match="dtype 'float32'"):
                backend.plan(meta, spec, layout, num_q_heads=2)
        else:
            plan = backend.plan(meta, spec, layout, num_q_heads=2)
    with pytest.raises(kvabi.KVABIError, match="sinks"):
        backend.plan(meta, spec, layout, num_q_heads=2, sinks=np.zeros(2))  # not claimed
    with pytest.raises(kvabi.KVABIError, match="cache: must be a kvabi.KVCache"):
        backend.write_kv(plan, [np.zeros(3)], key=None, value=None)


def test_skeleton_follows_the_worked_example():
    source = (EXAMPLE / "kvabi_example_torch" / "backend.py").read_text()
    plugin = (EXAMPLE / "kvabi_example_torch" / "plugin.py").read_text()
    for call in ("def prepare(self, plan):", "def write(self, plan, cache, key, value, layer):",
                 "def attend(self, plan, cache, query, layer, sinks, out, return_lse):"):
        assert call in SECTION and call in source, call
    assert "@kvabi.hookimpl\ndef kvabi_backends():" in plugin
    assert "[project.entry-points.kvabi]" in (EXAMPLE / "pyproject.toml").read_text()


def test_worked_example_is_installed_and_registered():
    """``make test`` installs examples/thirdparty-backend; its entry point loads."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="kvabi")}
    assert "example-torch" in names
    registry.reset()
    backend = registry.get_backend("example.torch")
    assert backend.available()[0] and backend.framework == "torch"
    assert not [r for r in registry.refused() if r.plugin == "example-torch"]
