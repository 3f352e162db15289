"""The pluggy hooks of a kvabi plugin (project and entry-point group ``kvabi``).

pluggy calls a hook by keyword, and an implementation may take the subset of the
arguments it names, so a hook can grow keywords without a version check.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import pluggy

PROJECT = "kvabi"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """Hooks a kvabi plugin may implement."""

    @hookspec
    def kvabi_backends(self) -> Sequence[Any]:
        """Return the :class:`kvabi.Backend` objects this plugin provides."""

    @hookspec
    def kvabi_bench_suites(self) -> dict[str, Callable[..., Any]]:
        """Return {suite name: callable(argv) -> int} for ``kvabi bench NAME``."""
