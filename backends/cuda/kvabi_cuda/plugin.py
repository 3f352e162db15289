"""The kvabi plugin of this distribution (entry point ``kvabi:cuda``).

Importing it is cheap: torch, triton and the libraries load only when a backend is used.
"""
import kvabi


@kvabi.hookimpl
def kvabi_backends():
    from .flash_attn_backend import FlashAttnBackend
    from .flashinfer_backend import FlashInferBackend
    from .triton_backend import TritonBackend

    return [TritonBackend(), FlashInferBackend(), FlashAttnBackend()]


@kvabi.hookimpl
def kvabi_bench_suites():
    from .bench import run

    return {"cuda": run}
