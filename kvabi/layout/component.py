"""One component of a layout (``specs/layout.md``, *Components*): what it holds (a name
from a closed vocabulary, a dtype, a count of elements) and where each element lives (a
plane, a byte offset, byte strides over the axes it varies along).

A component is checked alone here (names, types, signs, alignment); what needs the
layout's sizes and the other components (bounds, overlaps, which names go together) is
checked by :mod:`kvabi.layout.check` when a :class:`~kvabi.Layout` is built.
"""
from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..util.coerce import as_int
from ..util.dtypes import check_component_dtype, per_unit, unit_bytes
from ..util.errors import KVABIError, require
from ..util.frozen import FrozenDict

#: the axes a component's elements vary along: layer, block, token in the block, KV head,
#: and ``E``, the element within one (layer, block, token, head) index
AXES = ("L", "B", "N", "H", "E")
#: what a component holds: data, and the scales of data (``<data>_scale``: one scale per
#: group of ``data.count / scale.count`` consecutive elements)
DATA = ("key", "value", "latent", "rope")
NAMES = DATA + tuple(f"{d}_scale" for d in DATA)
#: the component of each K/V index of the 1.x addressing (``kv`` 0 and 1; MLA: latent)
KV_NAMES = ("key", "value")


def _name(x):
    if not isinstance(x, str) or x not in NAMES:
        raise KVABIError(f"name: must be one of {', '.join(NAMES)}, got {x!r:.60}")
    return x


def _axis_ints(field, allowed, lo):
    """Converter: a mapping axis -> int (>= ``lo``) over ``allowed`` axes, as a FrozenDict
    in :data:`AXES` order; KVABIError naming ``field.axis``."""
    def convert(x):
        if not isinstance(x, Mapping):
            raise KVABIError(f"{field}: must be an object of axis -> integer, got {x!r:.80}")
        out = {}
        for a, v in x.items():
            if a not in allowed:
                raise KVABIError(f"{field}: unknown axis {a!r:.20}; a component's axes are "
                                 f"{', '.join(allowed)}")
            out[a] = as_int(v, f"{field}.{a}", lo=lo)
        return FrozenDict(sorted(out.items(), key=lambda kv: AXES.index(kv[0])))

    return convert


@attrs.frozen(kw_only=True)
class Component:
    """Where each element of one part of a cache lives.

    Element ``e`` (``0 <= e < count``) of index ``(l, b, n, h)`` sits in plane
    ``plane + l * plane_strides["L"]`` at byte ``offset + sum(index[a] * strides[a])`` over
    the axes in ``strides`` (``E`` is ``e``, or ``e // 2`` for a packed dtype, whose element
    ``e`` is the low nibble when even, the high nibble when odd).  An axis in neither
    ``strides`` nor ``plane_strides`` is one the component does not vary along (a scale per
    (block, head) has no ``N``).

    ``B`` must be in ``strides`` (every component is block data; ``L`` may select planes
    instead).  Offsets and strides are multiples of the dtype's storage unit, so that every
    element is naturally aligned within its plane.
    """

    name: str = attrs.field(converter=_name)
    dtype: str = attrs.field(converter=lambda x: check_component_dtype(x, "dtype"))
    count: int = attrs.field(converter=lambda x: as_int(x, "count", lo=1))
    strides: Mapping[str, int] = attrs.field(converter=_axis_ints("strides", AXES, 1))
    offset: int = attrs.field(default=0, converter=lambda x: as_int(x, "offset", lo=0))
    plane: int = attrs.field(default=0, converter=lambda x: as_int(x, "plane", lo=0))
    plane_strides: Mapping[str, int] = attrs.field(
        factory=FrozenDict, converter=_axis_ints("plane_strides", ("L",), 1))

    @strides.validator
    def _check(self, attribute, strides):
        unit = self.unit
        require("B" in strides, f"{self.name}.strides", "must give a stride for B (every "
                "component is block data)", dict(strides))
        require(not ("L" in strides and "L" in self.plane_strides), f"{self.name}.strides",
                "L is a plane axis (plane_strides) and a byte axis at once")
        require(self.count % per_unit(self.dtype) == 0, f"{self.name}.count",
                f"must be even: {self.dtype} packs two elements per byte", self.count)
        require("E" in strides or self.units == 1, f"{self.name}.strides",
                f"must give a stride for E ({self.count} elements)")
        for a, s in strides.items():
            require(s % unit == 0, f"{self.name}.strides.{a}",
                    f"must be a multiple of the {self.dtype} unit of {unit} bytes", s)
        require(self.offset % unit == 0, f"{self.name}.offset",
                f"must be a multiple of the {self.dtype} unit of {unit} bytes", self.offset)

    # -- derived -----------------------------------------------------------------------
    @property
    def unit(self) -> int:
        """Bytes of one storage unit (the itemsize; 1 for a packed dtype)."""
        return unit_bytes(self.dtype)

    @property
    def units(self) -> int:
        """Storage units along ``E`` (``count``, or ``count // 2`` packed)."""
        return self.count // per_unit(self.dtype)

    @property
    def elem_stride(self) -> int:
        """Byte stride between storage units along ``E``."""
        return self.strides.get("E", self.unit)

    def varies(self, axis: str) -> bool:
        """Whether the component's elements differ along ``axis`` (L, B, N or H)."""
        return axis in self.strides or axis in self.plane_strides

    @property
    def base(self) -> str:
        """The data component a scale belongs to (``key`` for ``key_scale``), or the
        component's own name."""
        return self.name[:-len("_scale")] if self.name.endswith("_scale") else self.name

    @property
    def is_scale(self) -> bool:
        return self.name.endswith("_scale")

    def to_dict(self) -> dict:
        """The JSON form (``specs/layout.schema.json``, ``components[i]``)."""
        d = {"name": self.name, "dtype": self.dtype, "count": self.count,
             "offset": self.offset, "strides": dict(self.strides), "plane": self.plane}
        if self.plane_strides:
            d["plane_strides"] = dict(self.plane_strides)
        return d


def check_component(value, field: str = "components") -> Component:
    """``value`` when it is a :class:`Component`, a mapping of its fields (the JSON form),
    else KVABIError naming ``field``."""
    if isinstance(value, Component):
        return value
    if not isinstance(value, Mapping):
        raise KVABIError(f"{field}: must be a Component or an object of its fields, got "
                         f"{type(value).__name__}")
    known = {a.name for a in attrs.fields(Component)}
    extra = sorted(set(value) - known)
    if extra:
        raise KVABIError(f"{field}.{extra[0]!s:.40}: unknown component field; fields are "
                         f"{', '.join(sorted(known))}")
    for f in ("name", "dtype", "count", "strides"):
        if f not in value:
            raise KVABIError(f"{field}.{f}: missing")
    try:
        return Component(**value)
    except KVABIError as e:  # the validators name the component, the converters a field
        name = value.get("name")
        msg = str(e)
        if isinstance(name, str) and msg.startswith(name + "."):
            raise KVABIError(f"components.{msg}") from None
        raise KVABIError(f"{field}.{msg}") from None


def component_field(c, i: int) -> str:
    """How errors name component ``i`` of a layout: by its name when it has a valid one."""
    name = c.get("name") if isinstance(c, Mapping) else getattr(c, "name", None)
    return f"components.{name}" if isinstance(name, str) and name in NAMES else \
        f"components[{i}]"
