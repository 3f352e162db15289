"""What one continuous-batching run holds in kvabi: the caches, the step's metadata and
plans, and the per-layer attention that transformers calls."""
from __future__ import annotations

import collections
import threading
import time

import numpy as np
import kvabi
from kvabi import KVABIError
from kvabi import tensors as kt
from kvabi.probe import backend_writer, verify_layout

from .step import step_metadata


# The session whose step the model is running in this thread (set by the model's forward
# pre-hook): transformers >= 5.24 no longer hands the paged cache to the attention function,
# and KV-shared layers never see it at all, so attention finds its session here.
_ACTIVE = threading.local()


def activate(session) -> None:
    """Make ``session`` (None: none) the one this thread's attention calls answer from."""
    _ACTIVE.session = session


def active_session():
    """The session of the step running in this thread, or None."""
    return getattr(_ACTIVE, "session", None)


class Step:
    """One forward pass: full metadata, optional prefill-skip metadata, and plans made once
    per (KV group, metadata, options) and reused by every layer of the group."""

    def __init__(self, session, meta, keep=None):
        self.session = session
        self.meta = meta
        self.skip_meta = None
        self.skip_index = None  # torch index of the kept tokens, set when skipping
        self.skipping = False
        self.plans: dict = {}
        if keep is not None:
            self.skip_meta, idx = kvabi.transforms.prefill_skip(meta, keep)
            self.skip_rows = idx

    def plan(self, group: int, skipped: bool, scale, softcap):
        """The plan of a KV group (every layer's sinks come with its own call)."""
        key = (group, skipped, scale, softcap)
        plan = self.plans.get(key)
        if plan is None:
            s = self.session
            meta = self.skip_meta if skipped else self.meta
            t0 = time.perf_counter()
            plan = s.backend.plan(meta, s.specs[group], s.layouts[group],
                                  num_q_heads=s.num_q_heads, scale=scale, softcap=softcap)
            s.timing["plan"] += time.perf_counter() - t0
            self.plans[key] = plan
        return plan


class Session:
    """kvabi caches and per-step state of one transformers paged cache."""

    def __init__(self, integration, num_blocks: int, stride: int, first_block: int):
        self.integration = integration
        self.backend = integration.backend
        self.fw = self.backend.framework
        self.num_blocks = num_blocks
        self.stride = stride
        self.first_block = first_block
        self.block_size = integration.block_size
        self.slots = integration.slots
        self.specs = [g.spec for g in integration.model_kv.groups]
        self.num_q_heads = integration.num_q_heads
        self.layouts = [kvabi.Layout.preset(name, g.spec, num_blocks, len(g.layers))
                        for name, g in zip(integration.layout_names, integration.model_kv.groups)]
        self.caches = [self.backend.allocate(lay) for lay in self.layouts]
        # Once per cache: the backend's write_kv must put elements where the layout says
        # (the first and last slot; the cache's bytes are restored).
        for spec, lay, cache in zip(self.specs, self.layouts, self.caches):
            verify_layout(lay, *backend_writer(self.backend, lay, spec, cache), samples=2)
        self.step: Step | None = None
        #: steps, tokens, and rows the KV-shared layers skipped (prefill skip)
        self.stats = collections.Counter()
        #: seconds spent building step metadata and plans (kvabi's per-step overhead), in
        #: framework conversions of each layer's arrays ("handover") and in the backend's
        #: write_kv + attention ("backend")
        self.timing = collections.Counter()
        #: each layer's sinks, one tensor object per layer (the backend checks each once,
        #: again only after an in-place change)
        self.sinks = {i: s.detach() for i, s in integration.sinks.items()}

    def serves(self, module) -> bool:
        """Whether ``module`` is an attention module of the model this session serves."""
        return self.integration.modules.get(getattr(module, "layer_idx", None)) is module

    # -- per step ------------------------------------------------------------------------
    def begin_step(self, kwargs, prefill_skip: bool) -> Step:
        t0 = time.perf_counter()
        meta = step_metadata(kwargs["cu_seq_lens_q"], kwargs["position_ids"],
                             kwargs["write_index"][0], kwargs["read_index"][0],
                             block_size=self.block_size, stride=self.stride,
                             first_block=self.first_block, num_blocks=self.num_blocks)
        keep = None
        if prefill_skip:
            logits = kt.to_numpy(kwargs["logits_indices"]).astype(np.int64)
            if len(logits) < meta.num_actual_tokens:
                keep = logits
        self.step = Step(self, meta, keep)
        self.timing["metadata"] += time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["tokens"] += meta.num_actual_tokens
        if keep is not None:
            self.stats["skipped_rows"] += meta.num_actual_tokens - len(keep)
        return self.step

    def copy_blocks(self, src, dst) -> None:
        """Copy blocks ``src`` to ``dst`` (transformers' block ids) in every KV group's
        cache, through kvabi.transfer (any layout, any framework)."""
        if not len(src):
            return
        from kvabi.transfer import execute, plan_block_transfer

        s = np.asarray(src, np.int64) - self.first_block
        d = np.asarray(dst, np.int64) - self.first_block
        for g, layout in enumerate(self.layouts):
            plan = plan_block_transfer(layout, layout, s, d)
            self.caches[g] = kvabi.KVCache.wrap(layout,
                                                execute(plan, self.caches[g], self.caches[g]))

    # -- per layer -----------------------------------------------------------------------
    def _to_backend(self, x):
        if self.fw == "numpy":
            return kt.to_numpy(x)
        if self.fw == "jax":
            return kt.to_jax(x.contiguous())
        return x.contiguous()

    def attend(self, module, query, key, value, scaling, softcap):
        """Write the layer's new K/V (owners only) and attend over its cache: query
        [1, Hq, T, D] -> output [1, T, Hq, Dv] in the query's dtype."""
        step = self.step
        if step is None:
            raise KVABIError("kvabi attention was called outside a continuous-batching step")
        slot = self.slots[module.layer_idx]
        skipped = slot.shared and step.skipping
        meta = step.skip_meta if skipped else step.meta
        t = query.shape[2]
        if t != meta.num_tokens:
            raise KVABIError(f"query: layer {module.layer_idx} got {t} tokens, the step has "
                             f"{meta.num_tokens}")
        g = slot.group
        plan = step.plan(g, skipped, float(scaling), softcap)
        clock = time.perf_counter
        t0 = clock()
        q = self._to_backend(query[0].transpose(0, 1))
        if not slot.shared:
            k = self._to_backend(key[0].transpose(0, 1))
            v = self._to_backend(value[0].transpose(0, 1))
            t1 = clock()
            self.caches[g] = self.backend.write_kv(plan, self.caches[g], key=k, value=v,
                                                   layer=slot.index)
        else:
            t1 = clock()
        out = self.backend.attention(plan, self.caches[g], query=q, layer=slot.index,
                                     sinks=self.sinks.get(module.layer_idx))
        if hasattr(out, "block_until_ready"):  # jax dispatches asynchronously: the
            out.block_until_ready()  # conversion below would wait for the kernel anyway
        t2 = clock()
        out = kt.to_torch(out, device=query.device).to(query.dtype)
        t3 = clock()
        self.timing["handover"] += (t1 - t0) + (t3 - t2)  # torch -> backend -> torch
        self.timing["backend"] += t2 - t1  # write_kv + attention
        self.stats["layer_calls"] += 1
        return out.reshape(1, t, out.shape[-2], out.shape[-1]), None
