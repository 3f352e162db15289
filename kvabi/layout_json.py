"""Parsing untrusted layout descriptors (``specs/layout.md``, JSON Schema in ``specs/``)."""
from __future__ import annotations

import json

from .abi import ABI_VERSION
from .errors import KVABIError

_FIELDS = ("name", "dtype", "order", "planes", "sizes", "extents", "strides", "plane_bytes",
           "folds", "packing")


def _int(v, field):
    if not isinstance(v, int) or isinstance(v, bool):
        raise KVABIError(f"{field}: must be an integer, got {v!r}")
    return v


def _str_list(v, field):
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise KVABIError(f"{field}: must be a list of axis names, got {v!r}")
    return tuple(v)


def _int_map(v, field, allow_none=False):
    if v is None and allow_none:
        return None
    if not isinstance(v, dict):
        raise KVABIError(f"{field}: must be an object of axis -> integer, got {v!r}")
    return {str(k): _int(x, f"{field}.{k}") for k, x in v.items()}


def layout_from_json(cls, text, *, max_bytes=None):
    try:
        d = json.loads(text) if isinstance(text, (str, bytes, bytearray)) else text
    except (ValueError, UnicodeDecodeError) as e:
        raise KVABIError(f"descriptor: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise KVABIError(f"descriptor: must be a JSON object, got {type(d).__name__}")
    ver = d.get("kvabi_abi")
    if (not isinstance(ver, list) or len(ver) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ver)):
        raise KVABIError(f"kvabi_abi: must be [major, minor], got {ver!r}")
    if ver[0] != ABI_VERSION[0]:
        raise KVABIError(f"kvabi_abi: descriptor is ABI {ver[0]}.{ver[1]}; this reader "
                         f"understands major {ABI_VERSION[0]} only")
    for f in ("dtype", "order", "sizes"):
        if f not in d:
            raise KVABIError(f"{f}: missing from descriptor")
    name = d.get("name")
    if name is not None and not isinstance(name, str):
        raise KVABIError(f"name: must be a string or null, got {name!r}")
    if not isinstance(d["dtype"], str):
        raise KVABIError(f"dtype: must be a string, got {d['dtype']!r}")
    folds = d.get("folds", [])
    if not isinstance(folds, list):
        raise KVABIError(f"folds: must be a list of lists, got {folds!r}")
    pb = d.get("plane_bytes")
    layout = cls(
        order=_str_list(d["order"], "order"),
        sizes=_int_map(d["sizes"], "sizes"),
        dtype=d["dtype"],
        planes=_str_list(d.get("planes", []), "planes"),
        extents=_int_map(d.get("extents") or {}, "extents") or None,
        strides=_int_map(d.get("strides"), "strides", allow_none=True),
        plane_bytes=None if pb is None else _int(pb, "plane_bytes"),
        folds=tuple(_str_list(f, f"folds[{i}]") for i, f in enumerate(folds)),
        packing=None if d.get("packing") is None else _int(d["packing"], "packing"),
        name=name,
    )
    if max_bytes is not None and layout.plane_nbytes > max_bytes:
        raise KVABIError(f"plane_bytes: descriptor's planes span {layout.plane_nbytes} bytes, "
                         f"more than the {max_bytes} bytes available")
    return layout
