"""``kvabi-vllm proxy``: kvabi's engine-neutral P/D proxy (``kvabi proxy``,
:mod:`kvabi.pd.proxy`, ``specs/pd.md`` section 4.7) under kvabi-vllm's command: one
OpenAI-compatible address in front of a prefill server and a decode server (any engines
that speak kvabi's P/D; here two ``kvabi-vllm serve`` with KvabiConnector)."""
from __future__ import annotations

import sys

from kvabi.pd.proxy import main as _main


def main(argv=None) -> int:
    """Run the proxy until interrupted (``--help`` for its options)."""
    return _main(argv, prog="kvabi-vllm proxy")


if __name__ == "__main__":
    sys.exit(main())
