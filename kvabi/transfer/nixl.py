"""Moving KV between processes on NIXL (optional: ``pip install 'kvabi[nixl]'``).

One :class:`NixlAgent` per process.  The serving side registers its cache and hands out
:meth:`NixlAgent.handshake` (``specs/transfer.md``); the receiving side registers its own
cache, :meth:`~NixlAgent.connect`\\ s with the peer's message (validated as untrusted input),
and :meth:`~NixlAgent.pull`\\ s tokens with one NIXL READ whose regions come from a copy
plan between the two layouts, bounds-checked against the peer's registered planes before
anything is posted.  A relayout is pulled *staged* (:mod:`kvabi.transfer.staging`): the
peer's bytes in its own byte order, as a few large descriptors, into a staging buffer the
agent registers once, then relayouted locally.  The READ carries a notification, so the
serving side learns when its blocks may be reused (:meth:`~NixlAgent.wait_notification`).

Planes in host memory register as DRAM; CUDA tensors as VRAM (same code, other memory
type); jax CPU arrays register their own buffer, without a copy.  nixl is imported when an agent is made, never at ``import kvabi``.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..memory.cache import KVCache
from ..model.shard import shard_of
from ..util.coerce import as_bool, as_float
from ..util.errors import KVABIError
from ..util.tensors import framework
from .checksum import check_checksums, kv_checksums, peer_sums
from .execute import check_in_use, copy_from_staging
from .handshake import (Handshake, check_agent_name, check_host, check_port, make_handshake,
                        parse_handshake)
from .kv_scales import check_same_scales
from .nixl_progress import create_agent
from .pattern import plane_sizes
from .plan import TransferPlan, plan_transfer
from .shards import ShardPlan, plan_shard_transfer
from .staging import ALIGN, block_staging_limit, small_regions, stage, stage_blocks, staging_pays

log = logging.getLogger(__name__)

INSTALL_HINT = "nixl is not installed: pip install 'kvabi[nixl]'"
#: staging buffers an agent keeps for READs it could not stop (memory stays bounded)
MAX_RETIRED = 64


def nixl_api():
    """nixl's agent classes, or KVABIError with the install hint."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        raise KVABIError(INSTALL_HINT) from None
    if "NIXL_LOG_LEVEL" not in os.environ:  # nixl logs every agent at INFO to stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def available() -> tuple[bool, str]:
    """(True, "") when nixl can be imported, else (False, why)."""
    try:
        nixl_api()
    except KVABIError as e:
        return False, str(e)
    return True, ""


#: agents created on a port picked for them before giving up when each was taken meanwhile
BIND_TRIES = 5


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for tests and examples)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _memory_of(plane) -> tuple[int, str, int]:
    """(address, memory type, device id) of a numpy array, torch tensor or jax CPU array
    (its buffer, no copy: jax exposes it through ``unsafe_buffer_pointer``)."""
    if isinstance(plane, np.ndarray):
        return plane.__array_interface__["data"][0], "DRAM", 0
    fw = framework(plane)
    if fw == "torch":
        if plane.device.type == "cuda":
            return plane.data_ptr(), "VRAM", plane.device.index or 0
        if plane.device.type == "cpu":
            return plane.data_ptr(), "DRAM", 0
    if fw == "jax":
        devs = plane.devices()
        if plane.is_deleted():
            raise KVABIError("cache: a jax plane has been deleted (donated?)")
        if len(devs) == 1 and next(iter(devs)).platform == "cpu":
            return plane.unsafe_buffer_pointer(), "DRAM", 0
        raise KVABIError(f"cache: NIXL registers jax arrays on one CPU device, got one on "
                         f"{sorted(str(d) for d in devs)} (copy it to host planes first)")
    raise KVABIError(f"cache: NIXL registers numpy arrays, torch CPU/CUDA tensors and jax "
                     f"CPU arrays, got {type(plane).__name__}")


#: NIXL's serialized agent metadata opens with its serializer's tag, then the agent's name
#: as a field: ``|Agent``, an 8-byte little-endian length, the name bytes
_MD_HEADER = b"nixlSerDes|Agent"


def metadata_agent_name(metadata: bytes) -> str:
    """The agent name NIXL metadata describes, read from its header without loading it;
    KVABIError when ``metadata`` does not open as NIXL agent metadata."""
    n0 = len(_MD_HEADER)
    n = int.from_bytes(metadata[n0:n0 + 8], "little") if len(metadata) >= n0 + 8 else -1
    if not metadata.startswith(_MD_HEADER) or not 0 < n <= len(metadata) - n0 - 8:
        raise KVABIError("metadata: not NIXL agent metadata")
    try:
        return metadata[n0 + 8:n0 + 8 + n].decode()
    except UnicodeDecodeError:
        raise KVABIError("metadata: not NIXL agent metadata") from None


def _message(v, field: str) -> bytes:
    """A notification (or its prefix) as bytes: bytes, or str encoded as UTF-8."""
    if isinstance(v, str):
        return v.encode()
    if not isinstance(v, bytes):
        raise KVABIError(f"{field}: must be bytes (or str), got {type(v).__name__}")
    return v


@attrs.frozen(eq=False, repr=False)
class Peer:
    """A connected peer: its validated handshake (and through it the NIXL agent name and
    layout).  Frozen, like the handshake it holds: :meth:`NixlAgent.pull_plan` trusts a
    peer it connected by identity, so nothing it checked can be rebound afterwards
    (``specs/security.md`` section 2.5)."""

    handshake: Handshake = attrs.field()

    @handshake.validator
    def _check(self, _attribute, value):
        if not isinstance(value, Handshake):
            raise KVABIError(f"handshake: must be a Handshake (from parse_handshake), got "
                             f"{type(value).__name__}")

    @property
    def name(self) -> str:
        return self.handshake.agent_name

    @property
    def layout(self) -> Layout:
        return self.handshake.layout

    def __repr__(self) -> str:
        h = self.handshake
        return (f"Peer({self.name} at {h.host}:{h.port}, {h.memory}, "
                f"{self.layout.name or 'custom'} x {len(h.planes)} planes)")


@attrs.frozen(eq=False)
class _Read:
    """One prepared READ from ``peer``: ``local``/``remote`` rows (address, nbytes, device);
    direct (``staging`` None: local rows are ``dst``'s addresses in ``memory``) or staged
    (local rows are offsets into ``staging`` bytes of the staging buffer, and ``finish(buf,
    dst)`` relayouts them into ``dst``, returning it)."""

    peer: "Peer"
    local: np.ndarray
    remote: np.ndarray
    staging: "int | None"
    finish: object
    memory: str = "DRAM"


def _guarded_staged(staged, guard):
    """``staged`` as a pull with ``guard`` needs it: staged (its READ must not land in
    ``dst``); KVABIError when asked unstaged."""
    if staged is not None:  # "false" is not False: refused by name, never read as true
        staged = as_bool(staged, "staged")
    if guard is None:
        return staged
    if not (hasattr(guard, "__enter__") and hasattr(guard, "__exit__")):  # before any READ
        raise KVABIError(f"guard: must be a context manager, got {type(guard).__name__}")
    if staged is False:
        raise KVABIError("staged: a guarded pull is staged (its READ must not land in dst)")
    return True


class NixlAgent:
    """This process's NIXL agent (UCX backend), listening on ``host:port`` for metadata
    requests (``port`` None: a free port)."""

    def __init__(self, name: str, *, host: str = "127.0.0.1", port: int | None = None,
                 backends=("UCX",)):
        # what this agent's handshakes will carry: a peer would refuse anything else
        name, host = check_agent_name(name, "name"), check_host(host, "host")
        port = None if port is None else check_port(port, "port")
        agent_cls, config_cls = nixl_api()
        self.name, self.host = name, host
        # A free port is free when picked, not when NIXL binds it: another process
        # starting at the same time may take it first.  A port of our own picking is picked
        # again then; a port the caller gave is the caller's to fix.
        for attempt in range(1 if port is not None else BIND_TRIES):
            self.port = free_port(host) if port is None else port
            cfg = config_cls(enable_prog_thread=True, enable_listen_thread=True,
                             listen_port=self.port, backends=list(backends))
            try:
                self._agent = create_agent(agent_cls, name, cfg)
                break
            except Exception as e:  # noqa: BLE001 - nixl raises plain exceptions
                if (port is None and attempt + 1 < BIND_TRIES
                        and "bind" in str(e).lower()):
                    continue
                raise KVABIError(f"nixl: could not create agent {name!r} listening on "
                                 f"{host}:{self.port}: {e}") from None
        self._regs = []  # (cache, descs, rows [n, 3] address/nbytes/device, memory)
        # staging buffers of staged pulls, per (memory type, device, thread): (buffer,
        # descs); threads pulling at once never share one
        self._staging: dict = {}
        # staging buffers a READ that could not be stopped may still write: kept alive
        # (and registered) until close, never reused
        self._retired: list = []
        # templates of staged whole-block pulls (see staging.stage_blocks)
        self._templates: list = []
        # agent name -> the peers (one per handshake, i.e. per served cache) it stands for
        self._peers: dict[str, list[Peer]] = {}

    # -- local memory ------------------------------------------------------------------
    def register(self, cache: KVCache) -> KVCache:
        """Register every plane of ``cache`` (its ``plane_nbytes`` bytes) with NIXL.

        jax CPU caches register without a copy (a peer may READ them); keep the arrays
        alive and undonated while registered.  jax arrays are immutable, so a pull into
        a jax cache goes through the staging buffer and returns a new handle (a jax
        destination need not be registered)."""
        if not isinstance(cache, KVCache):
            raise KVABIError(f"cache: must be a KVCache, got {type(cache).__name__}")
        mems = [_memory_of(p) for p in cache]
        types = {m for _, m, _ in mems}
        if len(types) != 1:
            raise KVABIError(f"cache: planes mix memory types {sorted(types)}")
        mem = types.pop()
        sizes = cache.layout.plane_sizes  # a component layout's planes may differ in size
        rows = np.array([(a, n, d) for (a, _, d), n in zip(mems, sizes)],
                        np.int64).reshape(-1, 3)
        try:
            descs = self._agent.register_memory(
                [(int(a), int(n), int(d), "") for a, n, d in rows], mem)
        except Exception as e:  # noqa: BLE001
            raise KVABIError(f"nixl: registering {len(rows)} {mem} planes failed: {e}") from None
        self._regs.append((cache, descs, rows, mem))
        return cache

    def deregister(self, cache: KVCache) -> None:
        """Release ``cache``'s registration (peers must not read it afterwards)."""
        reg = self._registration(cache)
        self._regs.remove(reg)
        try:
            self._agent.deregister_memory(reg[1])
        except Exception as e:  # noqa: BLE001
            raise KVABIError(f"nixl: deregistering failed: {e}") from None

    def _registration(self, cache: KVCache):
        reg = self._find(cache)
        if reg is None:
            raise KVABIError("cache: not registered with this agent (call register(cache) "
                             "first)")
        return reg

    def _find(self, cache: KVCache):
        for reg in self._regs:
            if reg[0] is cache:
                return reg
        return None

    def handshake(self, cache: KVCache, *, include_metadata: bool = False,
                  model: str | None = None, kv_scales=None) -> str:
        """The JSON handshake message describing registered ``cache`` to a peer (its layout,
        with the shard of the model's heads it holds, and the layout's fingerprint); with
        ``include_metadata`` it also carries this agent's NIXL metadata, so the peer needs
        no round trip to the listen address; ``model``: the model's identity, which a peer
        serving another model refuses (:func:`~kvabi.transfer.negotiate`); ``kv_scales``:
        per layer ``(k_scale, v_scale)`` of a per-tensor quantized cache (the puller
        compares them with its own, :func:`kvabi.transfer.kv_scales.check_same_scales`)."""
        _, _, rows, mem = self._registration(cache)
        include_metadata = as_bool(include_metadata, "include_metadata")
        meta = self._agent.get_agent_metadata() if include_metadata else None
        return make_handshake(agent_name=self.name, host=self.host, port=self.port,
                              memory=mem, layout=cache.layout, planes=rows.tolist(),
                              metadata=meta, model=model, kv_scales=kv_scales)

    # -- peers ---------------------------------------------------------------------------
    def connect(self, message, *, timeout: float = 10.0) -> Peer:
        """Validate a peer's handshake (untrusted) and fetch its NIXL metadata from its
        listen address; KVABIError when the message is malformed or the peer does not
        answer within ``timeout`` seconds.

        A refused message changes nothing: the metadata of an agent connected earlier is
        replaced only by metadata of that agent that NIXL loaded (NIXL updates a known
        agent's metadata in place, and keeps it when a fetch or a load fails), never
        removed first."""
        timeout = as_float(timeout, "timeout", positive=True)
        h = parse_handshake(message)
        if h.agent_name == self.name:
            raise KVABIError(f"agent.name: the peer has this agent's own name {self.name!r}")
        ag = self._agent
        try:
            known = h.agent_name in self._peers or ag.check_remote_metadata(h.agent_name)
            if h.metadata is not None:
                named = metadata_agent_name(h.metadata)
                if named != h.agent_name:  # refused before NIXL loads (or replaces) anything
                    raise KVABIError(f"metadata: describes agent {named!r}, the message "
                                     f"names {h.agent_name!r}")
                got = ag.add_remote_agent(h.metadata)
                got = got.decode() if isinstance(got, bytes) else got
                if got != h.agent_name:  # NIXL read the name otherwise: undo what it loaded
                    if got not in self._peers:
                        ag.remove_remote_agent(got)
                    raise KVABIError(f"metadata: describes agent {got!r}, the message names "
                                     f"{h.agent_name!r}")
            else:
                ag.fetch_remote_metadata(h.agent_name, h.host, h.port)
                # A known agent already has metadata: wait for metadata holding the planes
                # this message names (the fresh answer, where they are new).
                descs = (ag.get_xfer_descs(h.planes.astype(np.uint64), h.memory),) \
                    if known else ()
                deadline = time.monotonic() + timeout
                while not ag.check_remote_metadata(h.agent_name, *descs):
                    if time.monotonic() > deadline:
                        raise KVABIError(f"peer: agent {h.agent_name!r} at {h.host}:{h.port} "
                                         f"did not answer within {timeout:g} s with metadata "
                                         "of the planes in its message (unreachable?)")
                    time.sleep(0.005)
        except KVABIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise KVABIError(f"peer: connecting to {h.agent_name!r} at {h.host}:{h.port} "
                             f"failed: {e}") from None
        peer = Peer(h)
        self._peers.setdefault(peer.name, []).append(peer)
        return peer

    def disconnect(self, peer: Peer) -> None:
        """Forget a peer :meth:`connect` returned (its agent's metadata too, once no other
        peer of that agent is left); a caller that caches peers keeps this table bounded."""
        self._connected(peer)
        held = self._peers[peer.name]
        held[:] = [p for p in held if p is not peer]
        if not held:
            del self._peers[peer.name]
            try:
                self._agent.remove_remote_agent(peer.name)
            except Exception:  # noqa: BLE001 - already gone
                pass

    # -- transfers -------------------------------------------------------------------------
    def _connected(self, peer) -> None:
        """KVABIError unless ``peer`` is a Peer this agent's connect() returned (trusted by
        identity: it is frozen)."""
        if not isinstance(peer, Peer) or not any(p is peer for p in self._peers.get(
                peer.name, ())):
            raise KVABIError("peer: not connected to this agent (use connect(message))")

    def pull(self, peer: Peer, dst: KVCache, src_slots, dst_slots, *, layers=None,
             timeout: float = 30.0, notify: bytes = b"kvabi.pull", staged=None,
             guard=None) -> KVCache:
        """READ the peer's tokens ``src_slots`` into ``dst_slots`` of ``dst`` (layouts may
        differ: the plan relayouts).  Returns ``dst`` once every byte has arrived (a new
        handle for jax); KVABIError if the transfer fails or times out (the destination
        slots then hold undefined data and must not be used).  ``staged``, ``guard``: see
        :meth:`pull_plan`."""
        self._connected(peer)
        if not isinstance(dst, KVCache):
            raise KVABIError(f"dst: must be a KVCache, got {type(dst).__name__}")
        plan = plan_transfer(peer.layout, dst.layout, src_slots, dst_slots, layers=layers)
        return self.pull_plan(peer, plan, dst, timeout=timeout, notify=notify, staged=staged,
                              guard=guard)

    def pull_plan(self, peer: Peer, plan: TransferPlan, dst: KVCache, *,
                  timeout: float = 30.0, notify: bytes = b"kvabi.pull",
                  staged=None, guard=None) -> KVCache:
        """Run ``plan`` (source: the peer's layout) as one NIXL READ into ``dst``.

        ``staged`` (default: when the plan's regions average under 64 KiB, as in a
        relayout): READ the source bytes in the peer's own byte order, as few large
        descriptors, into a staging buffer this agent registers once and reuses, then
        relayout locally (:mod:`kvabi.transfer.staging`).  Unstaged, the READ lands in
        ``dst`` directly, which must then be registered.  Every region is checked
        against the peer's registered planes and ``dst``'s (registered) planes at each
        call, before anything is posted.

        ``guard`` (a context manager; implies ``staged``) is entered once the READ has
        completed and held while the bytes are copied into ``dst``: a caller that gives up
        on a pull (a timeout) makes its ``__enter__`` raise, and no byte reaches ``dst``
        after that, whenever the READ completes."""
        timeout = as_float(timeout, "timeout", positive=True)
        notify = _message(notify, "notify")
        self._connected(peer)
        if not isinstance(plan, TransferPlan):
            raise KVABIError(f"plan: must be a TransferPlan, got {type(plan).__name__}")
        if not isinstance(dst, KVCache):
            raise KVABIError(f"dst: must be a KVCache, got {type(dst).__name__}")
        staged = _guarded_staged(staged, guard)
        read = self._prepare(peer, plan, dst, staged)
        return self._run_reads([read], dst, timeout, [notify], guard)

    def pull_shards(self, peers, dst: KVCache, src_slots, dst_slots, *, layers=None,
                    timeout: float = 30.0, notify: bytes = b"kvabi.pull", staged=None,
                    checksums=None, standard: bool = True, kv_scales=None) -> KVCache:
        """READ this rank's heads of tokens ``src_slots`` from the ranks of a
        tensor-parallel peer (``peers``: the connected :class:`Peer` of each of its ranks,
        in rank order) into ``dst_slots`` of ``dst`` (whose layout states this rank's
        shard), planned by :func:`~kvabi.transfer.plan_shard_transfer` (refusals by
        field before anything is posted) and run by :meth:`pull_shard_plan`.

        ``checksums``: per peer rank the :class:`~kvabi.transfer.checksum.KVChecksums` it
        computed over ``src_slots`` (``layers``); the received tokens are summed through
        ``dst``'s layout and compared for the heads read from each rank, and a mismatch
        raises KVABIError naming the head and tokens (the slots must then not be used).

        ``kv_scales``: per layer ``(k_scale, v_scale)`` this cache's codes are read with
        (a per-tensor quantized cache; None: unscaled), compared with every rank's
        handshake ``kv_scales`` before any byte moves (:meth:`pull_shard_plan`)."""
        self._peer_list(peers)
        if not isinstance(dst, KVCache):
            raise KVABIError(f"dst: must be a KVCache, got {type(dst).__name__}")
        plan = plan_shard_transfer([p.layout for p in peers], dst.layout, src_slots,
                                   dst_slots, layers=layers, standard=standard)
        if checksums is not None:  # every argument checked before any READ
            if not isinstance(checksums, (list, tuple)) or len(checksums) != len(peers):
                raise KVABIError(f"checksums: one per peer rank ({len(peers)}), got "
                                 f"{type(checksums).__name__}")
            checksums = peer_sums(checksums, plan.runs, dst.layout, dst_slots, layers)
        dst = self.pull_shard_plan(peers, plan, dst, timeout=timeout, notify=notify,
                                   staged=staged, kv_scales=kv_scales)
        if checksums is not None and plan.runs:
            got = kv_checksums(dst, dst_slots, layers=layers,
                               chunk=checksums[plan.runs[0].source].chunk)
            for run in plan.runs:
                heads = shard_of(dst.layout).heads[run.dst_first:run.dst_first + run.count]
                check_checksums(got, checksums[run.source], heads,
                                f"rank {run.source} ({peers[run.source].name!r})")
        return dst

    def pull_shard_plan(self, peers, plan: ShardPlan, dst: KVCache, *,
                        timeout: float = 30.0, notify: bytes = b"kvabi.pull",
                        staged=None, guard=None, kv_scales=None) -> KVCache:
        """Run a :class:`~kvabi.transfer.shards.ShardPlan`: one READ per peer rank read
        (each checked and laid out as by :meth:`pull_plan`), all posted before any is
        waited for, all within ``timeout``; each rank read gets ``notify`` with its READ,
        each rank not read (a replica another destination reads) gets it as a plain
        notification, so every rank of the group learns that this rank is done (one that
        cannot be told is logged: it holds no byte this pull needs).  Returns
        ``dst`` once every byte has arrived (a new handle for jax); KVABIError if any READ
        fails or times out (the destination slots then hold undefined data).  ``staged``,
        ``guard``: see :meth:`pull_plan` (the guard is held while each rank's bytes are
        copied into ``dst``).

        ``kv_scales``: per layer ``(k_scale, v_scale)`` this cache's codes are read with (a
        per-tensor quantized cache; None: unscaled).  Before any READ is posted, every
        rank's handshake ``kv_scales`` must be exactly these (the same codes under other
        scales are other values); KVABIError naming the rank, layer and scale otherwise
        (``peers[1].kv_scales[3].v_scale: ...``), or where one side is scaled and the
        other is not (:func:`~kvabi.transfer.kv_scales.check_same_scales`)."""
        timeout = as_float(timeout, "timeout", positive=True)
        notify = _message(notify, "notify")
        self._peer_list(peers)
        for i, p in enumerate(peers):  # every rank: replicas not read must agree too
            check_same_scales(kv_scales, p.handshake.kv_scales, f"peers[{i}].kv_scales")
        if not isinstance(plan, ShardPlan):
            raise KVABIError(f"plan: must be a ShardPlan, got {type(plan).__name__}")
        if len(plan.src_layouts) != len(peers) or any(
                p.layout != lay for p, lay in zip(peers, plan.src_layouts)):
            raise KVABIError("plan.src_layouts: are not the peers' layouts, in rank order")
        if not isinstance(dst, KVCache):
            raise KVABIError(f"dst: must be a KVCache, got {type(dst).__name__}")
        staged = _guarded_staged(staged, guard)
        reads = [self._prepare(peers[i], part, dst, staged) for i, part in plan.parts]
        dst = self._run_reads(reads, dst, timeout, [notify] * len(reads), guard)
        read = set(plan.sources)
        for i, p in enumerate(peers):
            if i not in read:
                try:
                    self.notify(p, notify)
                except KVABIError as e:  # the bytes are here: not a failure
                    log.warning("kvabi.transfer.nixl: the notification to %r (rank %d, not "
                                "read) failed: %s", p.name, i, e)
        return dst

    def descriptors(self, peers, plan, dst: KVCache, *, staged=None) -> int:
        """How many descriptors a pull of ``plan`` into ``dst`` would post (nothing is
        posted): a TransferPlan from one connected peer (as :meth:`pull_plan`), or a
        ShardPlan from the connected peers of its ranks in rank order (as
        :meth:`pull_shard_plan`); checked and laid out as those do, staged or direct by
        the same choice."""
        if isinstance(plan, ShardPlan):
            self._peer_list(peers)
            if len(plan.src_layouts) != len(peers):
                raise KVABIError("plan.src_layouts: are not the peers' layouts, in rank order")
            parts = [(peers[i], part) for i, part in plan.parts]
        elif isinstance(plan, TransferPlan):
            self._connected(peers)
            parts = [(peers, plan)]
        else:
            raise KVABIError(f"plan: must be a TransferPlan or ShardPlan, got "
                             f"{type(plan).__name__}")
        if not isinstance(dst, KVCache):
            raise KVABIError(f"dst: must be a KVCache, got {type(dst).__name__}")
        return sum(len(self._prepare(p, part, dst, staged).remote) for p, part in parts)

    def notify(self, peer, message) -> None:
        """Send ``message`` (bytes, or str as UTF-8) to connected ``peer`` as a plain
        notification, without a READ: what its :meth:`drain_notifications` returns (e.g.
        telling a serving rank that this side gave up on a pull).  KVABIError when it
        cannot be sent."""
        if not isinstance(peer, Peer):
            raise KVABIError(f"peer: must be a connected Peer, got {type(peer).__name__}")
        message = _message(message, "message")
        try:
            self._agent.send_notif(peer.name, message)
        except Exception as e:  # noqa: BLE001 - NIXL's own errors
            raise KVABIError(f"nixl: notifying {peer.name!r} failed: {e}") from None

    def _peer_list(self, peers) -> None:
        if isinstance(peers, Peer) or not isinstance(peers, (list, tuple)) or not peers:
            raise KVABIError(f"peers: must be a list of connected Peers, one per rank of the "
                             f"peer, got {type(peers).__name__}")
        for p in peers:
            self._connected(p)

    def _prepare(self, peer: Peer, plan: TransferPlan, dst: KVCache, staged) -> "_Read":
        """Check ``plan`` against the peer's registered planes and ``dst``'s, and lay out
        its READ (direct into ``dst``, or into the staging buffer and relayouted after)."""
        if plan.src_layout != peer.layout:
            raise KVABIError("plan.src_layout: is not the peer's layout")
        if plan.dst_layout != dst.layout:
            raise KVABIError("plan.dst_layout: is not the destination cache's layout")
        reg = self._find(dst)
        if staged is None:  # decided below from the plan, unless dst cannot take a READ
            staged = True if reg is None or dst.framework == "jax" else None
        elif as_bool(staged, "staged") is False and (reg is None or dst.framework == "jax"):
            raise KVABIError("staged: an unstaged pull READs into dst, which must be a "
                             "registered numpy or torch cache")
        check_in_use(None, dst)
        h = peer.handshake
        # Every region inside the peer's registered planes and ours, before posting.
        plan.check(src_nbytes=h.plane_nbytes, dst_nbytes=None if reg is None else reg[2][:, 1])
        if plan.pattern is None and not len(plan):  # (a whole-block plan moves blocks)
            return _Read(peer, np.zeros((0, 3), np.int64), np.zeros((0, 3), np.int64), 0,
                         None)
        # A whole-block plan's regions are built only for a direct READ: a staged one goes
        # by its pattern (counted before merging meanwhile: at least the regions there are).
        if staged is None and not small_regions(plan.max_regions, plan.nbytes):
            staged = False  # large regions: direct (staging cannot save descriptors)
        if staged is not False:
            read = self._prepare_staged(peer, plan, dst)
            if staged or staging_pays(plan.max_regions, len(read.remote),
                                      int(read.remote[:, 1].sum())):
                return read
        r = plan.regions
        _, _, rows, mem = reg
        local = np.stack([rows[r[:, 2], 0] + r[:, 3], r[:, 4], rows[r[:, 2], 2]], axis=1)
        remote = np.stack([h.planes[r[:, 0], 0] + r[:, 1], r[:, 4], h.planes[r[:, 0], 2]],
                          axis=1)
        return _Read(peer, local, remote, None, None, mem)

    def _prepare_staged(self, peer: Peer, plan: TransferPlan, dst: KVCache) -> "_Read":
        """The staged READ of a checked, non-empty ``plan``: the source blocks it touches
        (whole-block plans, :meth:`_prepare_blocks`), else its spans."""
        if plan.pattern is not None:
            read = self._prepare_blocks(peer, plan, dst)
            if read is not None:
                return read
        h = peer.handshake
        st = stage(plan.regions)
        sp = st.spans
        local = np.stack([st.at, sp[:, 2], np.zeros(len(st.at), np.int64)], axis=1)
        remote = np.stack([h.planes[sp[:, 0], 0] + sp[:, 1], sp[:, 2],
                           h.planes[sp[:, 0], 2]], axis=1)
        return _Read(peer, local, remote, st.nbytes, lambda buf, d: copy_from_staging(
            [buf], st.local, None, None, d, d))

    def _prepare_blocks(self, peer: Peer, plan: TransferPlan, dst: KVCache):
        """A staged READ of a whole-block plan (:func:`~kvabi.transfer.staging.stage_blocks`):
        the source blocks touched into the staging buffer, then strided copies into
        ``dst``.  None when the source layout cannot be cut down (the caller stages
        regions).  (Cutting it into chunks whose relayout overlaps the next chunk's READ was
        measured slower on a loaded 2-core machine: loopback transports copy inside the
        post.)"""
        h = peer.handshake
        piece = stage_blocks(plan.pattern, plan.src_layout, plan.dst_layout, self._templates,
                             most=block_staging_limit(plan.nbytes))
        if piece is None:
            return None
        lay, n = piece.layout, piece.layout.plane_nbytes
        ds = plane_sizes(lay)
        pr = piece.pull.check(src_nbytes=h.plane_nbytes, dst_nbytes=ds).regions
        piece.local.check(ds, plane_sizes(dst.layout), "plan.pattern")
        local = np.stack([pr[:, 2] * n + pr[:, 3], pr[:, 4], np.zeros(len(pr), np.int64)],
                         axis=1)
        remote = np.stack([h.planes[pr[:, 0], 0] + pr[:, 1], pr[:, 4], h.planes[pr[:, 0], 2]],
                          axis=1)

        def finish(buf, d):
            planes = [buf[i * n:(i + 1) * n] for i in range(lay.num_planes)]
            return copy_from_staging(planes, None, piece.local, lay, d, d)

        return _Read(peer, local, remote, piece.nbytes, finish)

    def _run_reads(self, reads, dst: KVCache, timeout: float, notify,
                   guard=None) -> KVCache:
        """Post every READ (staged ones at their place in one staging buffer), then wait for
        each in turn within ``timeout`` and relayout it into ``dst`` as soon as it is done
        (under ``guard``), while the later ones are still in flight; ``dst`` back (a new
        handle for jax).  On any failure every posted READ is released and the error
        raised: the destination slots then hold undefined data; a READ NIXL would not
        release may still land, so this thread's staging buffers are retired."""
        guard = contextlib.nullcontext() if guard is None else guard
        reads = [r for r in reads if len(r.local)]
        if not reads:
            return dst
        need = [0 if r.staging is None else -(-r.staging // ALIGN) * ALIGN for r in reads]
        bases = np.cumsum([0] + need)
        if bases[-1]:
            buf, addr, dev, smem = self._staging_buffer(int(bases[-1]), dst)
        handles = []
        deadline = time.monotonic() + timeout
        try:
            for r, base, msg in zip(reads, bases, notify):
                if r.staging is None:
                    local, mem = r.local, r.memory
                else:
                    local = r.local + np.array([addr + base, 0, dev], np.int64)
                    mem = smem
                handles.append((r, self._post(r.peer, local.astype(np.uint64), mem,
                                              r.remote.astype(np.uint64),
                                              r.peer.handshake.memory, msg)))
            for (r, handle), base in zip(handles, bases):
                self._wait(r.peer, handle, int(r.local[:, 1].sum()), deadline, timeout)
                if r.finish is not None:
                    with guard:
                        dst = r.finish(buf[int(base):int(base) + r.staging], dst)
        except BaseException:
            if not self._release([h for _, h in handles]):  # may still land: fresh staging
                ident = threading.get_ident()
                for key in [k for k in self._staging if k[2] == ident]:
                    self._retired.append(self._staging.pop(key))
            raise
        self._release([h for _, h in handles])
        return dst

    def _staging_buffer(self, nbytes: int, dst: KVCache):
        """This agent's registered staging buffer for ``dst``'s memory, at least ``nbytes``
        long (grown by doubling, registered once per size): (buffer, address, device id,
        memory type)."""
        cuda = dst.framework == "torch" and dst[0].device.type == "cuda"
        key = ("VRAM", dst[0].device.index or 0) if cuda else ("DRAM", 0)
        key += (threading.get_ident(),)
        if len(self._retired) > MAX_RETIRED:
            raise KVABIError(f"nixl: {len(self._retired)} staging buffers are held by READs "
                             "that could not be stopped; no more are made (close the agent)")
        held = self._staging.get(key)
        if held is None or held[0].shape[0] < nbytes:
            size = max(nbytes, 2 * held[0].shape[0] if held is not None else 0)
            if cuda:
                import torch

                buf = torch.empty(size, dtype=torch.uint8, device=dst[0].device)
                addr = buf.data_ptr()
            else:
                buf = np.empty(size, np.uint8)
                addr = buf.__array_interface__["data"][0]
            try:
                descs = self._agent.register_memory([(addr, size, key[1], "")], key[0])
            except Exception as e:  # noqa: BLE001
                raise KVABIError(f"nixl: registering a {size}-byte staging buffer failed: "
                                 f"{e}") from None
            if held is not None:  # kept: an abandoned READ may still land in it
                self._retired.append(self._staging.pop(key))
            held = self._staging[key] = (buf, descs)
        buf = held[0]
        addr = buf.data_ptr() if cuda else buf.__array_interface__["data"][0]
        return buf, addr, key[1], key[0]

    def _post(self, peer, local, local_mem, remote, remote_mem, notify):
        """Post one READ; its handle (release with :meth:`_release`)."""
        ag = self._agent
        handle = None
        try:
            ldescs = ag.get_xfer_descs(local, local_mem)
            rdescs = ag.get_xfer_descs(remote, remote_mem)
            handle = ag.initialize_xfer("READ", ldescs, rdescs, peer.name, notify)
            if ag.transfer(handle) == "ERR":
                raise KVABIError(f"transfer: NIXL reported ERR reading from {peer.name!r}; "
                                 "the destination slots hold undefined data")
            return handle
        except Exception as e:  # noqa: BLE001
            if handle is not None:
                self._release([handle])
            if isinstance(e, KVABIError):
                raise
            raise KVABIError(f"transfer: READ from {peer.name!r} failed: {e}; the destination "
                             "slots hold undefined data") from None

    def _wait(self, peer, handle, nbytes: int, deadline: float, timeout: float) -> None:
        """Until the READ of ``handle`` is done; KVABIError when it fails or runs past
        ``deadline``."""
        ag = self._agent
        try:
            state = ag.check_xfer_state(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise KVABIError(f"transfer: READ of {nbytes} bytes from {peer.name!r} did "
                                     f"not finish within {timeout:g} s; the destination slots "
                                     "hold undefined data")
                time.sleep(0.0002)
                state = ag.check_xfer_state(handle)
            if state != "DONE":
                raise KVABIError(f"transfer: NIXL reported {state} reading from {peer.name!r}; "
                                 "the destination slots hold undefined data")
        except KVABIError:
            raise
        except Exception as e:  # noqa: BLE001
            raise KVABIError(f"transfer: READ from {peer.name!r} failed: {e}; the destination "
                             "slots hold undefined data") from None

    def _release(self, handles) -> bool:
        """Release transfer handles; False when NIXL refused one (still active)."""
        ok = True
        for handle in handles:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:  # noqa: BLE001 - an active transfer may refuse release
                ok = False
        return ok

    def wait_notification(self, prefix: bytes = b"kvabi.pull", *, timeout: float = 30.0,
                          peer: str | None = None) -> tuple[str, bytes]:
        """Block until a notification starting with ``prefix`` arrives (from ``peer`` if
        given); returns (sender, message).  KVABIError after ``timeout`` seconds."""
        timeout = as_float(timeout, "timeout", positive=True)
        prefix = _message(prefix, "prefix")
        deadline = time.monotonic() + timeout
        while True:
            for sender, msgs in self._agent.update_notifs().items():
                if peer is not None and sender != peer:
                    continue
                for m in msgs:
                    if m.startswith(prefix):
                        msgs.remove(m)
                        return sender, m
            if time.monotonic() > deadline:
                raise KVABIError(f"notification: none starting with {prefix!r} within "
                                 f"{timeout:g} s")
            time.sleep(0.001)

    def drain_notifications(self) -> list[tuple[str, bytes]]:
        """Every notification that arrived and was not taken yet, as (sender, message),
        removed from the agent (a server polling for its own kind of message calls this,
        so that other messages from any peer cannot pile up)."""
        out = []
        for sender, msgs in self._agent.update_notifs().items():
            out += [(sender, m) for m in msgs]
            msgs.clear()
        return out

    def close(self) -> None:
        """Forget peers and deregister memory (the agent itself goes with the object)."""
        for name in list(self._peers):
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001
                pass
        self._peers.clear()
        for _, descs, _, _ in self._regs:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                pass
        self._regs.clear()
        for _, descs in list(self._staging.values()) + self._retired:
            try:
                self._agent.deregister_memory(descs)
            except Exception:  # noqa: BLE001
                pass
        self._staging.clear()
        self._retired.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
