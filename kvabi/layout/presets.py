"""Named layouts of the anchor systems, byte-exact (see ``specs/layout.md``).

Each preset is a function of (spec, num_blocks, num_layers).  Layouts with L in the memory
order hold all layers of a group in one allocation; with B outermost those are cross-layer
blocks (one byte range per block).
"""
from __future__ import annotations

import attrs

from ..model.spec import KVSpec
from ..util.coerce import as_int
from ..util.dtypes import tpu_packing
from ..util.errors import KVABIError
from .presets_components import PRESETS as COMPONENT_PRESETS
from .presets_components import QUANTIZED, build_component_preset

# name -> (memory order, plane axes, folds); "C" in vLLM's names is (KV, D) folded.
_VLLM = {
    "vllm.LBHNC": ("L", "B", "H", "N", "KV", "D"),
    "vllm.LBNHC": ("L", "B", "N", "H", "KV", "D"),
    "vllm.LHBNC": ("L", "H", "B", "N", "KV", "D"),
    "vllm.BLHNC": ("B", "L", "H", "N", "KV", "D"),
    "vllm.BLNHC": ("B", "L", "N", "H", "KV", "D"),
    "vllm.BHLNC": ("B", "H", "L", "N", "KV", "D"),
}
_OTHER = {
    # flash-attn / vLLM FLASH_ATTN: K and V planes, [B, N, H, D] per layer.
    "flash_attn": (("B", "N", "H", "D"), ("L", "KV"), ()),
    # FlashInfer: one tensor per layer, [B, 2, N, H, D] (NHD) or [B, 2, H, N, D] (HND).
    "flashinfer.NHD": (("B", "KV", "N", "H", "D"), ("L",), ()),
    "flashinfer.HND": (("B", "KV", "H", "N", "D"), ("L",), ()),
    # TPU Pallas: [B, N, 2H (k0, v0, k1, v1, ...), D padded to 128], split by packing.
    "tpu.combined": (("B", "N", "H", "KV", "D"), ("L",), (("H", "KV"),)),
    # TPU hidden states: K and V planes, [B, N, H*D].
    "tpu.hidden": (("B", "N", "H", "D"), ("L", "KV"), (("H", "D"),)),
    # Per block and head, keys then values, each [D, N] (token fastest): the key tiles of
    # vLLM's CPU_ATTN kernels, which cpu.vllm reads in place ([L, B, H, 2, D, N]).
    "vllm.cpu_kt": (("L", "B", "H", "KV", "D", "N"), (), ()),
    # Dynamo KVBM FullyContiguous: [B, L, outer=KV, page, inner=H*D].
    "kvbm.fully_contiguous": (("B", "L", "KV", "N", "H", "D"), (), (("H", "D"),)),
    # Dynamo KVBM LayerSeparate (block-contiguous): per layer [B, outer=KV, page, H*D].
    "kvbm.layer_separate": (("B", "KV", "N", "H", "D"), ("L",), (("H", "D"),)),
}
_NO_MLA = {"flash_attn", "flashinfer.NHD", "flashinfer.HND", "tpu.combined", "tpu.hidden"}

#: the presets of the axis form (every 1.x preset)
AXIS_PRESETS = tuple(_VLLM) + tuple(_OTHER)
PRESETS = AXIS_PRESETS + COMPONENT_PRESETS


def preset_names(spec: KVSpec) -> tuple[str, ...]:
    """The presets that can hold ``spec`` (the quantized presets, whose dtypes are their
    own, are asked for by name)."""
    no_mla = _NO_MLA | set(COMPONENT_PRESETS)
    return tuple(n for n in PRESETS if n not in QUANTIZED and not (spec.is_mla and n in no_mla))


def build_preset(cls, name: str, spec: KVSpec, num_blocks: int, num_layers: int = 1):
    """The preset ``name`` for ``spec``, built as ``cls`` (:class:`kvabi.Layout`, which
    imports this module and calls this from :meth:`kvabi.Layout.preset`)."""
    if not isinstance(name, str) or name not in PRESETS:
        raise KVABIError(f"name: unknown layout preset {name!r}; presets are {', '.join(PRESETS)}")
    if not isinstance(spec, KVSpec):
        raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
    num_blocks = as_int(num_blocks, "num_blocks", lo=1)
    num_layers = as_int(num_layers, "num_layers", lo=1)
    if name in COMPONENT_PRESETS:
        return build_component_preset(cls, name, spec, num_blocks, num_layers)
    if spec.quant == "per_token_head":  # the axis presets have no scale components
        raise KVABIError(f"spec.quant: preset {name!r} stores no per-token-head scales")
    if name in _VLLM:
        order, planes, folds = _VLLM[name], (), (("KV", "D"),)
    else:
        order, planes, folds = _OTHER[name]
    if spec.is_mla:
        if name in _NO_MLA:
            raise KVABIError(f"name: preset {name!r} has no MLA form (it needs K and V)")
        order = tuple(a for a in order if a != "KV")
        folds = tuple(f for f in folds if "KV" not in f)
    elif spec.head_dim_v != spec.head_dim:
        raise KVABIError(f"spec.head_dim_v: preset {name!r} needs head_dim_v == head_dim "
                         f"({spec.head_dim}), got {spec.head_dim_v}")
    sizes = {"L": num_layers, "B": num_blocks, "N": spec.block_size,
             "H": spec.num_kv_heads, "D": spec.head_dim}
    if not spec.is_mla:
        sizes["KV"] = 2
    extents, packing = None, None
    if name == "tpu.combined":
        extents = {"D": -(-spec.head_dim // 128) * 128}
        packing = tpu_packing(spec.dtype)
        if (2 * spec.num_kv_heads) % packing:
            raise KVABIError(f"spec.num_kv_heads: tpu.combined packs {packing} {spec.dtype} "
                             f"values per word; 2 * num_kv_heads = {2 * spec.num_kv_heads} is "
                             f"not a multiple (no hidden head padding)")
    base = cls(order=order, sizes=sizes, dtype=spec.dtype, planes=planes, extents=extents,
               folds=folds, packing=packing, name=name)
    return _pad_pages(base, spec)


def _pad_pages(layout, spec: KVSpec):
    """Apply ``spec.page_align``: round the bytes of one layer's block (as this layout holds
    it, head-dim padding included) up to the alignment by widening the B stride."""
    block = layout.stride("B")
    padded = -(-block // spec.page_align) * spec.page_align
    if padded == block:
        return layout
    inner = layout.order[layout.order.index("B") + 1:]
    if set(inner) != {"N", "H", "D"} | ({"KV"} if layout.has_kv else set()):
        raise KVABIError(f"spec.page_align: preset {layout.name!r} splits a layer's page "
                         f"across {layout.order}; page padding is not expressible there")
    strides = {a: layout.stride(a) for a in layout.order}
    strides["B"] = padded
    s = padded * layout.size("B")
    for a in reversed(layout.order[:layout.order.index("B")]):
        strides[a] = s
        s *= layout.extent(a)
    return attrs.evolve(layout, strides=strides)
