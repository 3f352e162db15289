"""Shared machinery of the adapters onto compiled CUDA libraries (FlashInfer, flash-attn).

An adapter is given the library as a module-like object: by default the real one,
imported on first use; tests inject an emulator with the same API, which lets the whole
adapter (translation, tensor views, output handling) run on CPU.  An injected library may
widen the capabilities with a ``kvabi_capabilities`` dict (an emulator computes in float64,
so it is not bound to the real kernels' dtypes and head sizes).
"""
from __future__ import annotations

from kvabi import Backend, Capabilities, KVABIError, UnsupportedError
from kvabi.tensors import to_torch

from . import boundary, runtime
from .layouts import CUDA_FAMILIES, d_contiguous_presets
from .views import check_library_layout, kv_views


class LibraryBackend(Backend):
    """Base of the library adapters.  Subclasses set the class attributes below."""

    #: importable module name of the library, and the pip extra that installs it
    module: str = ""
    extra: str = ""
    #: presets listed first in preferred_layouts
    first_layouts: tuple[str, ...] = ()
    framework = "torch"

    def __init__(self, library=None, device=None):
        self._library = library
        self._device_name = device
        self._sinks = boundary.SinkTensors()
        self._device = None

    # -- the library -----------------------------------------------------------------
    def lib(self):
        if self._library is not None:
            return self._library
        import importlib

        return importlib.import_module(self.module)

    def available(self) -> tuple[bool, str]:
        if self._library is not None:
            return True, f"injected library {getattr(self._library, '__name__', '?')}"
        ok, why = runtime.torch_status()
        if not ok:
            return False, why
        reasons = []
        cuda, dev = runtime.cuda_status()
        if not cuda:
            reasons.append(dev)
        if not runtime.module_installed(self.module):
            reasons.append(f"{self.module} not installed (pip install 'kvabi-cuda[{self.extra}]')")
        if reasons:
            return False, "; ".join(reasons)
        try:
            lib = self.lib()
        except Exception as e:  # noqa: BLE001 - a broken install is "unavailable"
            return False, f"{self.module} not importable: {type(e).__name__}: {e}"
        return True, f"{self.module} {getattr(lib, '__version__', '')} on {dev}".replace("  ", " ")

    def _require_available(self):
        ok, why = self.available()
        if not ok:
            raise UnsupportedError(f"{self.name}: unavailable: {why}")

    # -- capabilities ----------------------------------------------------------------
    def base_capabilities(self) -> dict:
        """Capabilities of the real library (fields of :class:`kvabi.Capabilities`)."""
        raise NotImplementedError

    def capabilities(self, spec=None) -> Capabilities:
        caps = self.base_capabilities()
        if self._library is not None:
            caps.update(getattr(self._library, "kvabi_capabilities", {}))
        caps["layouts"] = self.preferred_layouts(spec) if spec is not None else ()
        if spec is not None and spec.kind == "chunked_local" and spec.chunk % spec.block_size:
            # Virtual batches need whole blocks per chunk: this spec's chunk is not claimed.
            caps["kinds"] = tuple(k for k in caps["kinds"] if k != "chunked_local")
        return Capabilities(**caps)

    def check_supported(self, spec, *, softcap=None, sinks=None) -> None:
        # capabilities without a spec: the preferred-layout list is not needed to decide.
        why = self.capabilities().unsupported_reason(spec, softcap=softcap, sinks=sinks)
        if why:
            raise UnsupportedError(f"{self.name}: unsupported: {why}")
        if spec.kind == "chunked_local" and spec.chunk % spec.block_size:
            raise UnsupportedError(f"{self.name}: unsupported: chunked local attention runs "
                                   f"as virtual batches, which need chunk {spec.chunk} to be "
                                   f"a multiple of block_size {spec.block_size}")

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        return d_contiguous_presets(spec, first=self.first_layouts, families=CUDA_FAMILIES)

    # -- arrays ----------------------------------------------------------------------
    def device(self):
        if self._device is None:
            import torch

            name = self._device_name or ("cuda" if runtime.cuda_status()[0] else "cpu")
            self._device = torch.device(name)
        return self._device

    def check_layout(self, layout, spec) -> None:
        """The layout is one the library's kernels address (checked once, at plan time)."""
        check_library_layout(self.name, layout, spec)

    def cache(self, cache, layout, plan, cls):
        """The checked :class:`kvabi.KVCache` for a call with ``plan`` (identity checks
        first: this runs per layer)."""
        boundary.check_plan(self, plan, cls, layout)
        return boundary.torch_cache(self, cache, plan.layout, self.device().type == "cuda")

    def step_tensors(self, query, cache, plan, layer: int, hq: int, out, return_lse: bool):
        """What an attention call needs: the query on the device in the cache dtype (what
        the library computes in), the layer's K and V views, the output buffer in the
        query's own dtype (``out`` checked, or new zeros) and the lse (-inf: padding
        tokens stay so; None when not asked for)."""
        import torch

        spec, meta = plan.spec, plan.meta
        dev = self.device()
        q_in = to_torch(query, dev)
        if not q_in.dtype.is_floating_point:
            raise KVABIError(f"query.dtype: must be a floating-point dtype, got "
                             f"{str(q_in.dtype).replace('torch.', '')}")
        q = q_in if q_in.dtype == plan.torch_dtype else q_in.to(plan.torch_dtype)
        k_view, v_view = kv_views(cache, layer, False)
        out = boundary.out_tensor(out, (meta.num_tokens, hq, spec.head_dim_v), q_in.dtype,
                                  dev)
        lse = torch.full((meta.num_tokens, hq), float("-inf"), dtype=torch.float32,
                         device=dev) if return_lse else None
        return q, k_view, v_view, out, lse
