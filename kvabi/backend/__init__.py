"""The backend boundary: the :class:`Backend` base class that runs every check (``base``),
what a backend computes (``capabilities``), the pluggy hooks (``hookspecs``), the plugin
registry (``registry``) and the numpy float64 ``reference`` oracle backend.

May import: util, model, layout, memory, step.
"""
