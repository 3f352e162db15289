"""The P/D options of ``kvabi_transformers.use(..., pd=...)`` and ``kvabi-transformers serve
--kv-transfer-config``, checked once where they enter (KVABIError naming the key).

``pd`` is a :class:`kvabi.pd.PDSettings`, a role name, or a dict in the shape of vLLM's
``--kv-transfer-config`` so one JSON configures both engines:
``{"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config":
{...}}`` (``role`` and the keys of ``PDSettings`` are also taken at the top level).
Keys of the extra config: those of ``PDSettings`` (bounds, ``nixl_host``, ``model_id``),
``engine_id`` (names the NIXL agent), ``max_model_len`` (the longest request a grant
record holds; default the model's ``max_position_embeddings``) and
``kv_load_failure_policy`` (``fail``: a request whose pull failed fails; ``recompute``:
it computes its prompt itself).  vLLM's connector names (``kv_connector``,
``kv_connector_module_path``) are accepted and ignored.
"""
from __future__ import annotations

import attrs

from kvabi import KVABIError
from kvabi.util.coerce import as_int
from kvabi.pd import PDSettings

#: vLLM's role names and the protocol's
ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both",
         "producer": "producer", "consumer": "consumer", "both": "both"}
#: keys of the adapter beside PDSettings'
ADAPTER_KEYS = ("engine_id", "max_model_len", "kv_load_failure_policy")
POLICIES = ("fail", "recompute")
#: vLLM configuration keys that name its connector (nothing to do here)
IGNORED = ("kv_connector", "kv_connector_module_path", "kv_buffer_device", "engine_id_prefix")


@attrs.frozen
class PDOptions:
    """What ``pd=`` asked: the protocol's settings and the adapter's own."""

    settings: PDSettings
    engine_id: str | None = None
    max_model_len: int | None = None
    failure_policy: str = "fail"


def pd_options(pd) -> PDOptions | None:
    """``pd`` (see the module docstring) as PDOptions; None for None."""
    if pd is None:
        return None
    if isinstance(pd, PDOptions):
        return pd
    if isinstance(pd, PDSettings):
        return PDOptions(pd)
    if isinstance(pd, str):
        pd = {"kv_role": pd}
    if not isinstance(pd, dict):
        raise KVABIError(f"pd: must be a role name, a dict or a kvabi.pd.PDSettings, got "
                         f"{type(pd).__name__}")
    flat = {k: v for k, v in pd.items() if k not in ("kv_connector_extra_config",) + IGNORED}
    extra = pd.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise KVABIError(f"pd.kv_connector_extra_config: must be an object, got "
                         f"{type(extra).__name__}")
    both = {**flat, **extra}
    role = both.pop("kv_role", both.pop("role", "both"))
    if role not in ROLES:
        raise KVABIError(f"pd.kv_role: must be one of {', '.join(ROLES)}, got {role!r:.60}")
    fields = {f.name for f in attrs.fields(PDSettings)} - {"role"}
    unknown = sorted(set(both) - fields - set(ADAPTER_KEYS) - set(IGNORED))
    if unknown:
        raise KVABIError(f"pd.{unknown[0]}: not a P/D option (known: "
                         f"{', '.join(sorted(fields | set(ADAPTER_KEYS)))})")
    settings = PDSettings(role=ROLES[role], **{k: v for k, v in both.items() if k in fields})
    engine_id = both.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id.isidentifier()
                                  or len(engine_id) > 32):
        raise KVABIError(f"pd.engine_id: must be a name of letters, digits and _ (at most 32), "
                         f"got {engine_id!r:.60}")
    mml = both.get("max_model_len")
    policy = both.get("kv_load_failure_policy", "fail")
    if policy not in POLICIES:
        raise KVABIError(f"pd.kv_load_failure_policy: must be one of {POLICIES}, got "
                         f"{policy!r:.60}")
    return PDOptions(settings, engine_id,
                     None if mml is None else as_int(mml, "pd.max_model_len", lo=1), policy)


__all__ = ["PDOptions", "pd_options"]
