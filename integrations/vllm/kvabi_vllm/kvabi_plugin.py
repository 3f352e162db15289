"""kvabi plugin hooks of the integration: the ``cpu.vllm`` backend and ``kvabi bench vllm``.

Listing backends imports torch but not vLLM: ``cpu.vllm`` imports vLLM when asked whether
it is available (and says why not where vLLM's CPU kernels cannot be loaded)."""
from __future__ import annotations

import kvabi


@kvabi.hookimpl
def kvabi_backends():
    from .cpu_backend import CpuVllmBackend

    return [CpuVllmBackend()]


@kvabi.hookimpl
def kvabi_bench_suites():
    from .tools.bench import main as vllm
    from .tools.cpu_bench import main as cpu_vllm

    return {"vllm": vllm, "cpu.vllm": cpu_vllm}
