"""The fix that goes with a KvabiConnector refusal caused by how the two engines were started.

A pull between a prefill and a decode engine that were started differently (another dtype,
another model, another tensor-parallel size) is refused by the field that differs; the
request then fails alone.  :func:`with_fix` appends what to change, so that the log line and
the refusal say it once: e.g. ``dst_layout.dtype: bfloat16 differs from the source's
float32 ...; fix: start the prefill and the decode engine with the same --dtype``.
"""
from __future__ import annotations

import re

#: (what the refusal names, the fix or None: a fault of the peer); the first match wins
FIXES = (
    (re.compile(r"shard\.(rank|ranks|heads)\b"), None),  # ranks swapped, a rank that lies
    (re.compile(r"dtype"),
     "start the prefill and the decode engine with the same --dtype (and --kv-cache-dtype)"),
    (re.compile(r"KV cache groups"),
     "serve the same model on both engines (their KV cache groups differ)"),
    (re.compile(r"sizes\.(H|D)\b|head_dim|num_kv_heads|\bhead"),
     "serve the same model, with the same tensor-parallel size, on both engines"),
)


def fix_for(message: str) -> str | None:
    """The fix for a refusal ``message``, or None when it is not about how the engines were
    started (a fault of the request or the peer: nothing to change in the configuration)."""
    for pattern, fix in FIXES:
        if pattern.search(message):
            return fix
    return None


def with_fix(message: str) -> str:
    """``message`` with ``; fix: ...`` appended where :func:`fix_for` knows one."""
    fix = fix_for(message)
    return message if fix is None or "; fix: " in message else f"{message}; fix: {fix}"
