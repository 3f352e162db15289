"""``kvabi backends``: the attention backends here, their availability and capabilities."""
from __future__ import annotations

import json

import attrs

from ..abi import ABI_VERSION
from ..dtypes import DTYPES
from ..spec import KINDS, KVSpec
from .argtypes import positive_int


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    g = parser.add_argument_group("typical spec", "the spec whose preferred layouts are shown")
    g.add_argument("--kind", default="full", choices=KINDS)
    g.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--kv-heads", type=positive_int, default=8)
    g.add_argument("--head-dim", type=positive_int, default=128)


def _typical_spec(args) -> KVSpec:
    extra = {"window": 4096} if args.kind == "sliding_window" else \
        {"chunk": 8192} if args.kind == "chunked_local" else {}
    heads = 1 if args.kind == "mla" else args.kv_heads
    return KVSpec(args.kind, block_size=args.block_size, num_kv_heads=heads,
                  head_dim=args.head_dim, dtype=args.dtype, **extra)


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def describe(backend, spec: KVSpec) -> dict:
    """One backend as a JSON-able dict; a method that raises is reported, never fatal."""
    d: dict = {"name": backend.name, "abi_version": list(backend.abi_version),
               "available": False, "reason": "", "capabilities": None,
               "preferred_layouts": None, "errors": []}
    try:
        ok, why = backend.available()
        d["available"], d["reason"] = bool(ok), str(why)
    except Exception as e:  # noqa: BLE001 - foreign code must not break the listing
        d["reason"] = f"available() raised {_err(e)}"
    try:
        caps = backend.capabilities(None)
        d["capabilities"] = {k: (list(v) if isinstance(v, tuple) else v)
                             for k, v in attrs.asdict(caps, recurse=False).items()}
    except Exception as e:  # noqa: BLE001
        d["errors"].append(f"capabilities() raised {_err(e)}")
    try:
        d["preferred_layouts"] = list(backend.preferred_layouts(spec))
    except Exception as e:  # noqa: BLE001
        d["errors"].append(f"preferred_layouts() raised {_err(e)}")
    return d


def _summary(values, universe) -> str:
    if values is None:
        return "any"
    if universe and set(values) == set(universe):
        return "all"
    v = list(values)
    # Long arithmetic runs (e.g. head dims 8, 16, ..., 256) read better as a range.
    if len(v) >= 4 and all(isinstance(x, int) for x in v) and \
            len({b - a for a, b in zip(v, v[1:])}) == 1 and v[1] > v[0]:
        return f"{v[0]}..{v[-1]}/{v[1] - v[0]}"
    return ",".join(str(x) for x in v) or "-"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _spec_label(s: KVSpec) -> str:
    return (f"{s.kind} {s.dtype}, {s.num_kv_heads} kv heads x {s.head_dim}, "
            f"block {s.block_size}")


def run(args) -> int:
    from .. import registry

    spec = _typical_spec(args)
    items = [describe(b, spec) for b in registry.all_backends()]
    refused = [attrs.asdict(r) for r in registry.refused()]
    disabled = registry.disabled_plugins()
    if args.json:
        print(json.dumps({"kvabi_abi": list(ABI_VERSION), "typical_spec": attrs.asdict(spec),
                          "backends": items, "refused": refused, "disabled": disabled},
                         indent=2))
        return 0
    rows = [["NAME", "AVAILABLE", "ABI", "KINDS", "DTYPES", "HEAD DIMS", "BLOCK SIZES",
             "SOFTCAP", "SINKS"]]
    for d in items:
        c = d["capabilities"] or {}
        blocks = _summary(c.get("block_sizes"), ())
        if c.get("block_size_multiple", 1) > 1:
            blocks += f" (x{c['block_size_multiple']})"
        rows.append([d["name"], "yes" if d["available"] else "no",
                     ".".join(map(str, d["abi_version"])),
                     _summary(c.get("kinds"), KINDS) if c else "?",
                     _summary(c.get("dtypes"), DTYPES) if c else "?",
                     _summary(c.get("head_dims"), ()) if c else "?",
                     blocks if c else "?",
                     ("yes" if c.get("softcap") else "no") if c else "?",
                     ("yes" if c.get("sinks") else "no") if c else "?"])
    print(_table(rows))
    print(f"\npreferred layouts for {_spec_label(spec)}:")
    for d in items:
        print(f"  {d['name']}: {d['reason'] or ('available' if d['available'] else '')}")
        lay = d["preferred_layouts"]
        print(f"    layouts: {', '.join(lay) if lay else '(none)' if lay is not None else '?'}")
        notes = (d["capabilities"] or {}).get("notes")
        if notes:
            print(f"    notes: {notes}")
        for e in d["errors"]:
            print(f"    error: {e}")
    if refused:
        print("\nrefused:")
        for r in refused:
            where = "" if r["plugin"] == r["name"] else f" (plugin {r['plugin']})"
            print(f"  {r['name']}{where}: {r['reason']}")
    if disabled:
        print(f"\nnot loaded (not in {registry.ENV_ALLOW}): {', '.join(disabled)}")
    return 0
