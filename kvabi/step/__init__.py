"""One step: the backend-neutral attention metadata (``metadata``), the checks that metadata,
spec, layout and tensors belong together (``checks``), the step plan (``plan``), the limits
an engine declares (``limits``), and the log-sum-exp merge of partial attention (``merge``).

May import: util, model, layout, memory.
"""
