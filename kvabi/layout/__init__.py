"""The layout descriptor: where every byte of a cache lives (``specs/layout.md``).
``descriptor`` holds :class:`Layout`; its components, axis form, checks, JSON form, block
regions, byte map, fingerprint, the anchors' presets, and every TP rank's layouts (``tp_view``).

May import: util, model.
"""
