"""An engine's P/D settings (``specs/pd.md`` section 11): its role and the bounds on what
requests and peers may make it hold, checked once where they enter."""
from __future__ import annotations

import attrs

from ..util.coerce import as_float, as_int
from ..util.errors import KVABIError

ROLES = ("producer", "consumer", "both", "none")
#: the bounds and their defaults (specs/pd.md section 11)
DEFAULTS = {"pull_timeout_s": 30.0, "hold_timeout_s": 120.0, "max_held": 256,
            "max_pulls": 64, "pull_threads": 4, "max_peers": 16, "host_blocks": 0}


def _bound(name: str):
    lo = 0 if name == "host_blocks" else 1
    check = (lambda v: as_float(v, name, positive=True)) if name.endswith("_s") else \
        (lambda v: as_int(v, name, lo=lo))
    return attrs.field(default=DEFAULTS[name], converter=check)


@attrs.frozen
class PDSettings:
    """``role``: ``producer`` serves its prompts' KV, ``consumer`` pulls prompts' KV,
    ``both`` does both, ``none`` neither (a host tier alone); the bounds of the spec;
    ``nixl_host`` where this engine's NIXL agent listens; ``model_id`` the model's
    identity its handshakes state (a peer serving another model refuses)."""

    role: str = attrs.field(default="both")
    pull_timeout_s: float = _bound("pull_timeout_s")
    hold_timeout_s: float = _bound("hold_timeout_s")
    max_held: int = _bound("max_held")
    max_pulls: int = _bound("max_pulls")
    pull_threads: int = _bound("pull_threads")
    max_peers: int = _bound("max_peers")
    host_blocks: int = _bound("host_blocks")
    nixl_host: str = attrs.field(default="127.0.0.1")
    model_id: str | None = attrs.field(default=None)

    @role.validator
    def _role(self, _a, v):
        if v not in ROLES:
            raise KVABIError(f"role: must be one of {ROLES}, got {v!r:.60}")

    @nixl_host.validator
    def _host(self, _a, v):
        if not isinstance(v, str) or not v:
            raise KVABIError(f"nixl_host: must be a host name or address, got {v!r:.60}")

    @model_id.validator
    def _model(self, _a, v):
        if v is not None:
            from ..transfer.handshake import check_model

            check_model(v, "model_id")

    @property
    def producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumer(self) -> bool:
        return self.role in ("consumer", "both")


__all__ = ["DEFAULTS", "PDSettings", "ROLES"]
