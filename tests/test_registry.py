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
from kvabi import KVABIError, registry
from kvabi.commands import backends as backends_cmd
from kvabi.reference import ReferenceBackend

PLUGINS = Path(__file__).parent / "plugins"
PLUGIN_MODULES = ("kvabi_fake_plugin", "kvabi_broken_plugin", "kvabi_future_plugin")
#: entry points really installed here (built-in backends may add some beside "reference")
REAL = {ep.name for ep in importlib.metadata.entry_points(group="kvabi")}


class FakeDist:
    """Just enough of an importlib.metadata.Distribution for pluggy."""

    def __init__(self, eps):
        self.entry_points = [importlib.metadata.EntryPoint(n, v, "kvabi") for n, v in eps]
        self.metadata = {"name": "kvabi-fake-thirdparty", "version": "0.0.1"}
        self.version = "0.0.1"


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
    with pytest.raises(KVABIError, match="plugins that failed to load: broken"):
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
                             backend("fine.one")), name="mixed")
    names = registry.backend_names()
    assert "fine.one" in names and names[0] == "reference"
    reasons = {(r.plugin, r.name): r.reason for r in registry.refused()}
    assert "OSError: driver not found" in reasons[("raiser", "raiser")]
    assert "not a kvabi.Backend" in reasons[("mixed", "mixed")]
    assert "invalid backend name" in reasons[("mixed", "Bad Name!")]
    assert "abi_version" in reasons[("mixed", "badabi")]


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
    assert lines[1].split() == ["reference", "yes", "1.1", "all", "all", "any", "any", "yes",
                                "yes"]
    fake = next(l for l in lines if l.startswith("fake.one"))
    assert fake.split() == ["fake.one", "no", "1.0", "full", "float16", "64,128", "16",
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
