"""``kvabi layout show NAME|FILE.json``: one block of a layout as a byte map, each component
(keys, values, scales, latent, rope) and the padding in its own colour, the byte offsets on
the axis; as text in the terminal (coloured when it is a terminal) and, with ``--svg``, as
an SVG file."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..util.argtypes import int_arg, output_file_arg, positive_int
from ..util.dtypes import DTYPES
from ..util.errors import KVABIError


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    show = sub.add_parser("show", help="draw one block of a layout as a byte map",
                          description=__doc__.split("\n\n")[0])
    show.add_argument("layout", metavar="NAME|FILE.json",
                      help="a preset name (built for the spec the options give) or a layout "
                           "descriptor file (JSON, read as untrusted)")
    show.add_argument("--svg", type=output_file_arg, metavar="PATH",
                      help="also write the map as an SVG file to PATH")
    show.add_argument("--layer", type=int_arg(lo=0, name="index"), default=0,
                      help="layer drawn (default 0)")
    show.add_argument("--block", type=int_arg(lo=0, name="index"), default=0,
                      help="block drawn (default 0)")
    show.add_argument("--colour", "--color", choices=("auto", "always", "never"),
                      default="auto", help="ANSI colours in the text map (auto: when stdout "
                                           "is a terminal and NO_COLOR is unset)")
    show.add_argument("--quiet", action="store_true", help="print no text map (with --svg)")
    g = show.add_argument_group("the spec a preset is built for")
    g.add_argument("--kind", choices=("full", "mla"), default=None,
                   help="full attention or MLA (default: MLA for deepseek.* presets)")
    g.add_argument("--dtype", choices=DTYPES, default="float16",
                   help="cache dtype (default float16; quantized presets use their own)")
    g.add_argument("--kv-heads", type=positive_int, default=2, help="KV heads (default 2)")
    g.add_argument("--head-dim", type=positive_int, default=None,
                   help="head dim (default 8; 576 for MLA, whose value part is 512)")
    g.add_argument("--block-size", type=positive_int, default=4,
                   help="tokens per block (default 4)")
    g.add_argument("--blocks", type=positive_int, default=2, help="blocks (default 2)")
    g.add_argument("--layers", type=positive_int, default=2, help="layers (default 2)")


def load(args):
    """The layout the arguments name: a descriptor file, or a preset for their spec."""
    from ..layout.descriptor import Layout
    from ..layout.presets import PRESETS
    from ..model.spec import KVSpec

    name = args.layout
    if name in PRESETS:
        mla = args.kind == "mla" or (args.kind is None and name.startswith("deepseek."))
        d = args.head_dim or (576 if mla else 8)
        spec = KVSpec("mla" if mla else "full", block_size=args.block_size,
                      num_kv_heads=1 if mla else args.kv_heads, head_dim=d,
                      head_dim_v=min(512, d) if mla else None, dtype=args.dtype)
        return Layout.preset(name, spec, args.blocks, args.layers)
    path = Path(name)
    if not path.is_file():
        raise KVABIError(f"layout: {name!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         f"descriptor file")
    return Layout.from_json(path.read_bytes())


def colour_wanted(choice: str, stream=None) -> bool:
    """Whether to colour: ``always``, ``never``, or (``auto``) when ``stream`` is a terminal
    and ``NO_COLOR`` is unset."""
    if choice != "auto":
        return choice == "always"
    stream = sys.stdout if stream is None else stream
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


def run(args) -> int:
    from ..layout.byte_map import block_map, svg, text

    layout = load(args)
    for what, v, n in (("layer", args.layer, layout.num_layers),
                       ("block", args.block, layout.num_blocks)):
        if v >= n:
            raise KVABIError(f"{what}: {v} out of range [0, {n})")
    bm = block_map(layout, layer=args.layer, block=args.block)
    if not args.quiet:
        print(text(bm, colour=colour_wanted(args.colour)))
    if args.svg:
        Path(args.svg).write_text(svg(bm))
        print(f"wrote {args.svg}")
    return 0
