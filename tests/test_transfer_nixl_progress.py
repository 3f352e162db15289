"""A NixlAgent's progress thread sleeps between UCX events (``kvabi.transfer.nixl_progress``):
the config NIXL's agent is built from carries a non-zero delay (nixl's own Python agent
passes zero, and its thread then spins on a core), and nixl's module is left as it was.
That the thread still serves a peer's READ is what the in-process pulls of
``test_transfer_nixl.py`` prove."""
from __future__ import annotations

import sys

import pytest

from kvabi.transfer import nixl as kv_nixl
from kvabi.transfer import nixl_progress

ok, why = kv_nixl.available()
pytestmark = pytest.mark.skipif(not ok, reason=why)


def test_agent_built_with_a_progress_delay(monkeypatch):
    agent_cls, _ = kv_nixl.nixl_api()
    api = sys.modules[agent_cls.__module__]
    bind = api.nixlBind
    seen = []
    real = bind.nixlAgent

    def record(name, config):
        seen.append((config.useProgThread, config.pthrDelay))
        return real(name, config)

    monkeypatch.setattr(bind, "nixlAgent", record)
    with kv_nixl.NixlAgent("progress-delay"):
        pass
    assert seen == [(True, nixl_progress.POLL_US)]
    assert api.nixlBind is bind  # restored after the build


def test_unknown_nixl_is_left_to_its_defaults():
    class Agent:  # a nixl whose module has no binding module to adjust
        def __init__(self, name, config):
            self.args = (name, config)

    assert nixl_progress.create_agent(Agent, "a", "cfg").args == ("a", "cfg")
