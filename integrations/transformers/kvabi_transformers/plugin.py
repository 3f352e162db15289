"""kvabi plugin hooks of the integration: ``kvabi bench transformers``."""
from __future__ import annotations

import kvabi


@kvabi.hookimpl
def kvabi_bench_suites():
    from .tools.bench import main

    return {"transformers": main}
