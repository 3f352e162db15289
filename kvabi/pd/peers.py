"""A consumer's connected producers: each handshake message connected once and shared by
the pull threads, counted while pulls use it, the least recently used idle ones forgotten
past ``max_peers``."""
from __future__ import annotations

import collections
import hashlib
import threading


class Peers:
    """Peers of ``agent`` (a :class:`kvabi.transfer.nixl.NixlAgent`), at most ``max_peers``
    kept idle."""

    def __init__(self, agent, max_peers: int):
        self._agent = agent
        self.max_peers = max_peers
        # digest of a message -> [connected Peer, pulls using it]
        self._held: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def get(self, message: str, job):
        """The peer of a handshake message, held by ``job`` (a pull: its ``left()`` bounds
        the connection, its ``peers`` list what it holds) until :meth:`release`."""
        key = hashlib.blake2b(message.encode(), digest_size=16).digest()
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held[1] += 1
                self._held.move_to_end(key)
        if held is None:
            peer = self._agent.connect(message, timeout=job.left())  # outside the lock
            with self._lock:
                held = self._held.get(key)
                if held is None:
                    held = self._held[key] = [peer, 1]
                else:  # another thread connected it meanwhile
                    held[1] += 1
                    self._agent.disconnect(peer)
                self._evict()
        job.peers.append(key)
        return held[0]

    def release(self, job) -> None:
        """``job`` uses none of its peers any more."""
        with self._lock:
            for key in job.peers:
                if key in self._held:
                    self._held[key][1] -= 1
            job.peers = []
            self._evict()

    def _evict(self) -> None:
        idle = [k for k, (_, n) in self._held.items() if n == 0]
        for k in idle[:max(len(self._held) - self.max_peers, 0)]:
            self._agent.disconnect(self._held.pop(k)[0])


__all__ = ["Peers"]
