"""tpu.jax's work split: decodes in one-row tiles, other requests in short tiles, and each
tile's keys in unmasked big and small chunks (pages every real row sees) and masked small
chunks (the rest).  With tiny tiles and one-page chunks, every split path runs on small
batches: requests spanning several tiles, windows and attention chunks whose edges fall
inside and between pages, sinks and soft cap; each result against the reference."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from test_tpu_attention import check_attention
from tpu_helpers import batches, make_spec

import kvabi

#: four-row tiles, one-page small chunks and two- to four-page big chunks
SPLIT = type(kvabi.get_backend("tpu.jax"))(fast_compile=True)
SPLIT.prefill_rows, SPLIT.chunk_tokens, SPLIT.tail_chunk_tokens = 4, 64, 16


@st.composite
def split_cases(draw):
    bs = draw(st.sampled_from((16, 32)))
    kind = draw(st.sampled_from(("full", "sliding_window", "chunked_local")))
    span = None
    if kind == "sliding_window":  # inside one page, and across several
        span = draw(st.sampled_from((3, bs + 5, 3 * bs + 1)))
    elif kind == "chunked_local":  # chunk edges inside pages, and on page edges
        span = draw(st.sampled_from((bs // 2 + 3, 2 * bs, 2 * bs + 5)))
    spec = make_spec(kind, bs, draw(st.sampled_from((1, 2))), 64,
                     draw(st.sampled_from(("float32", "bfloat16"))), span)
    meta = draw(batches(bs, max_reqs=4, max_query=11, max_context=6))
    options = {}
    if draw(st.booleans()):
        options["softcap"] = 5.0
    if draw(st.booleans()):
        options["sinks"] = True
    return spec, "tpu.combined", meta, draw(st.sampled_from((1, 4))), options, draw(
        st.integers(0, 2**16))


@settings(max_examples=25, deadline=None)
@given(split_cases())
def test_jax_split_paths_equal_reference(case):
    check_attention(SPLIT, *case)
