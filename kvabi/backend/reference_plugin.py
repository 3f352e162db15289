"""The core plugin: registers the ``reference`` backend (entry point ``kvabi:reference``).

kvabi's registry also loads this module directly, so the oracle is present even when kvabi
runs from a source tree without installed entry points.
"""
from .hookspecs import hookimpl


@hookimpl
def kvabi_backends():
    from .reference import ReferenceBackend

    return [ReferenceBackend()]
