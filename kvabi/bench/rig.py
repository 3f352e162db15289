"""A NIXL serving process for the transfer benches: this process's agent plus a spawned
child that holds source caches, asked over a pipe."""
from __future__ import annotations

import multiprocessing as mp


class ServingRig:
    """This process's NIXL agent ``name`` plus a spawned serving process running
    ``target(conn)``, asked over a pipe (``_ask``) and stopped by :meth:`close`."""

    def __init__(self, name: str, target):
        from ..transfer.nixl import NixlAgent

        self.agent = NixlAgent(name)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child,), daemon=True)
        self.proc.start()

    def _ask(self, *msg, timeout=120):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise RuntimeError(f"bench: the NIXL serving process did not answer {msg[0]!r}")
        return self.conn.recv()

    def close(self):
        try:
            self._ask("stop", timeout=30)
        except Exception:  # noqa: BLE001 - the child may be gone already
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
        self.agent.close()
