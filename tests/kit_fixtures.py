"""Fixtures shared by the kit's own tests (tests/test_kit_*.py): the planted-bug backends
of ``tests/plugins/kvabi_planted.py`` registered as a plugin, and a clean kit state."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvabi.backend import registry
from kvabi.testing import profiles

PLUGINS = Path(__file__).parent / "plugins"
ENV = (profiles.PROFILE_ENV, profiles.SEED_ENV, profiles.DATABASE_ENV, "KVABI_REPLAY_DIR",
       "KVABI_RECORD")


@pytest.fixture
def planted(monkeypatch, tmp_path):
    """Register the planted backends; the kit's environment cleared, reproducers written
    under ``tmp_path / "replay"``, the working directory ``tmp_path / "work"``."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVABI_REPLAY_DIR", str(tmp_path / "replay"))
    monkeypatch.syspath_prepend(str(PLUGINS))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    profiles.select()
    registry.reset()
    import kvabi_planted

    registry.register(kvabi_planted, name="planted")
    yield sys.modules["kvabi_planted"]
    registry.reset()
    profiles.select()


def subprocess_env(tmp_path) -> dict:
    """An environment for a child Python that imports the planted backends by name."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(PLUGINS)] + [p for p in [env.get("PYTHONPATH")]
                                                          if p])
    return env
