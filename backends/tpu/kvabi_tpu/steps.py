"""The jitted per-layer steps both TPU backends run: write new K/V, attend.

Each step takes the planes holding one layer (whole cross-layer planes included) and does
everything between the backend boundary and the kernel inside one jitted computation:
padding the step to its power-of-two token count, the per-layer view, the token rows in
cache form, the kernel (``impl``), and storing the layer back.  XLA then reads slices in
place, and with ``donate`` the cache update runs in place too (no copy of the cache).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .env import CHEAP_COMPILER_OPTIONS

_STATIC = ("fmt", "layer", "padded_tokens", "impl", "static")


def pad_rows(x, n: int):
    """``x`` with zero rows appended up to ``n`` rows (padding tokens)."""
    if x.shape[0] == n:
        return x
    return jnp.pad(x, ((0, n - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _write(planes, key, value, args, *, fmt, layer, padded_tokens, impl, static):
    rows = fmt.token_rows(pad_rows(key, padded_tokens), pad_rows(value, padded_tokens))
    views = fmt.layer_tensors(planes, layer)
    new = impl(rows, tuple(fmt.write_view(v) for v in views), *args, **dict(static))
    return fmt.put_layer(planes, layer, [x.reshape(v.shape) for x, v in zip(new, views)])


def _attend(query, planes, args, sinks, *, fmt, layer, padded_tokens, impl, static):
    views = fmt.layer_tensors(planes, layer)
    out, lse = impl(pad_rows(query, padded_tokens), views, *args, sinks, fmt=fmt,
                    **dict(static))
    t = query.shape[0]
    return out[:t], lse[:t]


@functools.lru_cache(maxsize=None)
def compiled(step: str, *, donate: bool, cheap: bool):
    """The jitted ``write`` or ``attend`` step; ``cheap`` compiles with cheap XLA options
    (interpreted kernels, tests), ``donate`` lets a write reuse the cache buffers."""
    fn = {"write": _write, "attend": _attend}[step]
    return jax.jit(fn, static_argnames=_STATIC,
                   donate_argnums=(0,) if donate and step == "write" else (),
                   compiler_options=CHEAP_COMPILER_OPTIONS if cheap else None)


def signature(step: str, args, kw) -> tuple:
    """What selects one compiled computation of ``step``: its static keywords and the
    shape and dtype of every array argument (the key of :func:`run`'s table)."""
    leaves = jax.tree_util.tree_leaves(args)
    return (step, tuple(sorted(kw.items())),
            tuple((tuple(x.shape), str(x.dtype)) for x in leaves))


def run(table: dict, step: str, fn, args, kw):
    """Call the jitted ``fn``, through the executable compiled ahead of time for these
    shapes when ``table`` holds one: a jitted function's first call with new shapes traces
    it again (tens of ms) even when the executable exists, the stored one never does."""
    exe = table.get(signature(step, args, kw)) if table else None
    if exe is not None:
        return exe(*args)
    return fn(*args, **kw)
