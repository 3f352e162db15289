"""The JSON form of a layout descriptor, and parsing untrusted ones (``specs/layout.md``,
JSON Schema in ``specs/layout.schema.json``, threat model in ``specs/security.md``).

A descriptor is written at :data:`~kvabi.util.version.WIRE_VERSION` (2.0): the axis form's
fields, or ``sizes`` and ``components``.  Every 1.x descriptor (the axis form) is still
read.  The text goes through the strict reader (:mod:`kvabi.util.safe_json`: size, depth,
duplicate keys, UTF-8, int64), every field's JSON type is checked here against the schema,
and the values are then checked by :class:`~kvabi.layout.descriptor.Layout` itself (int64 arithmetic
for every stride, span and total; bounds and overlaps of components).
"""
from __future__ import annotations

from ..model.shard import FIELDS as SHARD_FIELDS
from ..model.shard import Shard
from ..util.coerce import as_int
from ..util.errors import KVABIError
from ..util.safe_json import loads
from ..util.version import WIRE_VERSION, wire_version

#: Size limit of a descriptor's text (a real one is well under 4 KiB).
MAX_DESCRIPTOR_BYTES = 64 * 2**10
#: Nesting limit of a descriptor (the schema nests 4 deep).
MAX_DESCRIPTOR_DEPTH = 8
#: the descriptor majors a reader of this version takes
READS = (1, WIRE_VERSION[0])

_AXIS_FIELDS = ("name", "dtype", "order", "planes", "sizes", "extents", "strides",
                "plane_bytes", "folds", "packing", "shard")
_COMPONENT_FIELDS = ("name", "dtype", "count", "offset", "strides", "plane", "plane_strides")


def layout_to_dict(layout) -> dict:
    """The descriptor of ``layout`` as a JSON object at :data:`WIRE_VERSION`."""
    head = {"kvabi_abi": list(WIRE_VERSION), "name": layout.name}
    if layout.shard is not None:
        head["shard"] = layout.shard.to_dict()
    if layout.is_axis_form:
        return {**head,
                "dtype": layout.dtype,
                "order": list(layout.order),
                "planes": list(layout.planes),
                "sizes": dict(layout.sizes),
                "extents": dict(layout.extents) if layout.extents else {},
                "strides": dict(layout.strides) if layout.strides else None,
                "plane_bytes": layout.plane_bytes,
                "folds": [list(f) for f in layout.folds],
                "packing": layout.packing}
    pb = layout.plane_bytes
    return {**head,
            "sizes": dict(layout.sizes),
            "components": [c.to_dict() for c in layout.components],
            "plane_bytes": list(pb) if isinstance(pb, tuple) else pb}


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


def _shard(v):
    """The optional ``shard`` object: absent or null means every head (null is accepted as
    absent, like the schema's ``["object", "null"]``); unknown keys refused (a shard field
    this reader does not know could move which head a byte holds)."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise KVABIError(f"shard: must be an object, got {v!r:.80}")
    extra = sorted(set(v) - set(SHARD_FIELDS))
    if extra:
        raise KVABIError(f"shard.{extra[0]}: unknown field")
    return Shard.from_dict(v)


def _plane_bytes(v):
    if v is None:
        return None
    if isinstance(v, list):
        return tuple(_int(x, f"plane_bytes[{i}]") for i, x in enumerate(v))
    return _int(v, "plane_bytes")


def _components(v, newer: bool):
    if not isinstance(v, list):
        raise KVABIError(f"components: must be a list of objects, got {v!r:.80}")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict):
            raise KVABIError(f"components[{i}]: must be an object, got {c!r:.80}")
        if newer:  # a newer minor's optional fields are not ours to read
            c = {k: x for k, x in c.items() if k in _COMPONENT_FIELDS}
        out.append(c)
    return out


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
    if ver[0] not in READS:
        raise KVABIError(f"kvabi_abi: descriptor is ABI {ver[0]}.{ver[1]}; this reader "
                         f"understands majors {' and '.join(map(str, READS))}")
    newer = ver > WIRE_VERSION
    name = d.get("name")
    if name is not None and not isinstance(name, str):
        raise KVABIError(f"name: must be a string or null, got {name!r:.80}")
    if "sizes" not in d:
        raise KVABIError("sizes: missing from descriptor")
    sizes = _int_map(d["sizes"], "sizes")
    pb = _plane_bytes(d.get("plane_bytes"))
    if ver[0] >= 2 and "components" in d:
        if "order" in d:
            raise KVABIError("components: a descriptor holds components or the axis form's "
                             "order, not both")
        if "dtype" in d and not isinstance(d["dtype"], str):
            raise KVABIError(f"dtype: must be a string, got {d['dtype']!r:.80}")
        kw = {"dtype": d["dtype"]} if "dtype" in d else {}
        layout = cls(sizes=sizes, components=_components(d["components"], newer),
                     plane_bytes=pb, name=name, shard=_shard(d.get("shard")), **kw)
    else:
        for f in ("dtype", "order"):
            if f not in d:
                raise KVABIError(f"{f}: missing from descriptor")
        if not isinstance(d["dtype"], str):
            raise KVABIError(f"dtype: must be a string, got {d['dtype']!r:.80}")
        if isinstance(pb, tuple):
            raise KVABIError("plane_bytes: must be an integer or null in the axis form")
        folds = d.get("folds", [])
        if not isinstance(folds, list):
            raise KVABIError(f"folds: must be a list of lists, got {folds!r:.80}")
        # The schema: extents is an object (absent means none); strides an object or null.
        extents = _int_map(d["extents"], "extents") if "extents" in d else {}
        layout = cls(
            order=_str_list(d["order"], "order"),
            sizes=sizes,
            dtype=d["dtype"],
            planes=_str_list(d.get("planes", []), "planes"),
            extents=extents or None,
            strides=_int_map(d.get("strides"), "strides", allow_none=True),
            plane_bytes=pb,
            folds=tuple(_str_list(f, f"folds[{i}]") for i, f in enumerate(folds)),
            packing=None if d.get("packing") is None else _int(d["packing"], "packing"),
            name=name,
            shard=_shard(d.get("shard")),
        )
    if max_bytes is not None and layout.total_nbytes > max_bytes:
        raise KVABIError(f"descriptor: its {layout.num_planes} planes hold "
                         f"{layout.total_nbytes} bytes in all (total_nbytes), more than "
                         f"max_bytes={max_bytes}")
    return layout
