"""The kit's three entry points behave as one: ``kvabi conformance``, ``pytest
--kvabi-backend`` and a ``BackendConformance`` subclass run the same profile, draw the same
examples for the same seed (compared example by example, as the backend receives them),
print the seed on every failure, and write nothing into the working directory."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import settings
from kit_fixtures import planted, subprocess_env  # noqa: F401 - fixture

from kvabi import KVABIError
from kvabi.commands.cli import main
from kvabi.testing import BackendConformance, ConformanceFailure, profiles


def recorded(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def same_draws(a: list[str], b: list[str]) -> bool:
    """The same examples in the same order (a time budget may stop one run earlier)."""
    n = min(len(a), len(b))
    return n >= profiles.MIN_EXAMPLES and a[:n] == b[:n]


def test_same_examples_and_seed_on_failure_in_all_three(planted, tmp_path, monkeypatch,
                                                         capsys):
    work = tmp_path / "work"
    # 1. The command line.
    monkeypatch.setenv("KVABI_RECORD", str(tmp_path / "cli.txt"))
    assert main(["conformance", "planted.recording", "--check", "attention",
                 "--seed", "123"]) == 0
    cli = recorded(tmp_path / "cli.txt")
    assert len(set(cli)) >= 2  # several different examples were drawn

    # 2. A subclass, in a session whose loaded Hypothesis profile is the author's own
    # (many examples, random, an example database in the working directory).
    monkeypatch.setenv("KVABI_RECORD", str(tmp_path / "class.txt"))

    class TestRecording(BackendConformance):
        backend_name = "planted.recording"
        seed = 123

    previous = settings.get_current_profile_name()
    settings.register_profile("kit-test-author", max_examples=100, derandomize=False)
    settings.load_profile("kit-test-author")
    try:
        TestRecording().test_attention()
    finally:
        settings.load_profile(previous)
    assert same_draws(cli, recorded(tmp_path / "class.txt"))

    # 3. pytest --kvabi-backend, in a fresh project directory (one child process for the
    # passing and the failing backend together).
    (work / "conftest.py").write_text(
        "import kvabi_planted\nfrom kvabi.backend import registry\n"
        "registry.register(kvabi_planted, name='planted')\n")
    env = subprocess_env(tmp_path)
    env["KVABI_RECORD"] = str(tmp_path / "pytest.txt")
    env["KVABI_REPLAY_DIR"] = str(tmp_path / "replay")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--kvabi-backend", "planted.recording", "--kvabi-backend", "planted.no_window",
         "--kvabi-seed", "123", "-k", "attention"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 1 passed" in out
    assert same_draws(cli, recorded(tmp_path / "pytest.txt"))
    # The failure names the seed, the rerun command and the reproducer.
    assert "profile ci, seed 123" in out
    assert "kvabi conformance planted.no_window --check attention --seed 123" in out
    assert "reproducer: " + str(tmp_path / "replay") in out
    assert "reproduce_failure" not in out and "Explanation:" not in out

    # The seed on failure from the command line and from a subclass too.
    capsys.readouterr()
    assert main(["conformance", "planted.no_window", "--check", "attention"]) == 1
    out = capsys.readouterr().out
    assert "profile ci, seed 0; rerun: kvabi conformance planted.no_window --check " \
        "attention --seed 0" in out

    class TestNoWindow(BackendConformance):
        backend_name = "planted.no_window"

    with pytest.raises(ConformanceFailure) as info:
        TestNoWindow().test_attention()
    assert "profile ci, seed 0" in str(info.value)
    assert "window=" in str(info.value) + "\n".join(getattr(info.value, "__notes__", ()))

    # Nothing was written into the working directory by any of them.
    assert sorted(p.name for p in work.iterdir()) == ["conftest.py"]


def test_profile_and_seed_resolution(monkeypatch):
    for name in (profiles.PROFILE_ENV, profiles.SEED_ENV):
        monkeypatch.delenv(name, raising=False)
    profiles.select()
    try:
        assert profiles.kit_profile() == "ci" and profiles.kit_seed() == 0
        assert profiles.kit_examples() == 8 and profiles.kit_time_budget() == 6.0
        monkeypatch.setenv(profiles.SEED_ENV, "77")
        assert profiles.kit_seed() == 77
        profiles.select(seed=5)
        assert profiles.kit_seed() == 5 and profiles.kit_seed(9) == 9
        profiles.select(profile="thorough")
        monkeypatch.delenv(profiles.SEED_ENV)
        s = profiles.kit_seed()  # random, but one per process: every check shares it
        assert s == profiles.kit_seed() and 0 <= s < 2**32
        assert profiles.kit_examples() == 150 and profiles.kit_time_budget() is None
        monkeypatch.setenv(profiles.PROFILE_ENV, "quick")
        profiles.select()
        assert profiles.kit_profile() == "quick" and profiles.kit_seed() == 0
        for bad in ("-1", "1.5", "x", str(2**32)):
            monkeypatch.setenv(profiles.SEED_ENV, bad)
            with pytest.raises(KVABIError, match="KVABI_SEED: a seed is an integer"):
                profiles.kit_seed()
        monkeypatch.setenv(profiles.PROFILE_ENV, "fast")
        with pytest.raises(KVABIError, match="unknown profile 'fast'"):
            profiles.kit_profile()
    finally:
        profiles.select()


def test_kit_settings_write_nothing_and_hide_internals():
    s = profiles.kit_settings(5)
    assert s.database is None and s.print_blob is False and s.deadline is None
    assert "explain" not in {p.name for p in s.phases}
    assert {p.name for p in profiles.kit_settings(5, shrink=False).phases} == \
        {"explicit", "generate"}
