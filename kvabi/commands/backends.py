"""``kvabi backends``: the attention backends here, their availability and capabilities,
the layouts each prefers for a spec it claims, and the plugins that were refused or look
mistaken (warnings).

The spec of the layout listing starts from a typical one (full bfloat16, 8 KV heads x 128,
block 16) with the options given; what a backend does not claim and was not asked for is
replaced by something it claims, so every backend shows the layouts it would really use.
"""
from __future__ import annotations

import json

import attrs

from ..model.spec import KINDS, KVSpec
from ..util.argtypes import positive_int
from ..util.dtypes import DTYPES
from ..util.version import ABI_VERSION


def configure(parser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    g = parser.add_argument_group(
        "typical spec", "the spec whose preferred layouts are shown (default: full bfloat16, "
        "8 KV heads x 128, block 16, with what a backend does not claim replaced by what "
        "it does)")
    g.add_argument("--kind", default=None, choices=KINDS)
    g.add_argument("--dtype", default=None, choices=DTYPES)
    g.add_argument("--block-size", type=positive_int, default=None)
    g.add_argument("--kv-heads", type=positive_int, default=None)
    g.add_argument("--head-dim", type=positive_int, default=None)


TYPICAL = {"kind": "full", "dtype": "bfloat16", "block_size": 16, "kv_heads": 8,
           "head_dim": 128}
#: dtypes tried, in order, for a backend that does not claim the typical one
DTYPE_PREFERENCE = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")


def _spec(kind, dtype, block_size, kv_heads, head_dim) -> KVSpec:
    extra = {"window": 4096} if kind == "sliding_window" else \
        {"chunk": 8192} if kind == "chunked_local" else {}
    heads = 1 if kind == "mla" else kv_heads
    return KVSpec(kind, block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                  dtype=dtype, **extra)


def _typical_spec(args) -> KVSpec:
    return _spec(**{k: getattr(args, k) if getattr(args, k) is not None else v
                    for k, v in TYPICAL.items()})


def _closest(value: int, claimed, multiple: int = 1) -> int:
    if claimed is not None and value not in claimed:
        ok = [c for c in claimed if c % multiple == 0] or list(claimed)
        value = min(ok, key=lambda c: (abs(c - value), c))
    if value % multiple:
        value += multiple - value % multiple
    return value


def claimed_spec(backend, args) -> KVSpec:
    """The typical spec with every field not given on the command line replaced, where the
    backend does not claim it, by one it claims (the closest size, the first kind, the
    dtype earliest in :data:`DTYPE_PREFERENCE`)."""
    typical = _typical_spec(args)
    try:
        caps = backend.capabilities(None)
    except Exception:  # noqa: BLE001 - reported by describe()
        return typical
    v = {k: getattr(args, k) for k in TYPICAL}
    if v["kind"] is None:
        v["kind"] = "full" if "full" in caps.kinds or not caps.kinds else caps.kinds[0]
    if v["dtype"] is None:
        v["dtype"] = next((d for d in DTYPE_PREFERENCE if d in caps.dtypes),
                          caps.dtypes[0] if caps.dtypes else "bfloat16")
    if v["head_dim"] is None:
        v["head_dim"] = _closest(576 if v["kind"] == "mla" else 128, caps.head_dims)
    if v["block_size"] is None:
        v["block_size"] = _closest(16, caps.block_sizes, caps.block_size_multiple)
    if v["kv_heads"] is None:
        v["kv_heads"] = TYPICAL["kv_heads"]
    try:
        return _spec(**v)
    except Exception:  # noqa: BLE001 - odd capabilities: fall back to the typical spec
        return typical


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def describe(backend, spec: KVSpec) -> dict:
    """One backend as a JSON-able dict; a method that raises is reported, never fatal.
    ``preferred_layouts`` are those for ``spec``; ``unclaimed`` lists every reason the
    backend does not claim ``spec`` (empty when it does)."""
    d: dict = {"name": backend.name, "abi_version": list(backend.abi_version),
               "available": False, "reason": "", "capabilities": None,
               "spec": attrs.asdict(spec), "unclaimed": [],
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
        d["unclaimed"] = list(backend.capabilities(spec).refusals(spec))
    except Exception as e:  # noqa: BLE001
        d["errors"].append(f"capabilities(spec) raised {_err(e)}")
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
    from ..backend import registry

    spec = _typical_spec(args)
    items = [describe(b, claimed_spec(b, args)) for b in registry.all_backends()]
    refused = [attrs.asdict(r) for r in registry.refused()]
    warned = [attrs.asdict(w) for w in registry.warnings()]
    disabled = registry.disabled_plugins()
    if args.json:
        print(json.dumps({"kvabi_abi": list(ABI_VERSION), "typical_spec": attrs.asdict(spec),
                          "backends": items, "refused": refused, "warnings": warned,
                          "disabled": disabled}, indent=2))
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
    print("\npreferred layouts, for a spec each backend claims:")
    for d in items:
        print(f"  {d['name']}: {d['reason'] or ('available' if d['available'] else '')}")
        label = _spec_label(KVSpec(**d["spec"]))
        if d["unclaimed"]:
            label += f" (not claimed: {'; '.join(d['unclaimed'])})"
        print(f"    spec: {label}")
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
    if warned:
        print("\nwarnings:")
        for w in warned:
            print(f"  {w['plugin']}: {w['reason']}")
    if disabled:
        print(f"\nnot loaded (not in {registry.ENV_ALLOW}): {', '.join(disabled)}")
    return 0
