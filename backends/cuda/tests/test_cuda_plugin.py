"""kvabi-cuda registers through the ``kvabi`` entry-point group like a third-party plugin,
and each backend states its availability with a reason."""
import importlib.metadata

import pytest

import kvabi
from kvabi import UnsupportedError
from kvabi.backend import registry

from cuda_testlib import arr, make_step

NAMES = ("cuda.triton", "cuda.flashinfer", "cuda.flash_attn")


def test_registered_through_the_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="kvabi") if ep.name == "cuda"]
    assert len(eps) == 1 and eps[0].value == "kvabi_cuda.plugin"
    names = kvabi.backend_names()
    for n in NAMES:
        assert n in names
    assert not [r for r in registry.refused() if r.plugin == "cuda"]


def test_plugin_uses_only_public_kvabi_names():
    import pathlib
    import re

    src = pathlib.Path(__file__).resolve().parents[1] / "kvabi_cuda"
    for f in src.glob("*.py"):
        text = f.read_text()
        assert not re.search(r"kvabi\.\w*\._|from kvabi\S* import _|kvabi\._", text), f.name


def _cuda():
    import torch

    return torch.cuda.is_available()


def test_availability_reasons_here():
    ok, why = kvabi.get_backend("cuda.triton").available()
    assert ok and why
    if not _cuda():
        assert "interpreter" in why.lower()
    for name, lib in (("cuda.flashinfer", "flashinfer"), ("cuda.flash_attn", "flash_attn")):
        ok, why = kvabi.get_backend(name).available()
        if not _cuda():
            assert not ok and "no CUDA device" in why
        from kvabi_cuda.runtime import module_installed

        if not module_installed(lib):
            assert not ok and f"{lib} not installed" in why


@pytest.mark.parametrize("name", NAMES)
def test_capabilities_and_layouts(name):
    be = kvabi.get_backend(name)
    spec = make_step(query_lens=[1], context_lens=[0], dtype="float16", head_dim=64,
                     block_size=256 if name == "cuda.flash_attn" else 16).spec
    caps = be.capabilities(spec)
    assert "sliding_window" in caps.kinds and caps.softcap
    layouts = be.preferred_layouts(spec)
    assert layouts and caps.layouts == layouts
    for lay in layouts:  # every preferred layout keeps D contiguous
        assert kvabi.Layout.preset(lay, spec, 1).stride("D") == 2
    if name != "cuda.triton":
        assert "mla" not in caps.kinds and "float32" not in caps.dtypes


@pytest.mark.parametrize("name", ["cuda.flashinfer", "cuda.flash_attn"])
def test_unavailable_adapters_refuse_to_plan(name):
    be = kvabi.get_backend(name)
    if be.available()[0]:
        pytest.skip("available here")
    step = make_step(query_lens=[1], context_lens=[0], dtype="float16", head_dim=64)
    with pytest.raises(UnsupportedError, match="unavailable"):
        be.plan(step.meta, step.spec, step.layout(), num_q_heads=step.num_q_heads)


def test_triton_refuses_what_it_cannot_do():
    be = kvabi.get_backend("cuda.triton")
    step = make_step(query_lens=[2], context_lens=[1])
    layout = step.layout()
    with pytest.raises(kvabi.KVABIError, match="block_size"):
        bad = make_step(query_lens=[2], context_lens=[1], block_size=8)
        be.plan(bad.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    with pytest.raises(kvabi.KVABIError, match="query"):
        be.attention(plan, be.allocate(layout), query=arr(be, __import__("numpy").zeros((3, 3, 8))))


def test_interpreter_can_be_forbidden():
    # TRITON_INTERPRET=0 without a GPU: cuda.triton is unavailable, and says why.
    if _cuda():
        pytest.skip("a CUDA device compiles the kernels")
    import os
    import subprocess
    import sys

    code = ("import kvabi; ok, why = kvabi.get_backend('cuda.triton').available(); "
            "print(ok, why)")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.startswith("False") and "TRITON_INTERPRET=0" in out


def test_the_interpreter_holds_after_every_plugin_loaded():
    """Without a GPU and without TRITON_INTERPRET set, every kvabi plugin loaded first (as
    any backend lookup does): Triton's own library functions are interpreted too, so the
    kernels run.  A plugin that imported triton at load (transformers' continuous batching
    imports torch._dynamo, which imports triton) left them compiled-mode functions, and
    every cuda.triton attention on CPU failed inside the interpreter."""
    if _cuda():
        pytest.skip("a CUDA device compiles the kernels")
    import os
    import subprocess
    import sys

    code = ("import kvabi; kvabi.backend_names(); "
            "from kvabi_cuda.runtime import triton_mode; mode = triton_mode()[0]; "
            "import triton.language as tl; print(mode, type(tl.zeros).__name__)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.split() == ["interpret", "InterpretedFunction"], out.stdout + out.stderr
