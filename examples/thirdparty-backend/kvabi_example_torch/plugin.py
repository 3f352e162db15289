"""The pluggy hook kvabi finds through the entry point ``[project.entry-points.kvabi]``.

The function must carry ``@kvabi.hookimpl`` and be spelled ``kvabi_backends``: otherwise it
registers nothing (``kvabi backends`` then lists the plugin as refused, with the reason).
"""
import kvabi


@kvabi.hookimpl
def kvabi_backends():
    # torch is imported only when backends are listed
    from .backend import TorchSDPABackend
    from .quantized import TorchQuantBackend

    return [TorchSDPABackend(), TorchQuantBackend()]
