"""The ``cuda.triton`` backend: this project's Triton kernels, compiled on a CUDA device or
run by Triton's interpreter on CPU tensors where there is none."""
from __future__ import annotations

import attrs
import numpy as np

from kvabi import Backend, Capabilities, UnsupportedError
from kvabi.util.coerce import INT32_MAX
from kvabi.util.tensors import ConvertOnce, to_torch

from . import runtime
from .index_width import index_dtype, needs_int64, tensor_extent
from .layouts import d_contiguous_presets
from .views import kv_views

KINDS = ("full", "sliding_window", "chunked_local", "mla")
_MASK = {"full": 0, "mla": 0, "sliding_window": 1, "chunked_local": 2}
_QUERY_DTYPES = ("float16", "bfloat16", "float32", "float64")


@attrs.frozen(eq=False)
class TritonSteps:
    """What the Triton backend prepares for a step: its index arrays on the kernel's
    device and the index width (int64 where the layout or the step can pass int32).

    Query tiles depend on the GQA group size and the tile shape: built in ``prepare`` for
    the plan's query heads, and on first use for another tile shape.  Nothing here depends
    on the layer: per-layer sinks come with each call."""

    idx64: bool
    slots: object  # [T] int64
    block_table: object  # [R, max blocks] index dtype, unused entries 0
    context_lens: object  # [R] index dtype
    query_start_loc: object  # [R + 1] index dtype
    sinks: object | None  # the plan's sinks, [Hq] float32 on the device
    _tiles: dict = attrs.field(factory=dict, init=False)

    def tiles(self, meta, block_q: int):
        t = self._tiles.get(block_q)
        if t is None:
            from .triton_attention import query_tiles

            dev = self.slots.device
            tiles = query_tiles(meta.query_start_loc, block_q, index_dtype(self.idx64))
            packed = to_torch(np.concatenate(tiles), dev)  # one host-to-device copy
            n = len(tiles[0])
            t = self._tiles[block_q] = (packed[:n], packed[n:2 * n], packed[2 * n:])
        return t


class TritonBackend(Backend):
    """Paged attention and cache writes in Triton; any layout, by strides."""

    name = "cuda.triton"
    framework = "torch"

    def __init__(self):
        self._dev = None
        self._sinks = None

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

    # -- once per step -----------------------------------------------------------------
    def prepare(self, plan) -> TritonSteps:
        import torch

        meta, spec, dev = plan.meta, plan.spec, self.device()
        wide = needs_int64(plan.layout, max_seq_len=meta.max_seq_len,
                           num_tokens=meta.num_tokens)
        it = index_dtype(wide)
        bt = meta.block_table
        need = -(-meta.seq_lens.astype(np.int64) // spec.block_size)
        used = np.arange(bt.shape[1])[None, :] < need[:, None]
        # Entries past a request's blocks are never read: zeroed, not cast blindly; the
        # others are inside the layout (the plan's check), so any index width holds them.
        parts = [np.where(used, bt, 0).astype(it), meta.context_lens.astype(it),
                 meta.query_start_loc.astype(it)]
        from .triton_attention import query_tiles

        bq = self._block_sizes(meta, spec, plan.num_q_heads)[0]
        parts += query_tiles(meta.query_start_loc, bq, it)  # the tiles too, in one copy
        # One host-to-device copy for every index array of the step (views of it).
        packed = to_torch(np.concatenate([a.ravel() for a in parts]), dev)
        views, at = [], 0
        for a in parts:
            views.append(packed[at:at + a.size].view(a.shape))
            at += a.size
        steps = TritonSteps(
            wide, slots=to_torch(np.asarray(meta.slot_mapping, np.int64), dev),
            block_table=views[0], context_lens=views[1], query_start_loc=views[2],
            sinks=None if plan.sinks is None else torch.tensor(
                plan.sinks, dtype=torch.float32, device=dev))
        steps._tiles[bq] = tuple(views[3:])
        return steps

    def _block_sizes(self, meta, spec, hq: int):
        from .triton_attention import block_sizes

        return block_sizes(hq // spec.num_kv_heads, meta.max_query_len, self._interpret())

    def _no_interpreted_bf16(self, t, field):
        import torch

        if t.dtype == torch.bfloat16 and self._interpret():
            raise UnsupportedError(f"{self.name}: bfloat16 {field} refused: the Triton "
                                   "interpreter computes bfloat16 wrongly")
        return t

    # -- per layer ---------------------------------------------------------------------
    def write(self, plan, cache, key, value, layer):
        from .triton_write import write_kv

        spec, steps = plan.spec, plan.prepared
        k_view, v_view = kv_views(cache, layer, spec.is_mla)
        key = self._no_interpreted_bf16(key, "key")
        value = None if spec.is_mla else self._no_interpreted_bf16(value, "value")
        wide = steps.idx64 or tensor_extent(key) > INT32_MAX or (
            value is not None and tensor_extent(value) > INT32_MAX)
        write_kv(key, value, k_view, None if spec.is_mla else v_view, steps.slots,
                 spec.block_size, interpret=self._interpret(), idx64=wide)
        return cache

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        import torch

        from .triton_attention import paged_attention

        spec, meta, steps, hq = plan.spec, plan.meta, plan.prepared, plan.num_q_heads
        dev = self.device()
        q = self._no_interpreted_bf16(query, "query")
        if q.dtype not in _query_dtypes():
            got = str(q.dtype).replace("torch.", "")
            raise UnsupportedError(f"{self.name}: query.dtype {got} unsupported (one of "
                                   f"{', '.join(_QUERY_DTYPES)})")
        if sinks is None or sinks is plan.sinks:
            sink_t = steps.sinks
        else:
            if self._sinks is None:
                self._sinks = ConvertOnce("torch", dtype="float32", device=dev)
            sink_t = self._sinks(sinks)
        k_view, v_view = kv_views(cache, layer, spec.is_mla)
        t, dv = meta.num_tokens, spec.head_dim_v
        o = torch.zeros((t, hq, dv), dtype=q.dtype, device=dev) if out is None else out
        lse = torch.full((t, hq), float("-inf"), dtype=torch.float32,
                         device=dev) if return_lse else None
        bq, bg, bn = self._block_sizes(meta, spec, hq)
        wide = steps.idx64 or tensor_extent(q) > INT32_MAX or tensor_extent(o) > INT32_MAX
        upcast = q.dtype != k_view.dtype or q.dtype == torch.float32
        paged_attention(
            q, k_view, v_view, o, lse, sink_t, steps.block_table, steps.context_lens,
            steps.query_start_loc, steps.tiles(meta, bq), group=hq // spec.num_kv_heads,
            head_dim=spec.head_dim, head_dim_v=dv, block_size=spec.block_size,
            scale=plan.scale, softcap=plan.softcap, mask=_MASK[spec.kind],
            span=spec.span or 1, upcast=upcast, block_q=bq, block_g=bg, block_n=bn,
            idx64=wide)
        return o, lse


def _query_dtypes():
    import torch

    return tuple(getattr(torch, n) for n in _QUERY_DTYPES)
