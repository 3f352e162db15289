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


from ..dtypes import DTYPES
from ..errors import KVABIError
from .argtypes import positive_int


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


def probe_backend(backend, spec, num_blocks: int, num_layers: int) -> list[dict]:
    """One row per preferred layout: declared, inferred, match, detail."""
    from ..layout import Layout
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
            row["inferred"] = name if diff is None else \
                got.name or "custom " + ",".join(got.order)
            row["match"] = diff is None
            row["detail"] = diff or ""
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
    from ..registry import get_backend

    rows = []
    for name in args.names:
        backend = get_backend(name)
        ok, why = backend.available()
        if not ok:
            raise KVABIError(f"name: backend {name!r} is not available here: {why}")
        spec = _spec_for(backend, args)
        rows += probe_backend(backend, spec, args.blocks, args.layers)
    if args.json:
        for r in rows:
            print(json.dumps(r, sort_keys=True))
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
    return 0 if all(r["match"] for r in rows) else 1
