"""Shared machinery of the adapters onto compiled CUDA libraries (FlashInfer, flash-attn).

An adapter is given the library as a module-like object: by default the real one,
imported on first use; tests inject an emulator with the same API, which lets the whole
adapter (translation, tensor views, output handling) run on CPU.  An injected library may
widen the capabilities with a ``kvabi_capabilities`` dict (an emulator computes in float64,
so it is not bound to the real kernels' dtypes and head sizes).
"""
from __future__ import annotations

from kvabi import Backend, Capabilities
from kvabi.util.tensors import ConvertOnce

from . import runtime
from .layouts import CUDA_FAMILIES, d_contiguous_presets
from .views import kv_views, library_layout_refusals


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
        self._sinks = None
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
            caps["notes"] = (f"chunked local attention runs as virtual batches, which need "
                             f"chunk {spec.chunk} to be a multiple of block_size "
                             f"{spec.block_size}; " + caps.get("notes", ""))
        return Capabilities(**caps)

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        return d_contiguous_presets(spec, first=self.first_layouts, families=CUDA_FAMILIES)

    # -- arrays ----------------------------------------------------------------------
    def device(self):
        if self._device is None:
            import torch

            name = self._device_name or ("cuda" if runtime.cuda_status()[0] else "cpu")
            self._device = torch.device(name)
        return self._device

    def layout_refusals(self, spec, layout) -> tuple[str, ...]:
        """What the library's paged kernels address (see :func:`library_layout_refusals`)."""
        return library_layout_refusals(layout, spec)

    def device_sinks(self, sinks):
        """Checked per-call sinks as float32 on the device, once per array."""
        if self._sinks is None:
            self._sinks = ConvertOnce("torch", dtype="float32", device=self.device())
        return self._sinks(sinks)

    def step_tensors(self, plan, query, cache, layer: int, out, return_lse: bool):
        """What an attention call needs: the query in the cache dtype (what the library
        computes in), the layer's K and V views, the output buffer in the query's own dtype
        (``out``, or new zeros) and the lse (-inf: padding tokens stay so; None when not
        asked for)."""
        import torch

        spec, t, hq, dev = plan.spec, plan.meta.num_tokens, plan.num_q_heads, self.device()
        dt = plan.prepared.torch_dtype
        q = query if query.dtype == dt else query.to(dt)
        k_view, v_view = kv_views(cache, layer, False)
        if out is None:
            out = torch.zeros((t, hq, spec.head_dim_v), dtype=query.dtype, device=dev)
        lse = torch.full((t, hq), float("-inf"), dtype=torch.float32,
                         device=dev) if return_lse else None
        return q, k_view, v_view, out, lse
