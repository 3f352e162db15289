"""The plugin registry: entry points, the KVABI_PLUGINS allow-list, refusals, errors.

Third-party plugins are simulated by the modules in ``tests/plugins`` exposed through a fake
installed distribution (``importlib.metadata.distributions`` is monkeypatched, which is what
pluggy's entry-point loader reads), and by programmatic registration.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

import pytest

import kvabi
from kvabi import KVABIError
from kvabi.backend import registry
from kvabi.commands import backends as backends_cmd
from kvabi.backend.reference import ReferenceBackend

PLUGINS = Path(__file__).parent / "plugins"
PLUGIN_MODULES = ("kvabi_fake_plugin", "kvabi_broken_plugin", "kvabi_future_plugin",
                  "kvabi_unmarked_plugin", "kvabi_misspelled_plugin", "kvabi_empty_plugin")
#: entry points really installed here (built-in backends may add some beside "reference")
REAL = {ep.name for ep in importlib.metadata.entry_points(group="kvabi")}


class FakeDist:
    """Just enough of an importlib.metadata.Distribution for pluggy."""

    def __init__(self, eps):
        self.entry_points = [importlib.metadata.EntryPoint(n, v, "kvabi") for n, v in eps]
        self.metadata = {"name": "kvabi-fake-thirdparty", "version": "0.0.1"}
        self.version = "0.0.1"
        self._normalized_name = "kvabi_fake_thirdparty"  # read by entry_points()


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(registry.ENV_ALLOW, raising=False)
    for m in PLUGIN_MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    registry.reset()
    yield
    registry.reset()


@pytest.fixture
def install(monkeypatch):
    """install(("name", "module"), ...): a fake distribution declaring those entry points."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    real = list(importlib.metadata.distributions())

    def go(*eps):
        dist = FakeDist(eps)
        monkeypatch.setattr(importlib.metadata, "distributions",
                            lambda **kw: iter(real + [dist]))
        registry.reset()
        return dist

    return go


def refused_by_name():
    return {r.name: r for r in registry.refused()}


def backend(name, abi=kvabi.ABI_VERSION):
    b = kvabi.Backend()
    b.name, b.abi_version = name, abi
    return b


class Plugin:
    """A programmatic plugin returning the given objects."""

    def __init__(self, *items):
        self.items = items

    @kvabi.hookimpl
    def kvabi_backends(self):
        return list(self.items)


# -- loading ---------------------------------------------------------------------------------
def test_reference_always_present_and_first(monkeypatch):
    assert registry.backend_names()[0] == "reference"
    assert isinstance(registry.get_backend("reference"), ReferenceBackend)
    assert kvabi.get_backend("reference") is registry.get_backend("reference")
    monkeypatch.setenv(registry.ENV_ALLOW, "")
    registry.reset()
    assert registry.backend_names() == ["reference"]
    assert registry.refused() == []
    monkeypatch.setenv(registry.ENV_ALLOW, "something.else")
    registry.reset()
    assert registry.backend_names() == ["reference"]


def test_entry_point_plugin_is_loaded(install):
    dist = install(("fake", "kvabi_fake_plugin"))
    names = registry.backend_names()
    assert names[0] == "reference" and "fake.one" in names
    b = registry.get_backend("fake.one")
    assert type(b).__name__ == "FakeBackend" and b.available() == (False,
                                                                   "fake: no such hardware")
    assert b in registry.all_backends()
    pm = registry.plugin_manager()
    assert pm.has_plugin("fake") and pm.has_plugin("reference")
    assert any(d.metadata is dist.metadata for _, d in pm.list_plugin_distinfo())
    assert registry.refused() == []


def test_allow_list(install, monkeypatch):
    install(("fake", "kvabi_fake_plugin"), ("future", "kvabi_future_plugin"))
    monkeypatch.setenv(registry.ENV_ALLOW, "fake")
    registry.reset()
    assert "fake.one" in registry.backend_names()
    assert "future.minor" not in registry.backend_names()
    assert set(registry.disabled_plugins()) - REAL == {"future"}
    assert "kvabi_future_plugin" not in sys.modules  # not even imported
    with pytest.raises(KVABIError, match="KVABI_PLUGINS: .*future"):
        registry.get_backend("future.minor")
    monkeypatch.setenv(registry.ENV_ALLOW, " future , not-installed ")
    registry.reset()
    names = registry.backend_names()
    assert "future.minor" in names and "fake.one" not in names and names[0] == "reference"
    monkeypatch.setenv(registry.ENV_ALLOW, "reference")  # the core plugin needs no listing
    registry.reset()
    assert registry.backend_names() == ["reference"]
    assert set(registry.disabled_plugins()) == {"fake", "future"} | (REAL - {"reference"})


def test_abi_major_is_refused_newer_minor_accepted(install):
    install(("future", "kvabi_future_plugin"))
    assert "future.minor" in registry.backend_names()
    assert registry.get_backend("future.minor").abi_version[1] == kvabi.ABI_VERSION[1] + 7
    assert "future.major" not in registry.backend_names()
    r = refused_by_name()["future.major"]
    assert r.plugin == "future" and f"ABI {kvabi.ABI_VERSION[0] + 1}.0" in r.reason
    with pytest.raises(KVABIError, match=r"'future.major' was refused.*major versions must "):
        registry.get_backend("future.major")


def test_broken_plugin_does_not_break_kvabi(install):
    install(("broken", "kvabi_broken_plugin"), ("fake", "kvabi_fake_plugin"),
            ("ghost", "kvabi_no_such_module_anywhere"))
    names = registry.backend_names()
    assert names[0] == "reference" and "fake.one" in names
    refused = refused_by_name()
    assert "missing native library" in refused["broken"].reason
    assert "RuntimeError" in refused["broken"].reason
    assert "ModuleNotFoundError" in refused["ghost"].reason
    assert not registry.plugin_manager().has_plugin("broken")
    with pytest.raises(KVABIError, match="failed to load"):
        registry.get_backend("broken")
    with pytest.raises(KVABIError, match="plugins that failed to load or provide nothing: broken"):
        registry.get_backend("cuda.nothing")


def test_same_module_under_two_entry_points_is_refused_once(install):
    install(("fake", "kvabi_fake_plugin"), ("fake2", "kvabi_fake_plugin"))
    assert registry.backend_names().count("fake.one") == 1
    assert "already registered" in refused_by_name()["fake2"].reason


# -- backends from plugins ---------------------------------------------------------------------
def test_duplicate_backend_names_keep_the_first():
    first, second = backend("dup.x"), backend("dup.x")
    registry.register(Plugin(first), name="p1")
    registry.register(Plugin(second), name="p2")
    assert registry.get_backend("dup.x") is first
    assert registry.backend_names().count("dup.x") == 1
    r = refused_by_name()["dup.x"]
    assert r.plugin == "p2" and "duplicate" in r.reason
    # Nobody can shadow the oracle.
    registry.register(Plugin(backend("reference")), name="p3")
    assert isinstance(registry.get_backend("reference"), ReferenceBackend)
    assert any(r.plugin == "p3" and "duplicate" in r.reason for r in registry.refused())


class Raising:
    @kvabi.hookimpl
    def kvabi_backends(self):
        raise OSError("driver not found")


def test_bad_hooks_and_objects_are_refused_with_reasons():
    registry.register(Raising(), name="raiser")
    registry.register(Plugin(object(), backend("Bad Name!"), backend("badabi", "1.0"),
                             backend("boolabi", (True, False)), backend("negabi", (1, -1)),
                             backend("fine.one"), backend("fine.two\n")), name="mixed")
    names = registry.backend_names()
    assert "fine.one" in names and names[0] == "reference"
    reasons = {(r.plugin, r.name): r.reason for r in registry.refused()}
    assert "OSError: driver not found" in reasons[("raiser", "raiser")]
    assert "not a kvabi.Backend" in reasons[("mixed", "mixed")]
    assert "invalid backend name" in reasons[("mixed", "Bad Name!")]
    assert "invalid backend name" in reasons[("mixed", "fine.two\n")]  # matched whole
    assert "abi_version" in reasons[("mixed", "badabi")]
    assert "abi_version" in reasons[("mixed", "boolabi")]  # a bool is not a version number
    assert "abi_version" in reasons[("mixed", "negabi")]


class WrongSignature:
    @kvabi.hookimpl
    def kvabi_backends(self, not_in_spec):
        return []


def test_register_errors():
    registry.register(Plugin(backend("a.b")), name="mine")
    with pytest.raises(KVABIError, match="mine"):
        registry.register(Plugin(), name="mine")
    with pytest.raises(KVABIError, match="not_in_spec"):
        registry.register(WrongSignature(), name="wrong")
    assert "a.b" in registry.backend_names()


def test_register_invalidates_and_reset_forgets():
    names = registry.backend_names()
    assert "late.one" not in names
    registry.register(Plugin(backend("late.one")))
    assert "late.one" in registry.backend_names()
    registry.reset()
    assert "late.one" not in registry.backend_names()


def test_get_backend_unknown_lists_known_names():
    registry.register(Plugin(backend("x.y")), name="xy")
    with pytest.raises(KVABIError, match=r"no backend named 'nope'; known: reference, .*x\.y"):
        registry.get_backend("nope")


# -- kvabi backends ------------------------------------------------------------------------
def run_cmd(argv, capsys):
    p = argparse.ArgumentParser()
    backends_cmd.configure(p)
    assert backends_cmd.run(p.parse_args(argv)) == 0
    return capsys.readouterr().out


def test_backends_command_table_and_json(install, monkeypatch, capsys):
    install(("fake", "kvabi_fake_plugin"), ("future", "kvabi_future_plugin"),
            ("broken", "kvabi_broken_plugin"), ("off", "kvabi_fake_plugin"))
    monkeypatch.setenv(registry.ENV_ALLOW, "fake,future,broken")
    registry.reset()
    out = run_cmd([], capsys)
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["NAME", "AVAILABLE", "ABI"]
    abi = ".".join(map(str, kvabi.ABI_VERSION))
    assert lines[1].split() == ["reference", "yes", abi, "all", "all", "any", "any", "yes",
                                "yes"]
    fake = next(l for l in lines if l.startswith("fake.one"))
    assert fake.split() == ["fake.one", "no", abi, "full", "float16", "64,128", "16",
                            "no", "no"]
    assert "fake: no such hardware" in out and "flashinfer.HND" in out
    assert "refused:" in out and "future.major (plugin future)" in out
    assert "broken: plugin failed to load" in out
    off = next(l for l in lines if l.startswith("not loaded (not in KVABI_PLUGINS): "))
    assert "off" in off.split(": ", 1)[1].split(", ")
    data = json.loads(run_cmd(["--json", "--kind", "mla", "--head-dim", "576"], capsys))
    assert data["kvabi_abi"] == list(kvabi.ABI_VERSION)
    by = {b["name"]: b for b in data["backends"]}
    assert by["reference"]["available"] and by["reference"]["reason"] == "numpy float64"
    assert by["reference"]["capabilities"]["sinks"] is True
    assert by["reference"]["preferred_layouts"] == list(
        ReferenceBackend().preferred_layouts(kvabi.KVSpec("mla", 16, 1, 576)))
    assert by["fake.one"]["capabilities"]["head_dims"] == [64, 128]
    assert {r["name"] for r in data["refused"]} >= {"future.major", "broken"}
    assert set(data["disabled"]) - REAL == {"off"}
    assert data["typical_spec"]["kind"] == "mla"


class Exploding(kvabi.Backend):
    name = "boom.caps"

    def capabilities(self, spec=None):
        raise RuntimeError("caps exploded")

    def preferred_layouts(self, spec):
        raise RuntimeError("layouts exploded")


class Ranged(kvabi.Backend):
    name = "ranged.dims"

    def capabilities(self, spec=None):
        return kvabi.Capabilities(head_dims=tuple(range(8, 264, 8)), block_size_multiple=256)

    def preferred_layouts(self, spec):
        return ()


def test_backends_command_survives_a_raising_backend(capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_ALLOW, "")  # installed backends are not the subject here
    registry.register(Plugin(Exploding(), Ranged()), name="boom")
    out = run_cmd([], capsys)
    ranged = next(l for l in out.splitlines() if l.startswith("ranged.dims")).split()
    assert ranged[5:8] == ["8..256/8", "any", "(x256)"]
    assert "boom.caps" in out and "capabilities() raised RuntimeError: caps exploded" in out
    assert "preferred_layouts() raised RuntimeError: layouts exploded" in out


# -- plugins that register nothing: refused or warned, never silent ---------------------------
def test_misregistered_entry_points_are_refused_with_the_reason(install, capsys, monkeypatch):
    install(("unmarked", "kvabi_unmarked_plugin"), ("misspelled", "kvabi_misspelled_plugin"),
            ("empty", "kvabi_empty_plugin"), ("fake", "kvabi_fake_plugin"))
    # Only these: installed backends initializing under the fake distribution list (jax
    # caches its device discovery) would stay broken for the rest of the session.
    monkeypatch.setenv(registry.ENV_ALLOW, "unmarked,misspelled,empty,fake")
    registry.reset()
    names = registry.backend_names()
    assert "fake.one" in names
    assert "unmarked.one" not in names and "misspelled.one" not in names
    refused = refused_by_name()
    assert "kvabi_backends lacks @kvabi.hookimpl" in refused["unmarked"].reason
    assert "kvabi_unmarked_plugin loads but provides no backend" in refused["unmarked"].reason
    assert "kvabi_backend is not a kvabi hook (did you mean kvabi_backends?)" in \
        refused["misspelled"].reason
    assert "no kvabi_backends function" in refused["empty"].reason
    assert "fake" not in refused
    # The author's next step, asking for the backend by name, names the cause.
    with pytest.raises(KVABIError, match=r"no backend named 'unmarked.one'.*unmarked \(plugin "
                                         r"kvabi_unmarked_plugin loads but provides no "
                                         r"backend.*lacks @kvabi.hookimpl"):
        registry.get_backend("unmarked.one")
    out = run_cmd([], capsys)
    refused_section = out.split("\nrefused:\n", 1)[1]
    for name, why in (("unmarked", "lacks @kvabi.hookimpl"),
                      ("misspelled", "did you mean kvabi_backends?"),
                      ("empty", "implements no kvabi hook")):
        line = next(l for l in refused_section.splitlines() if l.startswith(f"  {name}: "))
        assert why in line, line
    data = json.loads(run_cmd(["--json"], capsys))
    assert {"unmarked", "misspelled", "empty"} <= {r["name"] for r in data["refused"]}


class HalfRight:
    """One real hook beside a misspelled and an unmarked one."""

    @kvabi.hookimpl
    def kvabi_backends(self):
        return [backend("half.right")]

    @kvabi.hookimpl
    def kvabi_bench_suite(self):  # should be kvabi_bench_suites
        return {}

    def kvabi_bench_suites(self):  # not marked
        return {}


class Empty:
    @kvabi.hookimpl
    def kvabi_backends(self):
        return []


def test_half_right_plugins_warn(capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_ALLOW, "")
    registry.register(HalfRight(), name="half")
    registry.register(Empty(), name="empty")
    assert "half.right" in registry.backend_names()
    warned = {(w.plugin, w.reason) for w in registry.warnings()}
    assert ("half", "kvabi_bench_suite is not a kvabi hook (did you mean kvabi_bench_suites?); "
                    "it is never called") in warned
    assert ("half", "kvabi_bench_suites lacks @kvabi.hookimpl, so pluggy ignores it") in warned
    assert any(p == "empty" and "returned no backend" in r for p, r in warned)
    assert registry.refused() == []
    out = run_cmd([], capsys)
    section = out.split("\nwarnings:\n", 1)[1]
    assert "  half: kvabi_bench_suite is not a kvabi hook" in section
    assert "  empty: kvabi_backends() returned no backend" in section
    assert json.loads(run_cmd(["--json"], capsys))["warnings"]


class Float32Only(kvabi.Backend):
    name = "f32.only"

    def capabilities(self, spec=None):
        return kvabi.Capabilities(kinds=("sliding_window",), dtypes=("float32",),
                                  head_dims=(64,), block_sizes=(8, 32))

    def preferred_layouts(self, spec):
        return (f"flash_attn-for-{spec.kind}-{spec.dtype}-{spec.head_dim}-{spec.block_size}",)


def test_backends_shows_layouts_for_a_spec_each_backend_claims(capsys, monkeypatch):
    monkeypatch.setenv(registry.ENV_ALLOW, "")
    registry.register(Plugin(Float32Only()), name="f32")
    out = run_cmd([], capsys)
    assert "preferred layouts for full bfloat16" not in out
    block = out.split("  f32.only:", 1)[1]
    assert "spec: sliding_window float32, 8 kv heads x 64, block 8" in block
    assert "flash_attn-for-sliding_window-float32-64-8" in block
    assert "not claimed" not in block
    # A spec asked for explicitly is kept, and said to be unclaimed.
    out = run_cmd(["--dtype", "bfloat16"], capsys)
    block = out.split("  f32.only:", 1)[1]
    assert "sliding_window bfloat16" in block and "not claimed: dtype 'bfloat16'" in block
    # every reason, not the first
    out = run_cmd(["--dtype", "bfloat16", "--kind", "full", "--head-dim", "96"], capsys)
    block = out.split("  f32.only:", 1)[1]
    assert ("not claimed: kind 'full' not in ('sliding_window',); dtype 'bfloat16' not in "
            "('float32',); head_dim 96 not in (64,)") in block
    data = json.loads(run_cmd(["--json"], capsys))
    f32 = next(b for b in data["backends"] if b["name"] == "f32.only")
    assert f32["spec"]["dtype"] == "float32" and f32["unclaimed"] == []
