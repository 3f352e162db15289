"""``kvabi proxy``: an OpenAI-compatible front for a P/D pair of servers of any engines that
speak kvabi's P/D (:mod:`kvabi.pd.proxy`, ``specs/pd.md`` section 4.7)."""
from __future__ import annotations


def configure(parser) -> None:
    from ..pd.proxy import parser as proxy_parser

    proxy_parser(p=parser)


def run(args) -> int:
    from ..pd.proxy import run as run_proxy

    return run_proxy(args)
