"""The kvabi plugin of this distribution (entry point ``kvabi:tpu``)."""
from __future__ import annotations

import kvabi


@kvabi.hookimpl
def kvabi_backends():
    from .jax_backend import JaxBackend
    from .pallas_backend import PallasBackend

    return [PallasBackend(), JaxBackend()]


@kvabi.hookimpl
def kvabi_bench_suites():
    from .bench import run

    return {"tpu": run}
