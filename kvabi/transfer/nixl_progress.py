"""A NIXL agent whose progress thread sleeps between UCX events.

NIXL's UCX progress thread progresses its workers, arms them and then waits in ``poll()``
on their event descriptors with a timeout of the agent's ``pthrDelay`` (rounded up to whole
milliseconds).  nixl's Python agent sets ``pthrDelay = 0``: the timeout is then zero and the
thread never sleeps, holding a core for the agent's whole life.  An engine that shares the
host's cores (vLLM's CPU worker binds its OpenMP threads to them) then runs every forward
pass beside a spinning thread: measured several-fold slower per request on 2 cores, with
or without a transfer.  The thread itself is needed: a peer's READ of this agent's memory
completes only while this side's worker progresses (UCX serves it as an active message on
transports without one-sided reads).

:func:`create_agent` builds the agent with a non-zero delay.  The thread still wakes at
once on every UCX event (the armed workers' descriptors); the delay only bounds how long
it sleeps without one.
"""
from __future__ import annotations

import sys
import threading
import types

#: the progress thread's longest sleep without a UCX event, in microseconds
POLL_US = 1000

_LOCK = threading.Lock()


class _Bindings(types.ModuleType):
    """nixl's binding module with another agent-config class (every other name its own)."""

    def __init__(self, real, config_cls):
        super().__init__(real.__name__)
        self._real, self.nixlAgentConfig = real, config_cls

    def __getattr__(self, name):
        return getattr(self._real, name)


def _config_class(base, poll_us: int):
    """A subclass of nixl's agent config whose ``pthrDelay`` is at least ``poll_us``."""
    prop = base.pthrDelay

    class Config(base):
        pthrDelay = property(prop.fget, lambda self, v: prop.fset(self, max(int(v), poll_us)))

    return Config


def create_agent(agent_cls, name: str, config, *, poll_us: int = POLL_US):
    """``agent_cls(name, config)`` with its progress thread sleeping up to ``poll_us``
    microseconds between UCX events.  A nixl whose Python agent is built differently is
    left to its own defaults."""
    api = sys.modules.get(agent_cls.__module__)
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or not isinstance(getattr(base, "pthrDelay", None), property):
        return agent_cls(name, config)
    with _LOCK:  # the agent reads the module's names while it is built
        api.nixlBind = _Bindings(bind, _config_class(base, poll_us))
        try:
            return agent_cls(name, config)
        finally:
            api.nixlBind = bind
