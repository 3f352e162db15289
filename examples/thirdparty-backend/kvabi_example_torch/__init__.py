"""A worked third-party kvabi backend: paged attention in plain torch on CPU.

It uses only kvabi's public names, as any out-of-tree backend must; see ``backend.py``
for the three methods a backend writes and ``plugin.py`` for the registration.
"""
from .backend import TorchPlan, TorchSDPABackend

__all__ = ["TorchPlan", "TorchSDPABackend"]
