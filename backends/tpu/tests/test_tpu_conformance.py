"""The kvabi conformance kit against both TPU backends (every check of the kit).

Example counts are calibrated for CI on two cores: tpu.pallas runs interpreted here
(seconds per new shape), so it gets two examples per check in this suite (the first being
the minimal one); ``kvabi conformance tpu.pallas`` runs the kit's full example count.
"""
from __future__ import annotations

from kvabi.testing import BackendConformance

from kvabi_tpu.env import on_tpu
from kvabi_tpu.jax_backend import JaxBackend


class TestJaxConformance(BackendConformance):
    backend_name = "tpu.jax"
    max_examples = 3

    def make_backend(self):
        # the registered backend, compiled cheaply: each example has new shapes
        return JaxBackend(fast_compile=True)


class TestPallasConformance(BackendConformance):
    backend_name = "tpu.pallas"
    max_examples = None if on_tpu() else 2
    # Every check, poisoned_per_query included (about 16 s of the class here, interpreted;
    # test_tpu_poisoned_rows.py checks the same per-query property on fixed batches).
