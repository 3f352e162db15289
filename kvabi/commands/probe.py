"""``kvabi probe NAME...``: infer the layout each backend's ``write_kv`` really produces on
each of its preferred layouts, and say whether it is the layout the backend declares.

For every preferred layout the backend allocates a cache, and ``kvabi.probe.infer_layout``
writes marked tokens through ``backend.write_kv`` (jax backends write into copies that are
read back: jax arrays are immutable).  A declared layout that the kernel does not follow
is a mismatch: exit status 1.
"""
from __future__ import annotations

import argparse
import json

from ..util.argtypes import directory_arg, positive_int
from ..util.dtypes import DTYPES
from ..util.errors import KVABIError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit status: 0 when every placement is the declared one, 1 when one "
                     "differs (or the probe fails), 2 on bad usage")
    parser.add_argument("names", nargs="+", metavar="NAME", help="registered backend names")
    parser.add_argument("--json", action="store_true", help="one JSON object per layout")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="cache dtype (default: the first the backend claims of "
                             "bfloat16, float16, float32, ...)")
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
    """One row per preferred layout: declared, inferred, match, detail."""
    from ..layout.descriptor import Layout
    from ..probe import backend_writer, infer_layout, placement_difference

    rows = []
    for name in backend.preferred_layouts(spec):
        row = {"backend": backend.name, "layout": name, "dtype": spec.dtype,
               "inferred": None, "match": False, "detail": ""}
        try:
            declared = Layout.preset(name, spec, num_blocks, num_layers)
            planes, write = backend_writer(backend, declared, spec)
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
            row["detail"] = diff or ""
            row["_layouts"] = (declared, got)
            if diff is not None:
                row["inferred_layout"] = got.to_dict()
        except Exception as e:  # noqa: BLE001 - a backend's failure is this row's result
            row["detail"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def _spec_for(backend, args):
    from .backends import claimed_spec

    ns = argparse.Namespace(kind=None, dtype=args.dtype, block_size=args.block_size,
                            kv_heads=args.kv_heads, head_dim=args.head_dim)
    return claimed_spec(backend, ns)


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
        cols = ["backend", "layout", "dtype", "inferred", "match"]
        table = [cols] + [[str(r[c]) if c != "match" else ("yes" if r[c] else "NO")
                           for c in cols] for r in rows]
        w = [max(len(t[i]) for t in table) for i in range(len(cols))]
        for t in table:
            print("  ".join(x.ljust(n) for x, n in zip(t, w)).rstrip())
        for r in rows:
            if not r["match"]:
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
    return 0 if all(r["match"] for r in rows) else 1


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
