"""Small shared helpers every other part uses: the exception (``errors``), strict input types
(``coerce``, ``argtypes``), dtypes and tensor conversion (``dtypes``, ``tensors``), immutable
containers (``frozen``), the untrusted JSON reader (``safe_json``) and version numbers.

May import: nothing of kvabi.
"""
