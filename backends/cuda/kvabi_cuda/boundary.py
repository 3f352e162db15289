"""What every CUDA backend checks at a call's boundary, before any kernel runs.

The order matters for the hot path: the cheap identity checks come first (the plan is this
backend's, the layout is the plan's object, the cache is a handle of that layout) and the
full comparisons only run when an identity check misses.  Per-call attention sinks are
validated and moved to the device once per tensor (an engine passes each layer's learned
sinks, the same tensor every step), not once per call.
"""
from __future__ import annotations

import weakref

from kvabi import (AttentionOptions, KVABIError, as_cache, check_num_q_heads, check_query,
                   check_sinks)


def describe(layout) -> str:
    """A layout in a message: its name and block count."""
    return f"{layout.name or 'custom'} with {layout.num_blocks} blocks"


def check_plan(backend, plan, cls, layout) -> None:
    """``plan`` comes from ``backend.plan`` and was built for ``layout``."""
    if type(plan) is not cls and not isinstance(plan, cls):
        raise KVABIError(f"plan: must come from {backend.name}.plan(), got "
                         f"{type(plan).__name__}")
    if layout is not plan.layout and layout != plan.layout:
        raise KVABIError(f"layout: {describe(layout)} differs from the layout the plan was "
                         f"built for ({describe(plan.layout)})")


def torch_cache(backend, cache, layout, on_cuda: bool):
    """The :class:`kvabi.KVCache` of ``cache`` (a handle or a 1.0 list of planes) for
    ``layout``: torch planes on the backend's kind of device, checked against the layout
    (another layout's cache, too little memory or another dtype is refused)."""
    c = as_cache(cache, layout, "torch")
    if c[0].is_cuda != on_cuda:
        raise KVABIError(f"cache: planes are on {c[0].device}, {backend.name} runs on "
                         f"{'cuda' if on_cuda else 'cpu'}")
    return c


def plan_options(spec, num_q_heads, scale, softcap, sinks):
    """(:class:`AttentionOptions`, num_q_heads or None) of a ``plan`` call, checked by the
    core (num_q_heads a positive multiple of the KV heads; sinks one per query head)."""
    opts = AttentionOptions.resolve(spec, scale, softcap, sinks, num_q_heads=num_q_heads)
    return opts, None if num_q_heads is None else check_num_q_heads(num_q_heads, spec)


def query_heads(query, plan) -> int:
    """The query's head count, checked against the step and the plan's ``num_q_heads``."""
    hq = check_query(query, plan.meta, plan.spec)
    if plan.num_q_heads is not None and hq != plan.num_q_heads:
        raise KVABIError(f"query: the plan was built for num_q_heads={plan.num_q_heads}, "
                         f"got {hq} query heads")
    return hq


class SinkTensors:
    """Per-call sinks as float32 tensors on the device, checked once per tensor.

    A torch tensor is remembered by identity and its in-place version counter, so a
    model's per-layer sinks are validated (a host sync on a GPU) the first time only; a
    numpy array or list is checked and converted on every call.
    """

    def __init__(self, limit: int = 4096):
        self._memo: dict = {}
        self._limit = limit

    def get(self, sinks, hq: int, device):
        import torch

        is_torch = isinstance(sinks, torch.Tensor)
        if is_torch:
            hit = self._memo.get(id(sinks))
            if hit is not None:
                ref, version, heads, t = hit
                if ref() is sinks and version == sinks._version and heads == hq:
                    return t
        t = torch.as_tensor(check_sinks(sinks, hq), dtype=torch.float32, device=device)
        if is_torch:
            if len(self._memo) >= self._limit:
                self._memo.clear()
            self._memo[id(sinks)] = (weakref.ref(sinks), sinks._version, hq, t)
        return t


def out_tensor(out, shape, dtype, device):
    """``out`` checked as the attention output buffer (torch, ``shape``, the query's
    dtype, the backend's kind of device), or a new zeroed one when None."""
    import torch

    if out is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise KVABIError(f"out: must be a torch tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise KVABIError(f"out.shape: must be {list(shape)}, got {list(out.shape)}")
    if out.dtype != dtype:
        raise KVABIError(f"out.dtype: must be the query's {str(dtype).replace('torch.', '')},"
                         f" got {str(out.dtype).replace('torch.', '')}")
    if out.is_cuda != (device.type == "cuda"):
        raise KVABIError(f"out: is on {out.device}, the backend runs on {device}")
    return out


