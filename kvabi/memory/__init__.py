"""Cache memory: the :class:`KVCache` handle (``cache``), plane checks at entry and at use
(``planes``), per-layer and per-component views (``views``), and how many blocks a byte
budget holds (``planning``).

May import: util, model, layout.
"""
