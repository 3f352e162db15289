"""The FlashInfer adapter's translation, checked against an emulator of FlashInfer's
documented semantics and kvabi's reference backend; planted translation errors must fail.

The emulator (tests/emulators/flashinfer_emulator.py) stands in for the library: the whole
adapter (translation, append, wrappers' plan/run, HND permutation, base-2 lse) runs on CPU.
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulators import flashinfer_emulator
from kvabi_cuda import flashinfer_backend
from kvabi_cuda.flashinfer_args import flashinfer_args
from kvabi_cuda.flashinfer_backend import FlashInferBackend

from cuda_testlib import compare, make_step, mismatch, reference, run_step, steps

EMULATED = FlashInferBackend(library=flashinfer_emulator, device="cpu")
LAYOUTS = ("flashinfer.NHD", "flashinfer.HND", "flash_attn", "vllm.LBHNC")


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps(dtypes=("float32", "float16"), layouts=LAYOUTS))
def test_adapter_through_emulator_matches_reference(step):
    compare(step, run_step(EMULATED, step), run_step(reference(), step))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps(kinds=("full", "sliding_window"), block_sizes=(1, 2, 3, 4, 8)),
       st.sampled_from(["NHD", "HND"]))
def test_translation_against_direct_formulas(step, kv_layout):
    # Independent of the emulator: the documented meaning of each argument, from the
    # metadata directly.
    meta, spec = step.meta, step.spec
    args = flashinfer_args(meta, spec, kv_layout, num_qo_heads=step.num_q_heads, scale=0.3,
                           softcap=step.softcap, sinks=step.sinks)
    p = args["plan"]
    decode = bool((meta.query_lens == 1).all()) and step.sinks is None
    assert args["wrapper"] == ("decode" if decode else "prefill")
    indptr = p["indptr" if decode else "paged_kv_indptr"]
    indices = p["indices" if decode else "paged_kv_indices"]
    last = p["last_page_len" if decode else "paged_kv_last_page_len"]
    ps = spec.block_size
    for r in range(meta.num_reqs):
        pages = indices[indptr[r]:indptr[r + 1]]
        s = int(meta.seq_lens[r])
        assert len(pages) == math.ceil(s / ps)
        assert list(pages) == list(meta.block_table[r, :len(pages)])
        kv_len = (len(pages) - 1) * ps + int(last[r]) if len(pages) else int(last[r])
        assert kv_len == s
        assert (1 <= last[r] <= ps) if len(pages) else last[r] == 0
    assert p["window_left"] == (spec.window - 1 if spec.kind == "sliding_window" else -1)
    assert p["sm_scale"] == 0.3 and p["logits_soft_cap"] == step.softcap
    assert p["num_qo_heads"] == step.num_q_heads and p["page_size"] == ps
    if not decode:
        assert p["causal"] is True
        assert list(p["qo_indptr"]) == list(meta.query_start_loc)
    if step.sinks is not None:
        assert args["run"]["sinks"].dtype == np.float32
    assert args["lse_scale"] == pytest.approx(math.log(2))
    ap = args["append"]
    a = meta.num_actual_tokens
    assert list(ap["batch_indices"]) == list(np.repeat(np.arange(meta.num_reqs),
                                                       meta.query_lens))
    assert list(ap["positions"]) == list(meta.positions[:a])
    # Every appended token lands on its slot: page * page_size + row == slot_mapping.
    page = ap["kv_indices"][ap["kv_indptr"][ap["batch_indices"]] + ap["positions"] // ps]
    np.testing.assert_array_equal(page * ps + ap["positions"] % ps, meta.slot_mapping[:a])


def test_decode_and_prefill_wrappers_both_exercised():
    dec = make_step(query_lens=[1, 1, 1], context_lens=[4, 0, 9], seed=1)
    pre = make_step(query_lens=[1, 3], context_lens=[4, 2], seed=1)
    for step, want in ((dec, "decode"), (pre, "prefill")):
        plan = EMULATED.plan(step.meta, step.spec, step.layout(), num_q_heads=step.num_q_heads)
        assert plan.prepared.planned[0]["wrapper"] == want
        compare(step, run_step(EMULATED, step), run_step(reference(), step))


def test_chunked_local_runs_as_virtual_batches():
    step = make_step("chunked_local", chunk=4, query_lens=[6, 2], context_lens=[3, 9],
                     seed=2)
    compare(step, run_step(EMULATED, step), run_step(reference(), step))


# -- planted translation errors: each must make the comparison fail ---------------------

def _plant(monkeypatch, edit):
    real = flashinfer_backend.flashinfer_args

    def planted(*a, **k):
        args = real(*a, **k)
        edit(args)
        return args

    monkeypatch.setattr(flashinfer_backend, "flashinfer_args", planted)


WINDOW = make_step("sliding_window", window=3, query_lens=[4, 1], context_lens=[6, 7],
                   seed=5)
PREFILL = make_step(query_lens=[4, 3], context_lens=[2, 5], seed=6)
DECODE = make_step(query_lens=[1, 1], context_lens=[5, 2], seed=7)


def test_planted_window_left_equal_to_w_fails(monkeypatch):
    assert not mismatch(WINDOW, EMULATED)
    _plant(monkeypatch, lambda a: a["plan"].update(window_left=a["plan"]["window_left"] + 1))
    assert mismatch(WINDOW, EMULATED)


def test_planted_missing_causal_fails(monkeypatch):
    assert not mismatch(PREFILL, EMULATED)
    _plant(monkeypatch, lambda a: a["plan"].pop("causal"))  # FlashInfer's default: False
    assert mismatch(PREFILL, EMULATED)


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("step", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_planted_last_page_len_off_by_one_fails(monkeypatch, step, delta):
    assert not mismatch(step, EMULATED)

    def edit(a):
        key = "last_page_len" if a["wrapper"] == "decode" else "paged_kv_last_page_len"
        a["plan"][key] = a["plan"][key] + delta

    _plant(monkeypatch, edit)
    assert mismatch(step, EMULATED)


def test_planted_natural_lse_fails(monkeypatch):
    # Forgetting that FlashInfer's lse is base 2.
    _plant(monkeypatch, lambda a: a.update(lse_scale=1.0))
    assert mismatch(PREFILL, EMULATED)


def test_planted_append_position_off_by_one_fails(monkeypatch):
    real = flashinfer_backend.append_args

    def planted(*a, **k):
        ap = real(*a, **k)
        ap["positions"] = np.maximum(ap["positions"] - 1, 0).astype(np.int32)
        return ap

    monkeypatch.setattr(flashinfer_backend, "append_args", planted)
    assert mismatch(PREFILL, EMULATED)


def test_unavailable_without_cuda_or_library():
    real = FlashInferBackend()
    ok, why = real.available()
    import torch

    if not torch.cuda.is_available():
        assert not ok and "no CUDA device" in why
    step = make_step(query_lens=[1], context_lens=[0], dtype="float16", head_dim=64)
    if not ok:
        with pytest.raises(Exception, match="unavailable"):
            real.plan(step.meta, step.spec, step.layout(), num_q_heads=step.num_q_heads)
