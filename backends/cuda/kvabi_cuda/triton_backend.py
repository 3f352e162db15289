"""The ``cuda.triton`` backend: this project's Triton kernels, compiled on a CUDA device or
run by Triton's interpreter on CPU tensors where there is none."""
from __future__ import annotations

import attrs
import numpy as np

from kvabi import Backend, Capabilities, KVABIError, UnsupportedError

from . import runtime, tensors
from .layouts import d_contiguous_presets
from kvabi import AttentionOptions, check_kv, check_query, check_step

KINDS = ("full", "sliding_window", "chunked_local", "mla")
_MASK = {"full": 0, "mla": 0, "sliding_window": 1, "chunked_local": 2}


@attrs.frozen(eq=False)
class TritonPlan:
    """Per-step plan: validated metadata and options, and its arrays on the kernel's device.

    Query tiles depend on the GQA group size, known only once the query arrives; they are
    built on first use per tile shape and then reused by every layer.
    """

    meta: object
    spec: object
    layout: object
    opts: AttentionOptions
    slots: object  # [T] int64
    block_table: object  # [R, max blocks] int32
    context_lens: object  # [R] int32
    query_start_loc: object  # [R + 1] int32
    sinks: object | None  # [Hq] float32
    _tiles: dict = attrs.field(factory=dict, init=False)

    def tiles(self, block_q: int):
        if block_q not in self._tiles:
            from .triton_attention import query_tiles

            dev = self.slots.device
            self._tiles[block_q] = tuple(tensors.to_torch(a, dev) for a in
                                         query_tiles(self.meta.query_start_loc, block_q))
        return self._tiles[block_q]


class TritonBackend(Backend):
    """Paged attention and cache writes in Triton; any layout, by strides."""

    name = "cuda.triton"

    def available(self) -> tuple[bool, str]:
        mode, why = runtime.triton_mode()
        return mode is not None, why

    def _interpret(self) -> bool:
        return runtime.triton_mode()[0] != "compiled"

    def capabilities(self, spec=None) -> Capabilities:
        if self._interpret():
            dtypes = ("float32", "float16")
            note = ("Triton interpreter on CPU: slow, for correctness; bfloat16 refused "
                    "because the interpreter computes it wrongly")
        else:
            dtypes = ("float32", "float16", "bfloat16")
            note = "compiled Triton on CUDA"
        return Capabilities(kinds=KINDS, dtypes=dtypes, head_dims=None, block_sizes=None,
                            softcap=True, sinks=True,
                            layouts=self.preferred_layouts(spec) if spec is not None else (),
                            notes=note + "; any layout, addressed by the strides of its "
                                         "K/V views (D contiguous is the fast case)")

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        return d_contiguous_presets(spec)

    # -- arrays ----------------------------------------------------------------------
    def _device(self):
        return runtime.device()

    def asarray(self, x):
        return tensors.to_torch(x, self._device())

    def to_numpy(self, x):
        return tensors.to_numpy(x)

    def allocate(self, layout) -> list:
        return tensors.allocate(layout, self._device())

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks)
        dev = self._device()
        import torch

        return TritonPlan(
            meta, spec, layout, opts,
            slots=tensors.to_torch(meta.slot_mapping.astype(np.int64), dev),
            block_table=tensors.to_torch(np.ascontiguousarray(meta.block_table, np.int32), dev),
            context_lens=tensors.to_torch(meta.context_lens.astype(np.int32), dev),
            query_start_loc=tensors.to_torch(meta.query_start_loc.astype(np.int32), dev),
            sinks=None if opts.sinks is None else torch.as_tensor(
                opts.sinks, dtype=torch.float32, device=dev),
        )

    def _require_available(self):
        ok, why = self.available()
        if not ok:
            raise UnsupportedError(f"{self.name}: unavailable: {why}")

    def _no_interpreted_bf16(self, t, field):
        if self._interpret() and tensors.dtype_name(t) == "bfloat16":
            raise UnsupportedError(f"{self.name}: bfloat16 {field} refused: the Triton "
                                   "interpreter computes bfloat16 wrongly")
        return t

    def _check_plan(self, plan, layout):
        if not isinstance(plan, TritonPlan):
            raise KVABIError(f"plan: must come from {self.name}.plan(), got "
                             f"{type(plan).__name__}")
        if layout != plan.layout:
            raise KVABIError("layout: differs from the layout the plan was built for")

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        from .triton_write import write_kv

        self._check_plan(plan, layout)
        spec = plan.spec
        check_kv(key, value, plan.meta, spec)
        dev = self._device()
        k_view, v_view = tensors.kv_views(layout, cache, layer, spec.is_mla, d_contiguous=False)
        key = self._no_interpreted_bf16(tensors.to_torch(key, dev), "key")
        value = None if spec.is_mla else self._no_interpreted_bf16(
            tensors.to_torch(value, dev), "value")
        write_kv(key, value, k_view, None if spec.is_mla else v_view, plan.slots,
                 spec.block_size, interpret=self._interpret())
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        import torch

        from .triton_attention import block_sizes, paged_attention

        self._check_plan(plan, layout)
        spec, meta, opts = plan.spec, plan.meta, plan.opts
        hq = check_query(query, meta, spec)
        opts.check_heads(hq)
        dev = self._device()
        q = self._no_interpreted_bf16(tensors.to_torch(query, dev), "query")
        if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            q = q.to(torch.float32)
        k_view, v_view = tensors.kv_views(layout, cache, layer, spec.is_mla, d_contiguous=False)
        t, dv = meta.num_tokens, spec.head_dim_v
        out = torch.zeros((t, hq, dv), dtype=q.dtype, device=dev)
        lse = torch.full((t, hq), float("-inf"), dtype=torch.float32, device=dev)
        group = hq // spec.num_kv_heads
        bq, bg, bn = block_sizes(group, meta.max_query_len, self._interpret())
        upcast = q.dtype != k_view.dtype or q.dtype == torch.float32
        paged_attention(
            q, k_view, v_view, out, lse, plan.sinks, plan.block_table, plan.context_lens,
            plan.query_start_loc, plan.tiles(bq), group=group, head_dim=spec.head_dim,
            head_dim_v=dv, block_size=spec.block_size, scale=opts.scale,
            softcap=opts.softcap, mask=_MASK[spec.kind],
            span=spec.span or 1, upcast=upcast, block_q=bq, block_g=bg, block_n=bn)
        return (out, lse) if return_lse else out
