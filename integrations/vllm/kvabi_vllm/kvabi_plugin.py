"""kvabi plugin hooks of the integration: the ``cpu.vllm`` backend and ``kvabi bench vllm``."""
from __future__ import annotations

import kvabi


@kvabi.hookimpl
def kvabi_backends():
    return []


@kvabi.hookimpl
def kvabi_bench_suites():
    from .bench import main

    return {"vllm": main}
