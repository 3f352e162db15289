"""The ``kvabi`` command (``cli``) and its subcommands, one module each (``configure(parser)``
and ``run(args) -> int``); the top of kvabi's layering.

May import: util, model, layout, memory, step, transforms, backend, transfer, pd, probe, testing, bench.
"""
