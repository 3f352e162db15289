"""``kvabi probe NAME...``: infer the layout each backend's ``write_kv`` really produces on
each of its preferred layouts, and say whether it is the layout the backend declares.

For every preferred layout the backend allocates a cache, and ``kvabi.probe.infer_layout``
writes marked tokens through ``backend.write_kv`` (jax backends write into copies that are
read back: jax arrays are immutable).  A per-token-head quantized cache (``--quant
per_token_head``) cannot carry markers through its quantizing write: its declared layout is
checked with ``kvabi.probe.verify_quantized`` instead.

Each row's result is ``match``, ``MISMATCH`` (the bytes are not where the layout says, or
the probe found the write broken), or ``refused`` (the backend does not serve the spec or
layout, said with a KVABIError: nothing was verified, nothing found wrong).  Exit status: 0
when every row matches, 1 when one is a mismatch, 3 when none is but one was refused, 2 on
bad usage.
"""
from __future__ import annotations

import argparse
import json

from ..util.argtypes import directory_arg, positive_int
from ..util.dtypes import DTYPES
from ..util.errors import KVABIError
from ..model.quant import FORMATS, QUANT_MODES, ROUNDINGS

MATCH, MISMATCH, REFUSED = "match", "MISMATCH", "refused"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit status: 0 when every placement is the declared one, 1 when one "
                     "differs (or the probe finds the write broken), 3 when none differs but "
                     "the backend refused one (nothing verified there), 2 on bad usage")
    parser.add_argument("names", nargs="+", metavar="NAME", help="registered backend names")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cache dtype (default: the first the backend claims of "
                             "bfloat16, float16, float32, ...)")
    parser.add_argument("--quant", choices=QUANT_MODES, default=None,
                        help="quantization of the cache (default none; per_tensor and "
                             "per_token_head need an int8 or float8 --dtype, default the "
                             "first the backend claims)")
    parser.add_argument("--rounding", choices=ROUNDINGS, default=None,
                        help="rounding of a quantized cache (default: the first the backend "
                             "claims for the dtype)")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="KV heads (default 2)")
    parser.add_argument("--head-dim", type=positive_int, default=None,
                        help="head dim (default: the claimed one closest to 128)")
    parser.add_argument("--block-size", type=positive_int, default=None,
                        help="block size (default: the claimed one closest to 16)")
    parser.add_argument("--blocks", type=positive_int, default=4, help="blocks in the cache")
    parser.add_argument("--layers", type=positive_int, default=2, help="layers in the cache")
    parser.add_argument("--draw", action="store_true",
                        help="draw block 0 of layer 0 of each layout: where the backend's "
                             "bytes landed (the inferred layout) under where the declared "
                             "layout puts them, differing bytes marked")
    parser.add_argument("--svg", type=directory_arg, metavar="DIR",
                        help="write the same drawings as SVG files into DIR, one per "
                             "backend and layout")


def probe_backend(backend, spec, num_blocks: int, num_layers: int) -> list[dict]:
    """One row per preferred layout: declared, inferred, result (match, MISMATCH, refused),
    match, detail."""
    from ..layout.descriptor import Layout
    from ..probe import (WriteRefused, backend_writer, infer_layout, placement_difference,
                         verify_quantized)

    rows = []
    for name in backend.preferred_layouts(spec):
        row = {"backend": backend.name, "layout": name, "dtype": spec.dtype,
               "quant": spec.quant, "rounding": spec.rounding, "inferred": None,
               "result": MISMATCH, "match": False, "detail": ""}
        try:
            declared = Layout.preset(name, spec, num_blocks, num_layers)
            why = backend.refusals(spec, declared)
            if why:
                raise WriteRefused(f"{backend.name} does not serve it: {'; '.join(why)}")
            planes, write = backend_writer(backend, declared, spec)
            if spec.quant == "per_token_head":
                verify_quantized(declared, planes, write, samples=4)
                got, diff = declared, None
            else:
                got = infer_layout(spec, planes, write, num_blocks=num_blocks,
                                   num_layers=num_layers, samples=4)
                diff = placement_difference(declared, got)
            # Presets can place every element alike (tpu.hidden and flash_attn): name the
            # declared one when it is among them.
            row["inferred"] = name if diff is None else got.name or (
                "custom " + (",".join(got.order) if got.is_axis_form else
                             "components " + ",".join(got.component_names)))
            row["components"] = list(got.component_names)
            row["match"] = diff is None
            row["result"] = MATCH if diff is None else MISMATCH
            row["detail"] = diff or ""
            row["_layouts"] = (declared, got)
            if diff is not None:
                row["inferred_layout"] = got.to_dict()
        except WriteRefused as e:
            row["result"], row["detail"] = REFUSED, str(e)
        except Exception as e:  # noqa: BLE001 - a backend's failure is this row's result
            row["detail"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def _spec_for(backend, args):
    import attrs

    from .backends import DTYPE_PREFERENCE, claimed_spec

    dtype = args.dtype
    quant = args.quant or "none"
    caps = backend.capabilities(None)
    if quant != "none" and dtype is None:  # the first quantizable dtype it claims
        dtype = next((d for d in DTYPE_PREFERENCE if d in FORMATS and d in caps.dtypes),
                     "int8")
    ns = argparse.Namespace(kind=None, dtype=dtype, block_size=args.block_size,
                            kv_heads=args.kv_heads, head_dim=args.head_dim)
    spec = claimed_spec(backend, ns)
    if quant == "none":
        if args.rounding not in (None, "nearest_even"):
            raise KVABIError(f"rounding: {args.rounding!r} is for a quantized cache; give "
                             f"--quant per_tensor or per_token_head")
        return spec
    if spec.dtype not in FORMATS:
        raise KVABIError(f"dtype: --quant {quant} needs an int8 or float8 cache, got "
                         f"{spec.dtype!r}")
    rounding = args.rounding or next(
        (r for r in getattr(caps, "roundings", ()) if r in FORMATS[spec.dtype].roundings),
        "nearest_even")
    return attrs.evolve(spec, quant=quant, rounding=rounding)


def run(args) -> int:
    from ..backend.registry import get_backend

    rows = []
    for name in args.names:
        backend = get_backend(name)
        ok, why = backend.available()
        if not ok:
            raise KVABIError(f"name: backend {name!r} is not available here: {why}")
        spec = _spec_for(backend, args)
        rows += probe_backend(backend, spec, args.blocks, args.layers)
    drawings = [_drawing(r) for r in rows] if args.draw or args.svg else []
    if args.svg:
        _write_svgs(rows, drawings, args.svg)
    if args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if not k.startswith("_")},
                             sort_keys=True))
    else:
        cols = ["backend", "layout", "dtype", "quant", "inferred", "result"]
        table = [cols] + [["-" if r[c] is None else str(r[c]) for c in cols] for r in rows]
        w = [max(len(t[i]) for t in table) for i in range(len(cols))]
        for t in table:
            print("  ".join(x.ljust(n) for x, n in zip(t, w)).rstrip())
        for r in rows:
            if r["result"] == REFUSED:
                print(f"{r['backend']} {r['layout']}: refused (nothing verified): "
                      f"{r['detail']}")
            elif r["result"] != MATCH:
                print(f"{r['backend']} {r['layout']}: {r['detail']}")
        if args.draw:
            from ..layout.byte_map import text
            from .layout import colour_wanted

            for r, d in zip(rows, drawings):
                print()
                print(f"{r['backend']} {r['layout']} (components found: "
                      f"{', '.join(r.get('components', [])) or 'none'})")
                print(text(d[0], colour=colour_wanted("auto"), against=d[1]) if d else
                      f"nothing to draw: {r['detail']}")
    results = {r["result"] for r in rows}
    return 1 if MISMATCH in results else 3 if REFUSED in results else 0


def _drawing(row):
    """(declared map, landed map) of block 0 of layer 0 over the declared layout's bytes
    of it, or None where no layout was found."""
    from ..layout.byte_map import block_map
    from ..layout.regions import block_cells

    if "_layouts" not in row:
        return None
    declared, got = row["_layouts"]
    cells = block_cells(declared, [(0, 0)])
    return (block_map(declared, cells=cells),
            block_map(got, cells=[c for c in cells if c[0] < got.num_planes]))


def _write_svgs(rows, drawings, folder):
    from pathlib import Path

    from ..layout.byte_map import svg

    for r, d in zip(rows, drawings):
        if d is not None:
            path = Path(folder) / f"{r['backend']}_{r['layout']}.svg"
            path.write_text(svg(d[0], against=d[1]))
            print(f"wrote {path}")
