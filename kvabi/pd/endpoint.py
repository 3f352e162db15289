"""P/D for an engine whose requests and cache live in one process: a
:class:`~.front.Front` and the rank's :class:`~.cache_side.CacheSide` together, the step's
work handed over directly (see :mod:`.engine` for what the engine calls when)."""
from __future__ import annotations

from .cache_side import CacheSide
from .engine import EngineCaches
from .front import Front
from .settings import PDSettings
from .work import Results


class Endpoint:
    """One engine rank speaking P/D.  Keyword arguments go to :class:`CacheSide` (``log``,
    ``label``, ``fix``, ``after_pull``, ``after_load``, ``settings_at``)."""

    def __init__(self, settings: PDSettings, caches: EngineCaches, **kw):
        self.cache_side = CacheSide(settings, caches, **kw)
        self.front = Front(settings, block_size=caches.block_size, windows=caches.windows,
                           engine_id=caches.engine_id, log=kw.get("log"),
                           label=kw.get("label", "kvabi.pd"),
                           settings_at=kw.get("settings_at", ""))
        served = self.cache_side.served()
        if served is not None:
            self.front.serve([served])
        self._held: set[str] = set()

    # -- a request enters ------------------------------------------------------------------
    def matched(self, req_id: str, params, prompt, computed: int = 0, salt=None):
        """(tokens that will arrive beyond ``computed``, whether asynchronously): see
        :meth:`Front.matched`; a refused request's reason is :meth:`refusal`."""
        return self.front.matched(req_id, params, prompt, computed, salt)

    def refusal(self, req_id: str, params, prompt) -> str | None:
        """Why the request's parameters are refused, or None."""
        e = self.front.entry(req_id, params, prompt)
        return e if isinstance(e, str) else None

    def allocated(self, req_id: str, params, prompt, blocks, num_external: int,
                  salt=None) -> None:
        """The request's blocks (per group, ids for positions from 0, -1 none): queues its
        pull (or host load, or failure)."""
        self.front.allocated(req_id, params, prompt, blocks, num_external, salt)

    # -- a request ends --------------------------------------------------------------------
    def finished(self, req_id: str, params, *, normal: bool, tokens, num_computed: int,
                 blocks, salt=None) -> tuple[bool, dict | None]:
        """(keep the request's blocks until :meth:`step` reports them sent, the answer to
        return with the request or None)."""
        hold, ans = self.front.finished(req_id, params, normal=normal, tokens=tokens,
                                        num_computed=num_computed, blocks=blocks, salt=salt)
        if hold:
            self._held.add(req_id)
        return hold, ans

    # -- each step -------------------------------------------------------------------------
    def step(self) -> Results:
        """Do the step's work; what ended (:class:`~.work.Results`): ``received`` pulls
        (tokens arrived unless ``failed`` names the request), ``sent`` held requests whose
        blocks the engine may free now."""
        self.cache_side.apply(self.front.take_work())
        res = self.cache_side.results(finished=self._held)
        self._held -= res.sent
        self.front.sent(res.sent)
        return res

    def close(self) -> None:
        self.cache_side.close()


__all__ = ["Endpoint"]
