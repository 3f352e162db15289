"""Shared machinery of the adapters onto compiled CUDA libraries (FlashInfer, flash-attn).

An adapter is given the library as a module-like object: by default the real one,
imported on first use; tests inject an emulator with the same API, which lets the whole
adapter (translation, tensor views, output handling) run on CPU.  An injected library may
widen the capabilities with a ``kvabi_capabilities`` dict (an emulator computes in float64,
so it is not bound to the real kernels' dtypes and head sizes).
"""
from __future__ import annotations

from kvabi import Backend, Capabilities, KVABIError, UnsupportedError

from . import runtime, tensors
from .layouts import CUDA_FAMILIES, d_contiguous_presets


class LibraryBackend(Backend):
    """Base of the library adapters.  Subclasses set the class attributes below."""

    #: importable module name of the library, and the pip extra that installs it
    module: str = ""
    extra: str = ""
    #: presets listed first in preferred_layouts
    first_layouts: tuple[str, ...] = ()

    def __init__(self, library=None, device=None):
        self._library = library
        self._device_name = device

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
        super().check_supported(spec, softcap=softcap, sinks=sinks)
        if spec.kind == "chunked_local" and spec.chunk % spec.block_size:
            raise UnsupportedError(f"{self.name}: unsupported: chunked local attention runs "
                                   f"as virtual batches, which need chunk {spec.chunk} to be "
                                   f"a multiple of block_size {spec.block_size}")

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        return d_contiguous_presets(spec, first=self.first_layouts, families=CUDA_FAMILIES)

    # -- arrays ----------------------------------------------------------------------
    def device(self):
        import torch

        if self._device_name is not None:
            return torch.device(self._device_name)
        return torch.device("cuda" if runtime.cuda_status()[0] else "cpu")

    def asarray(self, x):
        return tensors.to_torch(x, self.device())

    def to_numpy(self, x):
        return tensors.to_numpy(x)

    def allocate(self, layout) -> list:
        return tensors.allocate(layout, self.device())

    def views(self, layout, cache, layer: int, spec):
        """The layer's K and V [B, N, H, D] views as a compiled library reads them: D
        contiguous, exactly head_dim wide, K and V with equal strides."""
        if layout.size("D") != spec.head_dim:
            raise UnsupportedError(f"{self.name}: layout D size {layout.size('D')} differs "
                                   f"from head_dim {spec.head_dim}")
        k, v = tensors.kv_views(layout, cache, layer, False, d_contiguous=True)
        if k.stride() != v.stride():
            raise UnsupportedError(f"{self.name}: layout {layout.name or 'custom'} gives K "
                                   f"and V different strides {k.stride()} / {v.stride()}")
        return k, v

    def check_plan(self, plan, layout, cls):
        if not isinstance(plan, cls):
            raise KVABIError(f"plan: must come from {self.name}.plan(), got "
                             f"{type(plan).__name__}")
        if layout != plan.layout:
            raise KVABIError("layout: differs from the layout the plan was built for")

    def step_tensors(self, query, cache, layout, plan, layer: int, hq: int):
        """What an attention call needs: the query on the device, the layer's K and V views,
        and the outputs to fill (zeros, lse -inf: padding tokens stay so)."""
        import torch

        spec, meta = plan.spec, plan.meta
        dev = self.device()
        q = tensors.to_torch(query, dev, spec.dtype)
        k_view, v_view = self.views(layout, cache, layer, spec)
        out = torch.zeros((meta.num_tokens, hq, spec.head_dim_v), dtype=q.dtype, device=dev)
        lse = torch.full((meta.num_tokens, hq), float("-inf"), dtype=torch.float32,
                         device=dev)
        return q, k_view, v_view, out, lse
