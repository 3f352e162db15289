"""The transfer handshake message (``specs/transfer.md``, ``specs/transfer.schema.json``).

A process that serves KV describes it in one JSON message: the ABI version, its transfer
agent's name and listen address (and optionally the agent's metadata), the memory type,
the layout descriptor (with the shard of the model's KV heads it holds), the layout's
fingerprint, optionally the model's identity, and the address and size of every registered
plane.  The receiver
treats the message as untrusted: :func:`parse_handshake` reads it with the strict JSON
reader, checks every field's type and range, validates the layout descriptor in full, and
checks that each plane holds at least the bytes the layout addresses and that the
fingerprint is the descriptor's own.  It accepts exactly what
``specs/transfer.schema.json`` accepts, plus the checks the schema cannot express (integers
written as ``4.0``, sizes against the layout, the text's size and nesting, base64): a test
validates one corpus of messages with both.  Parsing has no side effect.
"""
from __future__ import annotations

import base64
import json
import re

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..util.coerce import as_int, int_array
from ..util.errors import KVABIError
from ..util.frozen import frozen_array
from ..util.safe_json import loads
from ..util.version import WIRE_VERSION, wire_version
from .kv_scales import parse_kv_scales, scales_to_json

MESSAGE = "kvabi.transfer.handshake"
MEMORY_TYPES = ("DRAM", "VRAM")
#: size limit of a handshake's text (agent metadata is a few KiB; 4096 planes ~ 80 KiB)
MAX_HANDSHAKE_BYTES = 4 * 2**20
MAX_DEPTH = 8
MAX_PLANES = 4096
#: largest user-space address we accept (x86-64 and arm64 user space is below 2**57)
MAX_ADDRESS = 2**62
#: the first minor version of the handshake message (ABI 1.0 had none)
FIRST_MINOR = 1
#: the majors a reader of this version takes (2.0: the layout may hold components; a 1.x
#: message carries a 1.x descriptor, which the layout reader still takes)
READS = (1, WIRE_VERSION[0])
# matched whole (fullmatch): ``$`` would also match before a final "\n"
_NAME = re.compile(r"[A-Za-z0-9_.:@\-]{1,128}")
_HOST = re.compile(r"[A-Za-z0-9_.:\-\[\]]{1,255}")
#: a model's identity as a sender states it (a name, a revision, a digest of its config)
_MODEL = re.compile(r"[A-Za-z0-9_.:@/+=\-]{1,256}")
_FINGERPRINT = re.compile(r"kv[0-9]+:[0-9a-f]{32}")
_FIELDS = {"kvabi_abi", "message", "agent", "memory", "layout", "fingerprint", "planes"}
_OPTIONAL = {"metadata", "model", "kv_scales"}
_AGENT_FIELDS = ("host", "name", "port")
_PLANE_FIELDS = ("address", "device", "nbytes")


@attrs.frozen(eq=False)
class Handshake:
    """A validated handshake: ``planes`` is int64 [n, 3] of (address, nbytes, device)."""

    abi: tuple[int, int]
    agent_name: str
    host: str
    port: int
    memory: str
    layout: Layout
    planes: np.ndarray
    fingerprint: str
    metadata: bytes | None = None
    model: str | None = None
    #: per layer (k_scale, v_scale) of a per-tensor quantized cache, or None (unscaled)
    kv_scales: tuple | None = None

    @property
    def plane_nbytes(self) -> np.ndarray:
        return self.planes[:, 1]


def make_handshake(*, agent_name: str, host: str, port: int, memory: str, layout: Layout,
                   planes, metadata: bytes | None = None, model: str | None = None,
                   kv_scales=None) -> str:
    """The JSON message for planes ``[(address, nbytes, device), ...]`` of ``layout``;
    ``model``: the model's identity, which a peer of another model refuses; ``kv_scales``:
    per layer ``(k_scale, v_scale)`` of a per-tensor quantized cache
    (:mod:`kvabi.transfer.kv_scales`)."""
    msg = {
        "kvabi_abi": list(WIRE_VERSION),
        "message": MESSAGE,
        "agent": {"name": agent_name, "host": host, "port": int(port)},
        "memory": memory,
        "layout": layout.to_dict(),
        "fingerprint": layout.fingerprint(),
        "planes": _planes_json(planes),
    }
    if metadata is not None:
        msg["metadata"] = base64.b64encode(metadata).decode("ascii")
    if model is not None:
        msg["model"] = check_model(model, "model")
    if kv_scales is not None:
        msg["kv_scales"] = scales_to_json(kv_scales)
    text = json.dumps(msg, sort_keys=True)
    parse_handshake(text)  # what we send, we would accept
    return text


def _obj(v, field, keys, *, closed=False):
    """``v`` as a JSON object holding ``keys``; with ``closed``, holding no other key (a
    message of the reader's own or an older minor)."""
    if not isinstance(v, dict):
        raise KVABIError(f"{field}: must be a JSON object, got {type(v).__name__}")
    missing = sorted(set(keys) - set(v))
    if missing:
        raise KVABIError(f"{field}.{missing[0]}: missing")
    if closed:
        extra = sorted(set(v) - set(keys))
        if extra:
            raise KVABIError(f"{field}.{extra[0]}: unknown field in a message of ABI "
                             f"{WIRE_VERSION[0]}.{WIRE_VERSION[1]} or older")
    return v


def _str(v, field, pattern, what):
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise KVABIError(f"{field}: must be {what}, got {v!r:.80}")
    return v


def check_agent_name(v, field: str = "agent.name") -> str:
    """``v`` when it is an agent name a handshake may carry; else KVABIError."""
    return _str(v, field, _NAME, "1-128 characters of [A-Za-z0-9_.:@-]")


def check_host(v, field: str = "agent.host") -> str:
    """``v`` when it is a host a handshake may carry; else KVABIError."""
    return _str(v, field, _HOST, "a host name or IP address")


def check_model(v, field: str = "model") -> str:
    """``v`` when it is a model identity a handshake may carry; else KVABIError."""
    return _str(v, field, _MODEL, "1-256 characters of [A-Za-z0-9_.:@/+=-]")


def check_port(v, field: str = "agent.port") -> int:
    """``v`` as a TCP port 1..65535; else KVABIError."""
    return as_int(v, field, lo=1, hi=65535)


def _planes_json(planes) -> dict:
    """The compact ``planes`` object: every address; ``nbytes`` and ``device`` as one
    number when all planes share it (a 64-layer model's planes in ~1 KiB)."""
    rows = np.asarray([[int(a), int(n), int(d)] for a, n, d in planes],
                      np.int64).reshape(-1, 3)
    out = {"address": rows[:, 0].tolist()}
    for k, col in (("nbytes", 1), ("device", 2)):
        v = rows[:, col]
        out[k] = int(v[0]) if v.size and (v == v[0]).all() else v.tolist()
    return out


def _plane_ints(v, field: str, n: int, lo: int, hi: int) -> np.ndarray:
    """One integer per plane: a JSON integer for all, or a list of ``n``."""
    if isinstance(v, list):
        if len(v) != n:
            raise KVABIError(f"{field}: {len(v)} values for {n} planes")
        return int_array(v, field, lo=lo, hi=hi) if v else np.zeros(0, np.int64)
    return np.full(n, as_int(v, field, lo=lo, hi=hi), np.int64)


def _planes(p, layout: Layout, closed: bool) -> np.ndarray:
    """The checked planes of a message: int64 [n, 3] (address, nbytes, device), read-only."""
    _obj(p, "planes", _PLANE_FIELDS, closed=closed)
    addr = p["address"]
    if not isinstance(addr, list):
        raise KVABIError(f"planes.address: must be a list (one address per plane), got "
                         f"{type(addr).__name__}")
    n = len(addr)
    if n > MAX_PLANES:
        raise KVABIError(f"planes.address: {n} planes, more than {MAX_PLANES}")
    if n != layout.num_planes:
        raise KVABIError(f"planes.address: the layout has {layout.num_planes} planes, the "
                         f"message lists {n}")
    a = _plane_ints(addr, "planes.address", n, 1, MAX_ADDRESS)
    nb = _plane_ints(p["nbytes"], "planes.nbytes", n, 1, MAX_ADDRESS)
    dev = _plane_ints(p["device"], "planes.device", n, 0, 1 << 16)
    # component planes may differ in size: each is checked against its own
    need = (np.full(n, layout.plane_nbytes, np.int64) if layout.uniform_planes
            else np.asarray(layout.plane_sizes, np.int64))
    small = np.flatnonzero(nb < need)
    if small.size:
        i = int(small[0])
        raise KVABIError(f"planes.nbytes: plane {i} has {int(nb[i])} bytes registered, but "
                         f"the layout addresses {int(need[i])}")
    far = np.flatnonzero(a > MAX_ADDRESS - nb)  # a + nb > MAX_ADDRESS, without overflow
    if far.size:
        raise KVABIError(f"planes: plane {int(far[0])}'s address + nbytes passes "
                         f"{MAX_ADDRESS}")
    # Checked here and trusted by whoever holds the handshake: read-only over an immutable
    # buffer (kvabi.util.frozen), so that not even its writeable flag can be turned back on.
    return frozen_array(np.stack([a, nb, dev], axis=1).reshape(-1, 3))


def parse_handshake(text) -> Handshake:
    """Validate an untrusted handshake message (str or bytes); KVABIError names the field.

    Refuses a major version other than 1 and this one; a newer minor version's unknown
    fields are ignored, this version's (and every 1.x) messages must not carry any.
    """
    d = loads(text, what="handshake", max_bytes=MAX_HANDSHAKE_BYTES, max_depth=MAX_DEPTH)
    _obj(d, "handshake", ("kvabi_abi",))
    ver = wire_version(d["kvabi_abi"])
    if ver[0] not in READS:
        raise KVABIError(f"kvabi_abi: the peer speaks ABI {ver[0]}.{ver[1]}; this reader "
                         f"speaks {' and '.join(f'{m}.x' for m in READS)}")
    if ver[0] == 1 and ver[1] < FIRST_MINOR:
        raise KVABIError(f"kvabi_abi: the handshake message exists since ABI "
                         f"1.{FIRST_MINOR}, the peer says {ver[0]}.{ver[1]}")
    # A message of our own or an older minor holds only the fields we know, at every level;
    # a newer minor's unknown fields are ignored.
    closed = tuple(ver) <= WIRE_VERSION
    _obj(d, "handshake", sorted(_FIELDS))
    if closed:
        extra = sorted(set(d) - _FIELDS - _OPTIONAL)
        if extra:
            raise KVABIError(f"handshake.{extra[0]}: unknown field in an ABI "
                             f"{ver[0]}.{ver[1]} message")
    if not isinstance(d["message"], str) or d["message"] != MESSAGE:
        raise KVABIError(f"message: must be {MESSAGE!r}, got {d['message']!r:.80}")
    agent = _obj(d["agent"], "agent", _AGENT_FIELDS, closed=closed)
    name = check_agent_name(agent["name"])
    host = check_host(agent["host"])
    port = check_port(agent["port"])
    memory = d["memory"]
    if not isinstance(memory, str) or memory not in MEMORY_TYPES:
        raise KVABIError(f"memory: must be one of {', '.join(MEMORY_TYPES)}, got "
                         f"{memory!r:.80}")
    layout = Layout.from_json(_obj(d["layout"], "layout", ()))
    fp = _str(d["fingerprint"], "fingerprint", _FINGERPRINT, "a layout fingerprint "
              "(kvN: and 32 hex digits)")
    own = layout.fingerprint()
    if fp != own:
        raise KVABIError(f"fingerprint: the message says {fp}, its layout descriptor's is "
                         f"{own} (a label that does not match the bytes it names)")
    model = check_model(d["model"]) if "model" in d else None
    rows = _planes(d["planes"], layout, closed)
    meta = None
    if "metadata" in d:  # optional, but when present a string (null is not "absent")
        meta = d["metadata"]
        if not isinstance(meta, str):
            raise KVABIError(f"metadata: must be a base64 string, got {type(meta).__name__}")
        try:
            meta = base64.b64decode(meta.encode("ascii"), validate=True)
        except (ValueError, UnicodeEncodeError):
            raise KVABIError("metadata: not valid base64") from None
    scales = parse_kv_scales(d["kv_scales"], layout.num_layers) if "kv_scales" in d \
        else None
    return Handshake(abi=(ver[0], ver[1]), agent_name=name, host=host, port=port,
                     memory=memory, layout=layout, planes=rows, fingerprint=fp,
                     metadata=meta, model=model, kv_scales=scales)
