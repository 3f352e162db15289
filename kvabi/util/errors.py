"""The one exception kvabi raises for bad input."""


class KVABIError(ValueError):
    """Invalid input to kvabi: a spec, layout, descriptor, metadata or backend call.

    Messages name the offending field and value, e.g. ``"block_size: must be > 0, got 0"``.
    """


def require(cond: bool, field: str, msg: str, value=None) -> None:
    """Raise :class:`KVABIError` naming ``field`` (and ``value``) unless ``cond`` holds."""
    if not cond:
        raise KVABIError(f"{field}: {msg}" + ("" if value is None else f", got {value!r}"))


class FrozenError(KVABIError, AttributeError):
    """An attempt to change an object kvabi checked (a :class:`~kvabi.KVCache` attribute,
    a read-only mapping of a :class:`~kvabi.Layout`): it stays as it was checked."""


class UnsupportedError(KVABIError):
    """A backend was asked for something outside its capabilities (the message lists every
    reason)."""
