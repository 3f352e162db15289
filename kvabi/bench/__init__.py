"""Built-in benchmark suites for ``kvabi bench`` (each module provides ``run(argv) -> int``)."""
