"""Layouts proven, not declared: infer and verify the byte layout an engine's own cache
write produces (``specs/layout.md``, "Inference and verification").

- :func:`infer_layout` writes marked tokens through the engine's ``write`` into its
  poisoned planes, reads the bytes back and fits the :class:`~kvabi.Layout` (a preset when
  one matches) that places every element there;
- :func:`verify_layout` checks a declared layout with a few writes;
- :func:`verify_quantized` checks where a quantizing write puts values and scales;
- :func:`placement_difference` says whether two layouts place every element alike;
- :func:`backend_writer` makes a kvabi backend's ``write_kv`` the probe's ``write``.

May import: util, model, layout, memory, step.
"""
from .backend import backend_writer
from .compare import placement_difference, same_placement
from .infer import infer_layout
from .quantized import verify_quantized
from .verify import verify_layout

__all__ = ["backend_writer", "infer_layout", "placement_difference", "same_placement",
           "verify_layout", "verify_quantized"]
