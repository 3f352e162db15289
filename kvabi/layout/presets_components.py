"""Presets stated by components: the caches whose keys, values and scales do not share one
memory order or one dtype (``specs/layout.md``, *Presets*).  Each is a function of (spec,
num_blocks, num_layers) and is pinned byte for byte in the tests: against the engine's own
writer where it runs on this machine (vLLM's CPU kernels; vLLM's per-token-head Triton
writer in Triton's interpreter), else against an independent writer written from the
format's published definition.
"""
from __future__ import annotations

from ..util.dtypes import itemsize
from ..util.errors import KVABIError
from .component import Component

#: vLLM's CPU attention (CPU_ATTN): per block and head, keys [D, N] then values [N, D], in
#: vLLM's allocation order named after the preset (``vllm.cpu`` is LBHNC, vLLM's own)
CPU = {"vllm.cpu": ("L", "B", "H"), "vllm.cpu.LHBNC": ("L", "H", "B"),
       "vllm.cpu.BLHNC": ("B", "L", "H"), "vllm.cpu.BHLNC": ("B", "H", "L")}
#: vLLM's per-token-head quantized caches: (data dtype, elements per byte)
PER_TOKEN_HEAD = {"vllm.int8_per_token_head": "int8",
                  "vllm.fp8_per_token_head": "float8_e4m3fn",
                  "vllm.int4_per_token_head": "uint4"}
#: FlashInfer's fp8 caches with one float32 scale per (token, head): inline at the tail
#: of a 16-byte-aligned slot, or in a plane of their own (per layer: data, then scales)
FLASHINFER = {"flashinfer.HND.fp8_inline_scale": "inline",
              "flashinfer.HND.fp8_scale_plane": "plane"}
#: DeepSeek V3.2's 656-byte fp8 MLA token record
DEEPSEEK = ("deepseek.fp8_ds_mla",)
#: the presets that state a quantized cache (their dtypes are the preset's own)
QUANTIZED = tuple(PER_TOKEN_HEAD) + tuple(FLASHINFER) + DEEPSEEK
PRESETS = tuple(CPU) + QUANTIZED


def _nested(order, sizes, inner: int) -> dict:
    """Byte strides of ``order`` (outermost first) over one innermost record of
    ``inner`` bytes."""
    out, s = {}, inner
    for a in reversed(order):
        out[a] = s
        s *= sizes[a]
    return out


def _no_page_align(name, spec):
    if spec.page_align != 1:
        raise KVABIError(f"spec.page_align: preset {name!r} has the engine's own page size; "
                         f"it takes no page alignment")


def _vllm_cpu(cls, name, spec, sizes):
    if spec.is_mla:
        raise KVABIError(f"name: preset {name!r} has no MLA form (vLLM's CPU attention "
                         f"holds keys and values)")
    isz = itemsize(spec.dtype)
    n, d = spec.block_size, spec.head_dim
    tile = 2 * n * d * isz  # one block-head: keys [D, N], then values [N, D]
    if spec.head_dim_v != d:
        raise KVABIError(f"spec.head_dim_v: {name} needs head_dim_v == head_dim ({d})")
    outer = _nested(CPU[name], sizes, tile)
    if spec.page_align != 1:
        if CPU[name][:2] != ("L", "B"):
            raise KVABIError(f"spec.page_align: preset {name!r} splits a layer's page "
                             f"across heads; page padding is not expressible there")
        page = sizes["H"] * tile
        padded = -(-page // spec.page_align) * spec.page_align
        outer = {"L": padded * sizes["B"], "B": padded, "H": tile}
    comps = [Component(name="key", dtype=spec.dtype, count=d,
                       strides={**outer, "N": isz, "E": n * isz}),
             Component(name="value", dtype=spec.dtype, count=d, offset=n * d * isz,
                       strides={**outer, "N": d * isz, "E": isz})]
    return comps, None


def _per_token_head(cls, name, spec, sizes):
    """vLLM's ``[B, H, N, 2 * (D + pad)]`` (``triton_attn.py`` ``_ensure_scale_caches``):
    per (head, slot) ``[K | K_scale | V | V_scale]``, each scale one float32 in the
    ``pad = 4 / itemsize`` elements after its data (int4: D / 2 bytes of packed data)."""
    if spec.is_mla:
        raise KVABIError(f"name: preset {name!r} has no MLA form")
    dt = PER_TOKEN_HEAD[name]
    d = spec.head_dim
    if spec.head_dim_v != d:
        raise KVABIError(f"spec.head_dim_v: {name} needs head_dim_v == head_dim ({d})")
    data = d // 2 if dt == "uint4" else d * itemsize(dt)  # bytes of one head's data
    if dt == "uint4" and d % 2:
        raise KVABIError(f"spec.head_dim: {name} packs two values per byte; {d} is odd")
    if data % 4:
        raise KVABIError(f"spec.head_dim: {name} puts a float32 scale after {data} bytes of "
                         f"data, which must be a multiple of 4")
    half = data + 4
    outer = _nested(("L", "B", "H", "N"), sizes, 2 * half)
    return [Component(name="key", dtype=dt, count=d, strides={**outer, "E": 1}),
            Component(name="key_scale", dtype="float32", count=1, offset=data, strides=outer),
            Component(name="value", dtype=dt, count=d, offset=half,
                      strides={**outer, "E": 1}),
            Component(name="value_scale", dtype="float32", count=1, offset=half + data,
                      strides=outer)], None


def _flashinfer(cls, name, spec, sizes):
    """FlashInfer's HND paged cache per layer, ``[B, 2, H, N, D + 16]`` with the scale at
    byte D of each 16-byte-aligned slot (the inline proposal), or ``[B, 2, H, N, D]`` and
    a float32 ``[B, 2, H, N]`` scale plane beside it (the separate-tensor proposal)."""
    if spec.is_mla:
        raise KVABIError(f"name: preset {name!r} has no MLA form")
    d = spec.head_dim
    if spec.head_dim_v != d:
        raise KVABIError(f"spec.head_dim_v: {name} needs head_dim_v == head_dim ({d})")
    dt = "float8_e4m3fn"
    per_layer = {"L": 1}
    if FLASHINFER[name] == "inline":
        slot = d + 16
        outer = _nested(("B", "KV", "H", "N"), {**sizes, "KV": 2}, slot)
        kv = outer.pop("KV")
        comps = [Component(name="key", dtype=dt, count=d, strides={**outer, "E": 1},
                           plane_strides=per_layer),
                 Component(name="key_scale", dtype="float32", count=1, offset=d,
                           strides=outer, plane_strides=per_layer),
                 Component(name="value", dtype=dt, count=d, offset=kv,
                           strides={**outer, "E": 1}, plane_strides=per_layer),
                 Component(name="value_scale", dtype="float32", count=1, offset=kv + d,
                           strides=outer, plane_strides=per_layer)]
        return comps, sizes["B"] * 2 * kv  # the slot's last 12 bytes are padding
    two = {"L": 2}  # planes: layer 0 data, layer 0 scales, layer 1 data, ...
    data = _nested(("B", "KV", "H", "N"), {**sizes, "KV": 2}, d)
    scale = _nested(("B", "KV", "H", "N"), {**sizes, "KV": 2}, 4)
    kv_d, kv_s = data.pop("KV"), scale.pop("KV")
    comps = [Component(name="key", dtype=dt, count=d, strides={**data, "E": 1},
                       plane_strides=two),
             Component(name="value", dtype=dt, count=d, offset=kv_d,
                       strides={**data, "E": 1}, plane_strides=two),
             Component(name="key_scale", dtype="float32", count=1, plane=1, strides=scale,
                       plane_strides=two),
             Component(name="value_scale", dtype="float32", count=1, plane=1, offset=kv_s,
                       strides=scale, plane_strides=two)]
    nbytes = sizes["B"] * 2 * sizes["H"] * sizes["N"]
    return comps, (nbytes * d, nbytes * 4) * sizes["L"]


def _deepseek(cls, name, spec, sizes):
    """DeepSeek V3.2 ``fp8_ds_mla`` (vLLM ``flashmla_sparse.py``): per token 656 bytes,
    512 float8_e4m3fn latent values, 4 float32 scales (one per 128 values), 64 bfloat16
    rope values; ``[num_blocks, block_size, 656]`` per layer."""
    if not spec.is_mla or spec.head_dim != 576 or spec.head_dim_v != 512:
        raise KVABIError(f"spec: {name} holds DeepSeek's MLA (kind mla, head_dim 576 = 512 "
                         f"latent + 64 rope, head_dim_v 512), got {spec.kind} "
                         f"{spec.head_dim}/{spec.head_dim_v}")
    outer = _nested(("L", "B", "N"), sizes, 656)
    return [Component(name="latent", dtype="float8_e4m3fn", count=512,
                      strides={**outer, "E": 1}),
            Component(name="latent_scale", dtype="float32", count=4, offset=512,
                      strides={**outer, "E": 4}),
            Component(name="rope", dtype="bfloat16", count=64, offset=528,
                      strides={**outer, "E": 2})], None


def build_component_preset(cls, name, spec, num_blocks: int, num_layers: int):
    """The component preset ``name`` for ``spec`` (validated by the caller), built as
    ``cls``.  The quantized presets take the geometry of ``spec`` (block size, KV heads,
    head dim); their dtypes are their own."""
    sizes = {"L": num_layers, "B": num_blocks, "N": spec.block_size, "H": spec.num_kv_heads}
    if name in CPU:
        comps, pb = _vllm_cpu(cls, name, spec, sizes)
    else:
        _no_page_align(name, spec)
        make = _per_token_head if name in PER_TOKEN_HEAD else \
            _flashinfer if name in FLASHINFER else _deepseek
        comps, pb = make(cls, name, spec, sizes)
    return cls(sizes=sizes, components=comps, plane_bytes=pb, name=name)
