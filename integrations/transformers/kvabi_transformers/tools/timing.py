"""Timing generate_batch runs step by step: every model forward (one CB step) is timed,
so prefill and decode steps can be told apart and compared side by side.  Each forward gets
wall seconds and the process's CPU seconds (all threads): on a machine shared with other
work the CPU time moves much less than the wall time."""
from __future__ import annotations

import statistics
import time

from .compare import run_batch


class ForwardTimer:
    """Wall and CPU seconds of every forward of ``model`` while active (hooks on the top
    module)."""

    def __init__(self, model):
        self.model = model
        self.seconds: list[float] = []
        self.cpu_seconds: list[float] = []
        self._t0 = self._c0 = 0.0
        self._hooks = []

    def __enter__(self):
        def pre(*_):
            self._c0 = time.process_time()
            self._t0 = time.perf_counter()

        def post(*_):
            self.seconds.append(time.perf_counter() - self._t0)
            self.cpu_seconds.append(time.process_time() - self._c0)

        self._hooks = [self.model.register_forward_pre_hook(pre),
                       self.model.register_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()


def timed_runs(model, prompts, new_tokens, config, *, repeat=1, warmup=0, progress=None):
    """Run ``generate_batch`` ``warmup`` + ``repeat`` times; returns a dict with the tokens,
    the median prefill forward (first step), the median decode forward per step (wall and
    process CPU seconds), wall seconds per run, and (kvabi) the per-step metadata+plan
    seconds and, per layer call, the seconds of framework conversions (torch to the
    backend's arrays and back) and of the backend's write_kv + attention."""
    prefill, decode, decode_cpu, wall, tokens = [], [], [], [], None
    overhead, handover, backend = [], [], []
    integration = getattr(model, "_kvabi_integration", None)
    for i in range(warmup + repeat):
        with ForwardTimer(model) as timer:
            t0 = time.perf_counter()
            tokens, _ = run_batch(model, prompts, new_tokens, config=config, logits=False)
            seconds = time.perf_counter() - t0
        if progress is not None:
            progress.update(1)
        if i < warmup:
            continue
        wall.append(seconds)
        prefill.append(timer.seconds[0])
        decode.extend(timer.seconds[1:])
        decode_cpu.extend(timer.cpu_seconds[1:])
        session = integration.session if integration is not None else None
        if session is not None:
            steps = max(session.stats["steps"], 1)
            overhead.append((session.timing["metadata"] + session.timing["plan"]) / steps)
            calls = max(session.stats["layer_calls"], 1)
            handover.append(session.timing["handover"] / calls)
            backend.append(session.timing["backend"] / calls)
    med = statistics.median
    return {"tokens": tokens, "prefill_s": med(prefill),
            "decode_s": med(decode) if decode else None,
            "decode_cpu_s": med(decode_cpu) if decode_cpu else None, "wall_s": med(wall),
            "generated": sum(len(t) for t in tokens),
            "overhead_s": med(overhead) if overhead else None,
            "handover_per_layer_s": med(handover) if handover else None,
            "backend_per_layer_s": med(backend) if backend else None}
