"""The flash-attn adapter's translation, checked against an emulator of flash-attn's
documented varlen paged semantics and kvabi's reference backend; planted translation errors
must fail."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from emulators import flash_attn_emulator
from kvabi_cuda import flash_attn_backend
from kvabi_cuda.flash_attn_args import flash_attn_args
from kvabi_cuda.flash_attn_backend import FlashAttnBackend

from cuda_testlib import compare, make_step, mismatch, reference, run_step, steps

EMULATED = FlashAttnBackend(library=flash_attn_emulator, device="cpu")


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps(dtypes=("float32", "float16"), layouts=("flash_attn", "flashinfer.NHD",
                                                      "vllm.BLHNC"), allow_sinks=False))
def test_adapter_through_emulator_matches_reference(step):
    compare(step, run_step(EMULATED, step), run_step(reference(), step))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps(kinds=("full", "sliding_window"), block_sizes=(1, 2, 3, 4, 8),
             allow_sinks=False))
def test_translation_against_direct_formulas(step):
    meta, spec = step.meta, step.spec
    args = flash_attn_args(meta, spec, scale=0.7, softcap=step.softcap)
    np.testing.assert_array_equal(args["cu_seqlens_q"], meta.query_start_loc)
    np.testing.assert_array_equal(np.diff(args["cu_seqlens_k"]), meta.seq_lens)
    np.testing.assert_array_equal(args["seqused_k"], meta.seq_lens)
    assert args["max_seqlen_q"] == meta.query_lens.max()
    assert args["max_seqlen_k"] == meta.seq_lens.max()
    assert args["causal"] is True and args["softmax_scale"] == 0.7
    assert args["softcap"] == (step.softcap or 0.0)
    w = spec.window - 1 if spec.kind == "sliding_window" else -1
    assert args["window_size"] == (w, 0 if w >= 0 else -1)
    bt = args["block_table"]
    assert bt.dtype == np.int32
    # Every key position of every request resolves to the block kvabi's table names.
    for r in range(meta.num_reqs):
        j = np.arange(int(meta.seq_lens[r]))
        np.testing.assert_array_equal(bt[r, j // spec.block_size],
                                      meta.block_table[r, j // spec.block_size])


def test_chunked_local_runs_as_virtual_batches():
    step = make_step("chunked_local", chunk=4, query_lens=[7, 1], context_lens=[2, 9],
                     seed=3)
    compare(step, run_step(EMULATED, step), run_step(reference(), step))


def test_capabilities_state_flash_attn_2_constraints():
    real = FlashAttnBackend()
    caps = real.capabilities(make_step(query_lens=[1], context_lens=[0]).spec)
    assert caps.block_size_multiple == 256 and not caps.sinks
    spec = make_step(query_lens=[1], context_lens=[0], block_size=16, dtype="float16",
                     head_dim=64).spec
    assert any("multiple of 256" in r for r in caps.refusals(spec))


# -- planted translation errors: each must make the comparison fail ---------------------

def _plant(monkeypatch, edit):
    real = flash_attn_backend.flash_attn_args

    def planted(*a, **k):
        args = real(*a, **k)
        edit(args)
        return args

    monkeypatch.setattr(flash_attn_backend, "flash_attn_args", planted)


WINDOW = make_step("sliding_window", window=3, query_lens=[4, 1], context_lens=[6, 7],
                   seed=5)
PREFILL = make_step(query_lens=[4, 3], context_lens=[2, 5], seed=6)


def test_planted_window_equal_to_w_fails(monkeypatch):
    assert not mismatch(WINDOW, EMULATED)
    _plant(monkeypatch, lambda a: a.update(window_size=(a["window_size"][0] + 1, 0)))
    assert mismatch(WINDOW, EMULATED)


def test_planted_missing_causal_fails(monkeypatch):
    assert not mismatch(PREFILL, EMULATED)
    _plant(monkeypatch, lambda a: a.update(causal=False))
    assert mismatch(PREFILL, EMULATED)


@pytest.mark.parametrize("delta", [1, -1])
def test_planted_key_length_off_by_one_fails(monkeypatch, delta):
    def edit(a):
        a["cu_seqlens_k"] = (a["cu_seqlens_k"] + delta * np.arange(len(a["cu_seqlens_k"]))
                             ).astype(np.int32)
        a["max_seqlen_k"] += max(delta, 0)

    _plant(monkeypatch, edit)
    assert mismatch(PREFILL, EMULATED)


def test_planted_max_seqlen_q_too_small_fails(monkeypatch):
    _plant(monkeypatch, lambda a: a.update(max_seqlen_q=a["max_seqlen_q"] - 1))
    assert mismatch(PREFILL, EMULATED)


def test_unavailable_without_cuda_or_library():
    import torch

    ok, why = FlashAttnBackend().available()
    if not torch.cuda.is_available():
        assert not ok and "no CUDA device" in why
