"""Two hosts on one machine: a pair of network namespaces joined by a veth pair, for moving
KV over NIXL as between two machines (UCX over TCP on the veth, no shared-memory transport).

``with VethPair() as pair:`` makes namespaces ``kvabi-<pid>-<n>a`` and ``...b``, a veth pair
between them with the private addresses ``10.77.<n>.1/30`` and ``.2`` (the only addresses
anything here talks to), and removes both namespaces (and with them the veth) on exit,
whatever happened, after stopping any process still inside them (only processes started
into these namespaces can be there).  Namespaces left by a process that died without
cleaning up (killed) are removed by the next pair made: their names carry the creating
process's id.

``pair.command(side, argv)`` runs ``argv`` inside side ``"a"`` or ``"b"``;
``pair.env(side)`` is the environment that makes UCX (and so NIXL) use TCP on that side's
veth: ``UCX_TLS=tcp`` (UCX would otherwise read the other process's memory directly, as on
one host: the processes share the machine) and ``UCX_NET_DEVICES=<veth>``.  Needs root
(``CAP_NET_ADMIN``) and ``ip``; :func:`unavailable` says why not.
"""
from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time

#: namespace names this module makes: kvabi-<creator pid>-<n><side>
_NAME = re.compile(r"^kvabi-(\d+)-(\d+)[ab]$")
_COUNT = itertools.count()


def _ip(*args, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can): not root, no ``ip``, or
    the kernel refusing a namespace (a container without ``CAP_SYS_ADMIN``)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    name = f"kvabi-{os.getpid()}-{next(_COUNT)}a"
    got = _ip("netns", "add", name, check=False)
    if got.returncode:
        return f"ip netns add failed: {got.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_inside(ns: str) -> None:
    """Stop every process in namespace ``ns`` (TERM, then KILL after 5 s)."""
    got = _ip("netns", "pids", ns, check=False)
    pids = [int(p) for p in got.stdout.split()] if got.returncode == 0 else []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        if not pids:
            return


def remove_stale() -> list[str]:
    """Remove namespaces of this module whose creating process is gone (a run killed before
    it cleaned up); returns their names."""
    got = _ip("netns", "list", check=False)
    gone = []
    for line in got.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            _stop_inside(name)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class VethPair:
    """Two network namespaces joined by a veth pair (see the module docstring)."""

    def __init__(self):
        n = next(_COUNT)
        pid = os.getpid()
        self.ns = {s: f"kvabi-{pid}-{n}{s}" for s in "ab"}
        # interface names: at most 15 characters
        self.dev = {s: f"kv{pid % 10**8}x{n % 100}{s}" for s in "ab"}
        self.addr = {"a": f"10.77.{n % 250}.1", "b": f"10.77.{n % 250}.2"}
        self._made: list[str] = []

    def __enter__(self) -> "VethPair":
        remove_stale()
        try:
            for s in "ab":
                _ip("netns", "add", self.ns[s])
                self._made.append(self.ns[s])
            _ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
            for s in "ab":
                _ip("link", "set", self.dev[s], "netns", self.ns[s])
                _ip("-n", self.ns[s], "addr", "add", f"{self.addr[s]}/30", "dev",
                    self.dev[s])
                _ip("-n", self.ns[s], "link", "set", "lo", "up")
                _ip("-n", self.ns[s], "link", "set", self.dev[s], "up")
        except BaseException as e:
            self.close()
            if isinstance(e, subprocess.CalledProcessError):
                raise RuntimeError(f"netns: {' '.join(e.cmd)} failed: {e.stderr.strip()}") \
                    from None
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop what runs inside, remove both namespaces (the veth goes with them); a veth
        end still in this namespace (a failed setup) is removed too."""
        for ns in self._made:
            _stop_inside(ns)
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", self.dev["a"], check=False)

    def command(self, side: str, argv) -> list[str]:
        """``argv`` run inside namespace ``side`` (``"a"`` or ``"b"``)."""
        return ["ip", "netns", "exec", self.ns[side], *map(str, argv)]

    def env(self, side: str) -> dict[str, str]:
        """UCX settings that make NIXL on ``side`` use TCP on its veth end."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev[side]}

    def exists(self) -> bool:
        """Whether either namespace is still there (cleanup checks)."""
        names = _ip("netns", "list", check=False).stdout
        return any(re.search(rf"^{re.escape(ns)}\b", names, re.M) for ns in self.ns.values())
