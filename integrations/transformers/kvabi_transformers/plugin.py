"""kvabi plugin hooks of the integration: ``kvabi bench transformers`` and ``kvabi bench
transformers-pd``."""
from __future__ import annotations

import kvabi


@kvabi.hookimpl
def kvabi_bench_suites():
    from .tools.bench import main
    from .tools.bench_pd import main as pd_main

    return {"transformers": main, "transformers-pd": pd_main}
