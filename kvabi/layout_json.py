"""Parsing untrusted layout descriptors (``specs/layout.md``, JSON Schema in ``specs/``,
threat model in ``specs/security.md``).

The text goes through the strict reader (:mod:`kvabi.safe_json`: size, depth, duplicate
keys, UTF-8, int64), every field's JSON type is checked here against the schema, and the
values are then checked by :class:`~kvabi.layout.Layout` itself (int64 arithmetic for every
stride, span and total).
"""
from __future__ import annotations

from .coerce import as_int
from .errors import KVABIError
from .safe_json import loads
from .version import WIRE_VERSION, wire_version

#: Size limit of a descriptor's text (a real one is well under 1 KiB).
MAX_DESCRIPTOR_BYTES = 64 * 2**10
#: Nesting limit of a descriptor (the schema nests 3 deep).
MAX_DESCRIPTOR_DEPTH = 8

_FIELDS = ("name", "dtype", "order", "planes", "sizes", "extents", "strides", "plane_bytes",
           "folds", "packing")


def _int(v, field):
    return as_int(v, field)


def _str_list(v, field):
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise KVABIError(f"{field}: must be a list of axis names, got {v!r:.80}")
    return tuple(v)


def _int_map(v, field, allow_none=False):
    if v is None and allow_none:
        return None
    if not isinstance(v, dict):
        raise KVABIError(f"{field}: must be an object of axis -> integer, got {v!r:.80}")
    return {str(k): _int(x, f"{field}.{k}") for k, x in v.items()}


def layout_from_json(cls, text, *, max_bytes=None):
    """A :class:`~kvabi.Layout` from descriptor text (str or bytes) or an already parsed
    dict; KVABIError naming the field for anything malformed or beyond ``max_bytes``."""
    if max_bytes is not None:
        max_bytes = as_int(max_bytes, "max_bytes", lo=0)
    if isinstance(text, (str, bytes, bytearray, memoryview)):
        d = loads(text, what="descriptor", max_bytes=MAX_DESCRIPTOR_BYTES,
                  max_depth=MAX_DESCRIPTOR_DEPTH, name_fields=True)
    else:
        d = text
    if not isinstance(d, dict):
        raise KVABIError(f"descriptor: must be a JSON object, got {type(d).__name__}")
    ver = wire_version(d.get("kvabi_abi"))
    if ver[0] != WIRE_VERSION[0]:
        raise KVABIError(f"kvabi_abi: descriptor is ABI {ver[0]}.{ver[1]}; this reader "
                         f"understands major {WIRE_VERSION[0]} only")
    for f in ("dtype", "order", "sizes"):
        if f not in d:
            raise KVABIError(f"{f}: missing from descriptor")
    name = d.get("name")
    if name is not None and not isinstance(name, str):
        raise KVABIError(f"name: must be a string or null, got {name!r:.80}")
    if not isinstance(d["dtype"], str):
        raise KVABIError(f"dtype: must be a string, got {d['dtype']!r:.80}")
    folds = d.get("folds", [])
    if not isinstance(folds, list):
        raise KVABIError(f"folds: must be a list of lists, got {folds!r:.80}")
    pb = d.get("plane_bytes")
    # The schema: extents is an object (absent means none); strides an object or null.
    extents = _int_map(d["extents"], "extents") if "extents" in d else {}
    layout = cls(
        order=_str_list(d["order"], "order"),
        sizes=_int_map(d["sizes"], "sizes"),
        dtype=d["dtype"],
        planes=_str_list(d.get("planes", []), "planes"),
        extents=extents or None,
        strides=_int_map(d.get("strides"), "strides", allow_none=True),
        plane_bytes=None if pb is None else _int(pb, "plane_bytes"),
        folds=tuple(_str_list(f, f"folds[{i}]") for i, f in enumerate(folds)),
        packing=None if d.get("packing") is None else _int(d["packing"], "packing"),
        name=name,
    )
    if max_bytes is not None and layout.total_nbytes > max_bytes:
        raise KVABIError(f"descriptor: its {layout.num_planes} planes hold "
                         f"{layout.total_nbytes} bytes in all (total_nbytes), more than "
                         f"max_bytes={max_bytes}")
    return layout
