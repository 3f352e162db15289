"""Which preset layouts the CUDA backends can read: those whose K/V views keep D contiguous."""
from __future__ import annotations

from kvabi import KVABIError, Layout
from kvabi.layout.presets import preset_names

#: preferred first; every other servable preset follows in kvabi's order
FIRST = ("flash_attn", "flashinfer.NHD", "flashinfer.HND")


#: the CUDA engines' own layouts (the libraries' native forms and vLLM's names)
CUDA_FAMILIES = ("flash_attn", "flashinfer.", "vllm.")


def d_contiguous_presets(spec, first=FIRST, families=None) -> tuple[str, ...]:
    """Preset names that hold ``spec`` with D contiguous in every K/V view, ``first`` first;
    ``families`` (name prefixes) keeps only those presets."""
    ok = []
    for name in preset_names(spec):
        if families is not None and not name.startswith(tuple(families)):
            continue
        try:
            lay = Layout.preset(name, spec, num_blocks=1)
        except KVABIError:  # the preset refuses this spec (packing, page_align, Dv != D)
            continue
        # the axis form (one order for keys and values: vllm.cpu's differ), D contiguous
        if lay.is_axis_form and lay.stride("D") == lay.itemsize:
            ok.append(name)
    head = [n for n in first if n in ok]
    return tuple(head + [n for n in ok if n not in head])


def nhd_or_hnd(layout) -> str:
    """FlashInfer's ``kv_layout`` for a kvabi layout: "NHD" when tokens are outer to heads
    in memory, "HND" otherwise (compared on byte strides, so any preset works)."""
    return "NHD" if layout.stride("N") >= layout.stride("H") else "HND"
