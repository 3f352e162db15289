"""What this machine offers the CUDA backends: torch, a CUDA device, Triton and its mode.

Triton decides at ``@triton.jit`` time whether a kernel is compiled or run by its
interpreter (``TRITON_INTERPRET=1``).  Without a CUDA device nothing can be compiled, so
before the kernel modules are imported we turn the interpreter on, unless the user
explicitly asked for ``TRITON_INTERPRET=0``.  The interpreter runs on CPU tensors; it
computes bfloat16 wrongly, so the Triton backend refuses bf16 in that mode.
"""
from __future__ import annotations

import functools
import importlib.util
import os

INTERPRET_ENV = "TRITON_INTERPRET"


@functools.lru_cache(maxsize=None)
def torch_status() -> tuple[bool, str]:
    """(torch importable, reason)."""
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install is "not available", not a crash
        return False, f"torch not importable: {type(e).__name__}: {e}"
    return True, f"torch {torch.__version__}"


@functools.lru_cache(maxsize=None)
def cuda_status() -> tuple[bool, str]:
    """(a CUDA device is usable, reason or device name)."""
    ok, why = torch_status()
    if not ok:
        return False, why
    import torch

    try:
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        return True, torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        return False, f"no CUDA device ({type(e).__name__}: {e})"


def module_installed(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _env_interpret() -> str | None:
    v = os.environ.get(INTERPRET_ENV)
    return None if v is None else v.strip()


@functools.lru_cache(maxsize=None)
def triton_mode() -> tuple[str | None, str]:
    """``("compiled" | "interpret" | None, reason)`` for the Triton backend.

    Sets ``TRITON_INTERPRET=1`` when there is no CUDA device and the variable is unset, so
    that kernels decorated afterwards run in the interpreter.  Call it before importing the
    kernel modules (they call it themselves).
    """
    ok, why = torch_status()
    if not ok:
        return None, why
    if not module_installed("triton"):
        return None, "triton not installed"
    cuda, dev = cuda_status()
    env = _env_interpret()
    if env in ("1", "true", "True", "on"):
        return "interpret", (f"Triton interpreter ({INTERPRET_ENV}=1), CPU tensors; "
                             "bfloat16 refused (the interpreter computes it wrongly)")
    if cuda:
        return "compiled", f"Triton compiled for CUDA ({dev})"
    if env is not None and env not in ("", "0"):
        return None, f"no CUDA device and {INTERPRET_ENV}={env!r} is not understood"
    if env in ("0",):
        return None, f"no CUDA device and {INTERPRET_ENV}=0 forbids the interpreter"
    os.environ[INTERPRET_ENV] = "1"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return None, f"triton not importable: {type(e).__name__}: {e}"
    return "interpret", (f"no CUDA device: Triton interpreter ({INTERPRET_ENV}=1), CPU "
                         "tensors; bfloat16 refused (the interpreter computes it wrongly)")


def device():
    """The torch device the Triton backend allocates on."""
    import torch

    return torch.device("cuda" if triton_mode()[0] == "compiled" else "cpu")


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1); plain Python, for launch sizes."""
    return 1 << max(int(n) - 1, 0).bit_length()
