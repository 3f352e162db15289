"""Built-in benchmark suites for ``kvabi bench`` (each module provides ``run(argv) -> int``).

May import: util, model, layout, memory, step, transforms, backend, transfer, probe, testing.
"""
