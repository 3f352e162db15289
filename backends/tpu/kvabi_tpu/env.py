"""Where the TPU backends run: jax present?  a TPU attached?  else Pallas interpret mode.

Imports jax lazily so that listing backends never fails on a machine without jax.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def jax_status() -> tuple[bool, str, str]:
    """(jax importable, jax version or import error, default platform e.g. "cpu", "tpu")."""
    try:
        import jax
    except Exception as e:  # noqa: BLE001 - any import failure makes the backend unavailable
        return False, f"jax not importable: {type(e).__name__}: {e}", ""
    try:
        platform = jax.devices()[0].platform
    except Exception as e:  # noqa: BLE001
        return False, f"jax {jax.__version__}: no device: {type(e).__name__}: {e}", ""
    return True, jax.__version__, platform


def on_tpu() -> bool:
    ok, _, platform = jax_status()
    return ok and platform == "tpu"


@functools.lru_cache(maxsize=None)
def pallas_status() -> tuple[bool, str]:
    """(Pallas TPU usable, mode description).

    On a TPU the kernels compile natively through Mosaic; elsewhere they run in Pallas TPU
    interpret mode, which simulates DMAs, semaphores and scalar prefetch on the host.
    """
    ok, version, platform = jax_status()
    if not ok:
        return False, version
    try:
        from jax.experimental import pallas as pl  # noqa: F401
        from jax.experimental.pallas import tpu as pltpu
    except Exception as e:  # noqa: BLE001
        return False, f"jax {version}: Pallas TPU not importable: {type(e).__name__}: {e}"
    if platform == "tpu":
        return True, f"Pallas TPU compiled natively (jax {version})"
    if not hasattr(pltpu, "InterpretParams"):
        return False, f"jax {version} on {platform}: no TPU and no Pallas TPU interpret mode"
    return True, f"Pallas TPU interpret mode on {platform} (no TPU; jax {version})"


def interpret_arg():
    """The ``interpret=`` argument of ``pallas_call``: False on a TPU, else TPU interpret."""
    if on_tpu():
        return False
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


#: XLA options that roughly halve compile time on the host: for computations that only
#: simulate a TPU kernel, and for tests whose every example has new shapes
CHEAP_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                              "xla_llvm_disable_expensive_passes": True}

