"""A worked third-party kvabi backend: paged attention in plain torch on CPU.

It uses only kvabi's public names, as any out-of-tree backend must; see ``backend.py``
for the three methods a backend writes, ``quantized.py`` for the same backend over int8 and
float8 caches (``example.torch_quant``), and ``plugin.py`` for the registration.
"""
from .backend import TorchPlan, TorchSDPABackend
from .quantized import TorchQuantBackend

__all__ = ["TorchPlan", "TorchQuantBackend", "TorchSDPABackend"]
