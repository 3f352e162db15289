"""``cpu.vllm`` beyond the kit: registration without importing vLLM, the reason where vLLM
cannot load, refusals of bad input with kvabi errors (a plan changed after ``plan``, a
spec whose head dim is not the layout's, an ``out=`` over the cache: each once reached the
compiled kernels), and a negative control showing that the kernels need the invisible
rows zeroed (the poisoned-rows check can fail)."""
import os
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch

import kvabi
from kvabi.testing.checks import get_check
from kvabi.testing.runner import run_check

from kvabi_vllm.cpu_backend import CpuVllmBackend

ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}


def _run(code):
    return subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                          text=True, check=True).stdout.strip().splitlines()[-1]


def test_listing_backends_does_not_import_vllm():
    code = ("import sys, kvabi_vllm; from kvabi_vllm.kvabi_plugin import kvabi_backends; "
            "names = [b.name for b in kvabi_backends()]; print(names, 'vllm' in sys.modules)")
    assert _run(code) == "['cpu.vllm'] False"


def test_unavailable_with_the_reason_where_vllm_cannot_load():
    code = ("import sys; sys.modules['vllm'] = None; import kvabi; "
            "b = kvabi.get_backend('cpu.vllm'); print(b.available())")
    out = _run(code)
    assert out.startswith("(False, ") and "not importable" in out, out


def _step(bs=16, hd=32, dtype="float32", **quant):
    spec = kvabi.KVSpec("full", block_size=bs, num_kv_heads=2, head_dim=hd, dtype=dtype,
                        **quant)
    layout = kvabi.Layout.preset("vllm.LBHNC", spec, num_blocks=4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1, 3], [5, 0], [[2, 0], [1, 3]], bs,
                                                      num_blocks=4)
    return spec, layout, meta


@pytest.mark.parametrize("change,field", [
    (dict(hd=48), "head_dim 48"), (dict(bs=8), "block_size 8"),
    (dict(dtype="int8"), "dtype"), (dict(dtype="float8_e4m3fn"), "quant 'none'"),
    (dict(dtype="float8_e4m3fn", quant="per_tensor", rounding="nearest_even"), "rounding"),
    (dict(dtype="float8_e5m2", quant="per_tensor", rounding="toward_zero"),
     "block_size 16 not a multiple of 32")])
def test_unclaimed_specs_are_refused(change, field):
    spec, layout, meta = _step(**change)
    with pytest.raises(kvabi.UnsupportedError, match=field):
        CpuVllmBackend().plan(meta, spec, layout, num_q_heads=2)


def _planned(hq: int):
    """(backend, plan for ``hq`` query heads, cache, a zero query of ``hq`` heads)."""
    b = CpuVllmBackend()
    spec, layout, meta = _step()
    plan = b.plan(meta, spec, layout, num_q_heads=hq)
    return b, plan, b.allocate(layout), torch.zeros((meta.num_tokens, hq, 32))


def test_bad_calls_raise_kvabi_errors():
    b, plan, cache, _ = _planned(4)
    spec, layout, meta = plan.spec, plan.layout, plan.meta
    q = torch.zeros((meta.num_tokens, 2, 32))
    with pytest.raises(kvabi.KVABIError, match="query: the plan was made for num_q_heads=4, "
                                               "got 2"):
        b.attention(plan, cache, query=q)
    q = torch.zeros((meta.num_tokens, 4, 32))
    with pytest.raises(kvabi.KVABIError, match="out.dtype:"):
        b.attention(plan, cache, query=q, out=torch.zeros((meta.num_tokens, 4, 32),
                                                            dtype=torch.float16))
    with pytest.raises(kvabi.KVABIError, match="sinks:"):
        b.attention(plan, cache, query=q, sinks=np.zeros(3))
    other = kvabi.get_backend("reference").plan(meta, spec, layout, num_q_heads=4)
    with pytest.raises(kvabi.KVABIError, match="plan:"):
        b.attention(other, cache, query=q)


def test_a_plan_cannot_be_changed_after_plan():
    """Block entries pointed past the cache after ``plan`` once reached the kernels (a
    segfault): the prepared arrays cannot be rebound, and a plan rebuilt around changed
    ones is not this backend's."""
    b, plan, cache, q = _planned(2)
    far = torch.full_like(plan.prepared.entries, 10**9)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.prepared.entries = far
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.meta = plan.meta
    forged = attrs.evolve(plan, prepared=attrs.evolve(plan.prepared, entries=far))
    with pytest.raises(kvabi.KVABIError, match="plan: must come from cpu.vllm.plan"):
        b.attention(forged, cache, query=q)


def test_a_head_dim_other_than_the_layouts_is_refused_at_plan():
    spec, layout, meta = _step(hd=64)
    small = kvabi.KVSpec("full", block_size=16, num_kv_heads=2, head_dim=32, dtype="float32")
    with pytest.raises(kvabi.KVABIError, match="layout.sizes.D: must equal spec.head_dim 32"):
        CpuVllmBackend().plan(meta, small, layout, num_q_heads=2)


def test_an_out_over_the_cache_is_refused():
    b, plan, cache, q = _planned(2)
    over = cache[0].view(-1)[:q.numel()].view(q.shape)
    with pytest.raises(kvabi.KVABIError, match="out: shares memory with the cache"):
        b.attention(plan, cache, query=q, out=over)
    with pytest.raises(kvabi.KVABIError, match="out: shares memory with the query"):
        b.attention(plan, cache, query=q, out=q)


class _NoZeroing(CpuVllmBackend):
    """cpu.vllm without zeroing the rows no query sees before the kernels run."""

    def prepare(self, plan):
        return attrs.evolve(super().prepare(plan), hidden=None)


def test_kernels_without_zeroed_invisible_rows_fail_the_poison_check():
    """The kernels let NaN in a block's rows past seq_len reach the output: the zeroing
    in ``to_kernel_blocks`` is needed, and ``poisoned_rows`` detects its absence."""
    r = run_check(get_check("poisoned_rows"), _NoZeroing(), max_examples=8, seed=0,
                  shrink=False, replay=None)
    assert r.status == "FAILED" and "invisible rows" in r.message, r


@pytest.mark.parametrize("dtype,bs,hd,window", [("float32", 32, 64, None),
                                                ("bfloat16", 16, 80, 7)])
def test_same_bits_as_the_kernels_called_the_way_vllm_calls_them(dtype, bs, hd, window):
    """Over the cache vLLM's own CPU backend would hold (written by the kernels' own
    reshape-and-cache), the kernels give exactly what cpu.vllm gives over a kvabi cache."""
    from vllm import _custom_ops as ops

    from kvabi_vllm.cpu_layout import choose_isa, kernel_scratch

    kind = "full" if window is None else "sliding_window"
    spec = kvabi.KVSpec(kind, block_size=bs, num_kv_heads=2, head_dim=hd, dtype=dtype,
                        **({} if window is None else {"window": window}))
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [1, 5, 1], [40, 0, 3], [[3, 1, 4], [0, 0, 0], [2, 5, 0]], bs, num_blocks=6)
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(meta.num_tokens, hq, hd, generator=g).to(tdt)
               for hq in (4, 2, 2))
    slots = torch.from_numpy(meta.slot_mapping.copy())
    _, kc, vc = kernel_scratch(torch, 6, 2, bs, hd, tdt)
    kc.zero_(), vc.zero_()
    isa = choose_isa(hd, bs)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    qsl = torch.from_numpy(meta.query_start_loc.copy())
    seq = torch.from_numpy(meta.seq_lens.copy())
    w = -1 if window is None else window
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=3, num_heads=4, num_kv_heads=2, head_dim=hd, seq_lens=seq, dtype=tdt,
        query_start_loc=qsl, causal=True, sliding_window_size=w, isa=isa,
        enable_kv_split=False)
    want = torch.zeros_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=kc, value_cache=vc, output=want, query_start_loc=qsl,
        seq_lens=seq, scale=0.3, causal=True, alibi_slopes=None, sliding_window=w,
        block_table=torch.from_numpy(meta.block_table.copy()), softcap=0.0,
        scheduler_metadata=md, s_aux=None)
    b = CpuVllmBackend()
    for name in ("vllm.cpu_kt", "vllm.LBHNC"):
        layout = kvabi.Layout.preset(name, spec, num_blocks=6)
        cache = b.allocate(layout)
        plan = b.plan(meta, spec, layout, num_q_heads=4, scale=0.3)
        b.write_kv(plan, cache, key=k, value=v)
        got = b.attention(plan, cache, query=q)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
