"""The kit's ``quantize`` check catches every planted quantization mistake under the
default profile (``ci``: its seed, its 8 examples, its time budget), and names it.

The planted backends (tests/plugins/kvabi_planted_quant.py) quantize with a recipe written
from ``specs/semantics.md`` 11.1 independently of ``kvabi.model.quant``, each with one step
changed: ties to even where nearest_away is claimed, half-away rounded exactly, ``x / s``
instead of ``x * fl32(1 / s)`` (int8 and e4m3), saturation to [-127, 127], none, or after
rounding, scales stored as bfloat16, computed through ``fl32(1 / QMAX)``, one per token, or
floored on the absmax, e4m3's subnormals truncated unsnapped, float8 converted through
bfloat16, a subnormal reciprocal flushed, the sign of a negative zero, and a dynamic scale
where a static one is given.  The correct recipe passes.  A sweep over seeds shows the
values the check draws tell every mistake from the recipe, whatever the seed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi.testing import get_check, run_check
from kvabi.testing.boundaries import head_rows, tensor_scales, tensor_values
from kvabi.testing.profiles import KIT_EXAMPLES, current_profile

sys.path.insert(0, str(Path(__file__).parent / "plugins"))
import kvabi_planted_quant as pq  # noqa: E402


def _quantize(backend):
    return run_check(get_check("quantize"), backend, shrink=False, replay=None)


def test_the_correct_recipe_passes_every_claim():
    res = _quantize(pq.QuantBackend())
    assert res.status == "passed", res.message
    assert res.examples >= 2
    drawn = {(d, q, r) for (_, d, q, r, _) in res.coverage.drawn}
    # every claim is drawn in every example: per_tensor and per_token_head, each rounding
    assert ("int8", "per_tensor", "nearest_away") in drawn
    assert ("int8", "per_token_head", "nearest_away") in drawn
    assert ("float8_e4m3fn", "per_tensor", "toward_zero") in drawn
    assert ("float8_e4m3fn", "per_token_head", "nearest_even") in drawn
    assert ("float8_e5m2", "per_tensor", "nearest_even") in drawn


@pytest.mark.parametrize("bug, phrase", pq.FAULTS, ids=[c.__name__ for c, _ in pq.FAULTS])
def test_every_planted_mistake_fails_the_default_profile(bug, phrase):
    res = _quantize(bug())
    assert res.failed, f"{bug.__name__} passed quantize in {res.examples} examples"
    assert res.profile == "ci" and res.seed == 0
    assert res.examples <= KIT_EXAMPLES["ci"]
    assert res.message.startswith("ConformanceFailure: quantize "), res.message
    if phrase is not None:
        assert phrase in res.message and " gives." in res.message, res.message
    assert "input" in res.message or "stored scale" in res.message


SWEEP = {"ci": 3, "quick": 2, "thorough": 60}
ROUNDINGS = {"int8": ("nearest_even", "nearest_away"),
             "float8_e4m3fn": ("nearest_even", "toward_zero"),
             "float8_e5m2": ("nearest_even", "toward_zero")}


def _differs(bug, dtype, quant, rounding, x, static=None) -> bool:
    good = pq.QuantBackend().store(x, dtype, quant, rounding, static)
    bad = bug().store(x, dtype, quant, rounding, static)
    same = all(np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                              np.ascontiguousarray(b).view(np.uint8))
               for a, b in zip(good, bad) if a is not None)
    return not same


@settings(max_examples=SWEEP[current_profile()], deadline=None, derandomize=False)
@given(seed=st.integers(0, 2**32 - 1), width=st.sampled_from([4, 16, 64]))
def test_drawn_values_tell_every_mistake_from_the_recipe(seed, width):
    """For every planted mistake and every claim it makes, the values one example draws
    (under its scales) store something else than the recipe does."""
    for bug, _ in pq.FAULTS:
        for dtype in bug.DTYPES:
            for quant in bug.QUANT:
                for rounding in bug.ROUNDINGS:
                    if rounding not in ROUNDINGS[dtype]:
                        continue
                    rng = np.random.default_rng(seed)
                    if quant == "per_token_head":  # tokens of two heads
                        rows = head_rows(dtype, rounding, width, rng)
                        rows = np.resize(rows, (-(-len(rows) // 2) * 2, width))
                        found = _differs(bug, dtype, quant, rounding,
                                         rows.reshape(-1, 2, width))
                    else:
                        sc = tensor_scales(dtype, rounding, rng)
                        found = any(_differs(bug, dtype, quant, rounding,
                                             _rows(tensor_values(dtype, rounding, s, rng),
                                                   width), s)
                                    for s in sc)
                    assert found, (bug.__name__, dtype, quant, rounding, seed)


def _rows(x, width):
    n = -(-x.size // width) * width
    return np.resize(x, n).reshape(-1, 1, width)
