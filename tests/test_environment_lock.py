"""This environment is exactly ``locks/core.txt``: a drifted environment fails here, naming the
distributions and versions, not deep inside a model (``locks/envlock.py``)."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _envlock():
    spec = importlib.util.spec_from_file_location("envlock", ROOT / "locks" / "envlock.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


envlock = _envlock()


def test_core_environment_is_the_lock():
    diffs = envlock.check(ROOT / "locks" / "core.txt")
    assert not diffs, "this environment differs from locks/core.txt:\n" + "\n".join(diffs)


def test_differences_name_each_distribution_and_version():
    lines = envlock.differences({"a": "1.0", "b": "2.0", "c": "3.0"},
                                {"a": "1.0", "b": "2.1", "d": "0.1"})
    assert lines == ["b: locked 2.0, installed 2.1", "c: locked 3.0, not installed",
                     "d: installed 0.1, not in the lock"]


def test_lock_lines_are_exact_pins(tmp_path):
    lock = tmp_path / "l.txt"
    lock.write_text("# removed: Torch_Vision\nFoo.Bar==1.2\n")
    assert envlock.read_lock(lock) == ({"foo-bar": "1.2"}, {"torch-vision"})
    lock.write_text("foo>=1.2\n")
    with pytest.raises(SystemExit, match="l.txt:1: not a 'name==version' line"):
        envlock.read_lock(lock)


def test_both_locks_pin_every_line():
    for name in ("core.txt", "vllm.txt"):
        pins, _ = envlock.read_lock(ROOT / "locks" / name)
        assert "torch" in pins and pins["torch"].startswith("2.13.0"), name
        assert "pip" in pins and "setuptools" in pins, name


def test_vendored_distributions_on_sys_path_are_not_installed(monkeypatch):
    """An imported setuptools puts its vendored distributions on sys.path; they are not
    distributions of the environment and must not read as drift."""
    import setuptools

    vendor = Path(setuptools.__file__).parent / "_vendor"
    vendored = {envlock.norm(p.name.split("-")[0]) for p in vendor.glob("*.dist-info")}
    assert vendored, "setuptools vendors no distributions here"
    monkeypatch.syspath_prepend(str(vendor))
    pins, _ = envlock.read_lock(ROOT / "locks" / "core.txt")
    extra = {name for name in envlock.installed() if name not in pins}
    assert not extra & vendored, sorted(extra & vendored)
