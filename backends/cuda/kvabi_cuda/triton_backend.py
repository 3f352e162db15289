"""The ``cuda.triton`` backend: this project's Triton kernels, compiled on a CUDA device or
run by Triton's interpreter on CPU tensors where there is none."""
from __future__ import annotations

import attrs
import numpy as np

from kvabi import Backend, Capabilities, UnsupportedError, check_kv, check_step
from kvabi.coerce import INT32_MAX
from kvabi.tensors import to_torch

from . import boundary, runtime
from .index_width import index_dtype, index_values, needs_int64, tensor_extent
from .layouts import d_contiguous_presets
from .views import kv_views

KINDS = ("full", "sliding_window", "chunked_local", "mla")
_MASK = {"full": 0, "mla": 0, "sliding_window": 1, "chunked_local": 2}
_QUERY_DTYPES = ("float16", "bfloat16", "float32", "float64")


@attrs.frozen(eq=False)
class TritonPlan:
    """Per-step plan: validated metadata and options, its arrays on the kernel's device, and
    the index width (int64 where the layout or the step can pass int32).

    Query tiles depend on the GQA group size: built here when ``num_q_heads`` is given to
    ``plan``, otherwise on first use per tile shape and then reused by every layer.  The
    plan holds nothing per layer: per-layer sinks come with each ``attention`` call.
    """

    meta: object
    spec: object
    layout: object
    opts: object  # AttentionOptions
    num_q_heads: int | None
    idx64: bool
    slots: object  # [T] int64
    block_table: object  # [R, max blocks] index dtype, unused entries 0
    context_lens: object  # [R] index dtype
    query_start_loc: object  # [R + 1] index dtype
    sinks: object | None  # [Hq] float32
    _tiles: dict = attrs.field(factory=dict, init=False)

    def tiles(self, block_q: int):
        t = self._tiles.get(block_q)
        if t is None:
            from .triton_attention import query_tiles

            dev = self.slots.device
            tiles = query_tiles(self.meta.query_start_loc, block_q, index_dtype(self.idx64))
            packed = to_torch(np.concatenate(tiles), dev)  # one host-to-device copy
            n = len(tiles[0])
            t = self._tiles[block_q] = (packed[:n], packed[n:2 * n], packed[2 * n:])
        return t


class TritonBackend(Backend):
    """Paged attention and cache writes in Triton; any layout, by strides."""

    name = "cuda.triton"
    framework = "torch"

    def __init__(self):
        self._sinks = boundary.SinkTensors()
        self._dev = None

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

    def device(self):
        if self._dev is None:
            self._dev = runtime.device()
        return self._dev

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        opts, hq = boundary.plan_options(spec, num_q_heads, scale, softcap, sinks)
        dev = self.device()
        import torch

        wide = needs_int64(layout, max_seq_len=meta.max_seq_len, num_tokens=meta.num_tokens)
        bt = np.asarray(meta.block_table)
        need = -(-np.asarray(meta.seq_lens, np.int64) // spec.block_size)
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        # Entries past a request's blocks are never read: zeroed, not cast blindly.
        parts = [index_values(np.where(used, bt, 0), "block_table", wide, ndim=2),
                 index_values(meta.context_lens, "context_lens", wide),
                 index_values(meta.query_start_loc, "query_start_loc", wide)]
        bq = None
        if hq is not None:  # the query tiles too, in the same copy
            from .triton_attention import query_tiles

            bq = self._block_sizes(meta, spec, hq)[0]
            parts += query_tiles(meta.query_start_loc, bq, index_dtype(wide))
        # One host-to-device copy for every index array of the step (views of it).
        packed = to_torch(np.concatenate([a.ravel() for a in parts]), dev)
        views, at = [], 0
        for a in parts:
            views.append(packed[at:at + a.size].view(a.shape))
            at += a.size
        plan = TritonPlan(
            meta, spec, layout, opts, hq, wide,
            slots=to_torch(np.asarray(meta.slot_mapping, np.int64), dev),
            block_table=views[0], context_lens=views[1], query_start_loc=views[2],
            sinks=None if opts.sinks is None else torch.as_tensor(
                opts.sinks, dtype=torch.float32, device=dev),
        )
        if bq is not None:
            plan._tiles[bq] = tuple(views[3:])
        return plan

    def _block_sizes(self, meta, spec, hq: int):
        from .triton_attention import block_sizes

        return block_sizes(hq // spec.num_kv_heads, meta.max_query_len, self._interpret())

    def _require_available(self):
        ok, why = self.available()
        if not ok:
            raise UnsupportedError(f"{self.name}: unavailable: {why}")

    def check_supported(self, spec, *, softcap=None, sinks=None) -> None:
        # capabilities() without a spec: the preferred-layout list is not needed to decide.
        why = self.capabilities().unsupported_reason(spec, softcap=softcap, sinks=sinks)
        if why:
            raise UnsupportedError(f"{self.name}: unsupported: {why}")

    def _no_interpreted_bf16(self, t, field):
        import torch

        if t.dtype == torch.bfloat16 and self._interpret():
            raise UnsupportedError(f"{self.name}: bfloat16 {field} refused: the Triton "
                                   "interpreter computes bfloat16 wrongly")
        return t

    def _cache(self, cache, layout, plan):
        boundary.check_plan(self, plan, TritonPlan, layout)
        return boundary.torch_cache(self, cache, plan.layout, self.device().type == "cuda")

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        from .triton_write import write_kv

        c = self._cache(cache, layout, plan)
        spec = plan.spec
        check_kv(key, value, plan.meta, spec)
        dev = self.device()
        k_view, v_view = kv_views(c, layer, spec.is_mla)
        key = self._no_interpreted_bf16(to_torch(key, dev), "key")
        value = None if spec.is_mla else self._no_interpreted_bf16(
            to_torch(value, dev), "value")
        wide = plan.idx64 or tensor_extent(key) > INT32_MAX or (
            value is not None and tensor_extent(value) > INT32_MAX)
        write_kv(key, value, k_view, None if spec.is_mla else v_view, plan.slots,
                 spec.block_size, interpret=self._interpret(), idx64=wide)
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, sinks=None, out=None,
                  return_lse=False):
        import torch

        from .triton_attention import paged_attention

        c = self._cache(cache, layout, plan)
        spec, meta, opts = plan.spec, plan.meta, plan.opts
        hq = boundary.query_heads(query, plan)
        dev = self.device()
        q = self._no_interpreted_bf16(to_torch(query, dev), "query")
        if q.dtype not in _query_dtypes():
            got = str(q.dtype).replace("torch.", "")
            raise UnsupportedError(f"{self.name}: query.dtype {got} unsupported (one of "
                                   f"{', '.join(_QUERY_DTYPES)})")
        if sinks is None:
            opts.check_heads(hq)
            sink_t = plan.sinks
        else:
            sink_t = self._sinks.get(sinks, hq, dev)
        k_view, v_view = kv_views(c, layer, spec.is_mla)
        t, dv = meta.num_tokens, spec.head_dim_v
        o = boundary.out_tensor(out, (t, hq, dv), q.dtype, dev)
        lse = torch.full((t, hq), float("-inf"), dtype=torch.float32,
                         device=dev) if return_lse else None
        bq, bg, bn = self._block_sizes(meta, spec, hq)
        wide = plan.idx64 or tensor_extent(q) > INT32_MAX or tensor_extent(o) > INT32_MAX
        upcast = q.dtype != k_view.dtype or q.dtype == torch.float32
        paged_attention(
            q, k_view, v_view, o, lse, sink_t, plan.block_table, plan.context_lens,
            plan.query_start_loc, plan.tiles(bq), group=hq // spec.num_kv_heads,
            head_dim=spec.head_dim, head_dim_v=dv, block_size=spec.block_size,
            scale=opts.scale, softcap=opts.softcap, mask=_MASK[spec.kind],
            span=spec.span or 1, upcast=upcast, block_q=bq, block_g=bg, block_n=bn,
            idx64=wide)
        return (o, lse) if return_lse else o


def _query_dtypes():
    import torch

    return tuple(getattr(torch, n) for n in _QUERY_DTYPES)
