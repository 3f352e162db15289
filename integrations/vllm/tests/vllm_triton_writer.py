"""vLLM's per-token-head quantizing writer, run in Triton's interpreter, in a child process.

vLLM's CPU build replaces ``triton`` with a placeholder; the real ``triton`` (in this
environment's lock) runs the writer's kernel in its interpreter when ``TRITON_INTERPRET=1``
is set and ``vllm.triton_utils`` is pointed at it before vLLM's op module is first imported.
A test process has usually imported that module already, hence a child process:

    python vllm_triton_writer.py IN.npz OUT.npz [IN2.npz OUT2.npz ...]
    python vllm_triton_writer.py --probe OUT.json

``--probe`` runs ``kvabi.probe.verify_quantized`` with this writer as the engine's write, on
the cache vLLM allocates for each mode, against the preset that states it and against a
layout with K's and V's scales exchanged; OUT.json holds, per case, the components checked
or the KVABIError.

``IN.npz`` holds ``key`` [T, H, D] and ``value`` [T, H, Dv] (float32 or float16),
``slots`` [T] int64, ``num_blocks``, ``block_size``, ``mode`` (``int8_per_token_head`` or
``fp8_per_token_head``), ``order`` (``HND``: the packed tensor ``[B, H, N, 2 * (D + pad)]``
is contiguous; ``NHD``: its memory is ``[B, N, H, ...]``) and ``fill`` (the byte the cache
holds before the write).  The cache, its scale views and the K/V views are made by vLLM's
own ``TritonAttentionImpl`` methods (``_ensure_scale_caches``, ``_pth_key_value_caches``),
and the write is ``triton_reshape_and_cache_flash_per_token_head_quant`` as vLLM's
``do_kv_cache_update`` calls it.  ``OUT.npz`` holds ``raw``, the cache's bytes in memory
order, and ``shape``/``strides`` (elements) of the packed logical tensor.
"""
from __future__ import annotations

import os
import sys


def _real_triton():
    """Point vLLM at the real triton, interpreted (before vLLM imports its op module)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl
    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True


def write(inp: dict) -> dict:
    _real_triton()
    import numpy as np
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import \
        triton_reshape_and_cache_flash_per_token_head_quant
    from vllm.v1.kv_cache_interface import KVQuantMode

    mode = str(inp["mode"])
    quant = {"int8_per_token_head": KVQuantMode.INT8_PER_TOKEN_HEAD,
             "fp8_per_token_head": KVQuantMode.FP8_PER_TOKEN_HEAD}[mode]
    key, value = torch.from_numpy(inp["key"]), torch.from_numpy(inp["value"])
    t, h, d = key.shape
    b, n = int(inp["num_blocks"]), int(inp["block_size"])
    # vLLM allocates the per-token-head cache in the cache dtype (int8; fp8 as raw bytes
    # viewed as float8 by the impl): one byte per element, 4 per float32 scale.
    pad = 4
    content = 2 * (d + pad)
    dtype = torch.int8 if quant == KVQuantMode.INT8_PER_TOKEN_HEAD else torch.uint8
    fill = int(inp["fill"])
    if str(inp["order"]) == "HND":
        mem = torch.full((b, h, n, content), fill, dtype=torch.uint8).view(dtype)
        kv_cache = mem
    else:
        mem = torch.full((b, n, h, content), fill, dtype=torch.uint8).view(dtype)
        kv_cache = mem.permute(0, 2, 1, 3)  # the packed logical [B, H, N, C] over NHD memory
    impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
    impl._kv_quant_mode = quant
    impl.fp8_dtype = torch.float8_e4m3fn
    impl._k_scale_cache = impl._v_scale_cache = None
    key_cache, value_cache = impl._pth_key_value_caches(kv_cache)
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, key_cache, value_cache, impl._k_scale_cache, impl._v_scale_cache,
        torch.from_numpy(inp["slots"]), quant)
    return {"raw": mem.view(torch.uint8).reshape(-1).numpy().copy(),
            "shape": np.array(kv_cache.shape), "strides": np.array(kv_cache.stride())}


def probe() -> dict:
    """verify_quantized through vLLM's writer: {case: {"checked": {...}} or {"error": msg}}."""
    _real_triton()
    import attrs
    import torch
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import \
        triton_reshape_and_cache_flash_per_token_head_quant
    from vllm.v1.kv_cache_interface import KVQuantMode

    import kvabi
    from kvabi.probe import verify_quantized

    b, n, h, d = 4, 16, 2, 32
    out = {}
    for mode, dtype, quant in (("int8_per_token_head", "int8", KVQuantMode.INT8_PER_TOKEN_HEAD),
                               ("fp8_per_token_head", "float8_e4m3fn",
                                KVQuantMode.FP8_PER_TOKEN_HEAD)):
        tdt = torch.int8 if dtype == "int8" else torch.uint8
        mem = torch.zeros((b, h, n, 2 * (d + 4)), dtype=torch.uint8)
        impl = TritonAttentionImpl.__new__(TritonAttentionImpl)
        impl._kv_quant_mode = quant
        impl.fp8_dtype = torch.float8_e4m3fn
        impl._k_scale_cache = impl._v_scale_cache = None
        key_cache, value_cache = impl._pth_key_value_caches(mem.view(tdt))

        def write(layer, slots, key, value):
            assert layer == 0
            triton_reshape_and_cache_flash_per_token_head_quant(
                torch.from_numpy(key), torch.from_numpy(value), key_cache, value_cache,
                impl._k_scale_cache, impl._v_scale_cache,
                torch.as_tensor(slots, dtype=torch.int64), quant)

        spec = kvabi.KVSpec("full", n, h, d, dtype=dtype, quant="per_token_head")
        good = kvabi.Layout.preset(f"vllm.{mode}", spec, b)
        by = {c.name: c for c in good.components}
        swapped = kvabi.Layout(sizes={"B": b, "N": n, "H": h}, components=[
            by["key"], by["value"],
            attrs.evolve(by["key_scale"], offset=by["value_scale"].offset),
            attrs.evolve(by["value_scale"], offset=by["key_scale"].offset)])
        for name, layout in ((mode, good), (mode + "_scales_swapped", swapped)):
            try:
                out[name] = {"checked": verify_quantized(layout, [mem], write, samples=6)}
            except kvabi.KVABIError as e:
                out[name] = {"error": str(e)}
    return out


def main(argv) -> int:
    import numpy as np

    if len(argv) == 2 and argv[0] == "--probe":
        import json

        with open(argv[1], "w") as f:
            json.dump(probe(), f)
        return 0
    if not argv or len(argv) % 2:
        print(__doc__, file=sys.stderr)
        return 2
    for src, dst in zip(argv[::2], argv[1::2]):
        with np.load(src) as f:
            inp = {k: f[k] for k in f.files}
        np.savez(dst, **write(inp))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
