"""The backend contract of both TPU backends: registration, availability, capabilities,
refusals with KVABIError naming the field, and functional (or donated) writes."""
from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

from tpu_helpers import JAX, PALLAS, filled_cache, make_spec, to_backend, values

import kvabi
from kvabi.util.tensors import to_jax, to_numpy
from kvabi import KVABIError, UnsupportedError
from kvabi_tpu.env import on_tpu
from kvabi_tpu.jax_backend import JaxBackend

BACKENDS = [PALLAS, JAX]
ids = lambda b: b.name  # noqa: E731


def test_registered_through_the_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group="kvabi") if ep.name == "tpu"]
    assert [ep.value for ep in eps] == ["kvabi_tpu.plugin"]
    names = kvabi.backend_names()
    assert "tpu.pallas" in names and "tpu.jax" in names


def test_available_names_the_mode():
    ok, why = kvabi.get_backend("tpu.pallas").available()
    assert ok
    if on_tpu():
        assert "natively" in why
    else:
        assert "interpret mode" in why and "no TPU" in why
    ok, why = kvabi.get_backend("tpu.jax").available()
    assert ok and why.startswith("jax ")


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_capabilities_are_honest(backend):
    caps = backend.capabilities(None)
    assert set(caps.kinds) == {"full", "sliding_window", "chunked_local"}
    assert set(caps.dtypes) == {"float32", "bfloat16"}
    assert caps.softcap and caps.sinks
    spec = make_spec("full", 16, 1, 64, "bfloat16")
    assert backend.preferred_layouts(spec) == ("tpu.combined", "tpu.hidden")
    for bad in (kvabi.KVSpec("mla", 16, 1, 96, "bfloat16", head_dim_v=64),
                make_spec("full", 16, 2, 64, "float8_e4m3fn"),
                make_spec("full", 16, 2, 64, "float16")):
        with pytest.raises(UnsupportedError):
            backend.check_supported(bad)


def test_pallas_page_size_must_be_a_multiple_of_the_packing():
    spec = make_spec("full", 5, 2, 64, "bfloat16")  # bf16 packs 2 per word
    with pytest.raises(UnsupportedError, match="block_size 5 not a multiple of 2"):
        PALLAS.check_supported(spec)
    layout = kvabi.Layout.preset("tpu.combined", spec, 4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([3], [0], [[0]], 5, num_blocks=4)
    with pytest.raises(KVABIError, match="block_size"):
        PALLAS.plan(meta, spec, layout, num_q_heads=2)
    # tpu.jax has no such constraint but the combined form does: only hidden is preferred
    assert JAX.preferred_layouts(spec) == ("tpu.hidden",)
    JAX.check_supported(spec)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_refuses_layouts_it_cannot_hold(backend):
    spec = make_spec("full", 16, 2, 64, "float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths([3], [0], [[0]], 16, num_blocks=4)
    for name in ("flash_attn", "flashinfer.HND", "vllm.LBHNC"):
        with pytest.raises(UnsupportedError, match="layout"):
            backend.plan(meta, spec, kvabi.Layout.preset(name, spec, 4), num_q_heads=2)
    padded = kvabi.KVSpec("full", 16, 2, 64, "float32", page_align=40000)
    with pytest.raises(UnsupportedError, match="strides"):
        backend.allocate(kvabi.Layout.preset("tpu.combined", padded, 4))


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_bad_arguments_name_the_field(backend):
    spec = make_spec("full", 16, 2, 64, "float32")
    layout = kvabi.Layout.preset("tpu.combined", spec, 4)
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 1], [0, 4], [[0], [1]], 16,
                                                      num_blocks=4)
    plan = backend.plan(meta, spec, layout, num_q_heads=2)
    cache = backend.allocate(layout)
    assert [tuple(p.shape) for p in cache] == [layout.plane_shape]
    k = to_jax(np.zeros((4, 2, 64), np.float32))
    with pytest.raises(KVABIError, match="key"):
        backend.write_kv(plan, cache, key=k[:3], value=k)
    with pytest.raises(KVABIError, match="value"):
        backend.write_kv(plan, cache, key=k, value=None)
    with pytest.raises(KVABIError, match="query"):
        backend.attention(plan, cache, query=to_jax(np.zeros((4, 3, 64), np.float32)))
    # the one wording of kvabi.check_layer, as every backend
    with pytest.raises(KVABIError, match=r"^layer: 1 out of range \[0, 1\)$"):
        backend.attention(plan, cache, query=to_jax(np.zeros((4, 2, 64), np.float32)),
                          layer=1)
    with pytest.raises(KVABIError, match=r"^layer: 1 out of range \[0, 1\)$"):
        backend.write_kv(plan, cache, key=k, value=k, layer=1)
    with pytest.raises(KVABIError, match="cache"):
        backend.write_kv(plan, cache + cache, key=k, value=k)
    with pytest.raises(KVABIError, match="sinks"):
        backend.plan(meta, spec, layout, num_q_heads=2, sinks=np.zeros(3))
    with pytest.raises(KVABIError, match="softcap"):
        backend.plan(meta, spec, layout, num_q_heads=2, softcap=-1.0)
    with pytest.raises(KVABIError, match="block_table"):
        backend.plan(meta, spec, kvabi.Layout.preset("tpu.combined", spec, 1), num_q_heads=2)
    with pytest.raises(KVABIError, match="plan"):
        backend.write_kv(object(), cache, key=k, value=k)


def test_writes_donate_by_default_and_copy_on_request():
    """By default the written planes are consumed (donated, updated in place); with
    donate_cache=False the argument stays valid; both give the same cache."""
    spec = make_spec("full", 16, 2, 64, "float32")
    layout = kvabi.Layout.preset("tpu.hidden", spec, 6)
    meta = kvabi.CommonAttentionMetadata.from_lengths([5, 1], [0, 20], [[3, 0], [1, 4]], 16,
                                                      num_blocks=6)
    rng = np.random.default_rng(0)
    planes = filled_cache(layout, spec, rng)
    k = values(rng, (6, 2, 64), "float32")
    copier = JaxBackend(donate_cache=False)
    kept = to_backend(copier, planes)
    want = copier.write_kv(copier.plan(meta, spec, layout, num_q_heads=2), kept, key=k,
                           value=k)
    assert not any(p.is_deleted() for p in kept)
    for p, w in zip(kept, planes):
        assert np.array_equal(np.asarray(p), w)
    assert JAX.donate_cache and PALLAS.donate_cache
    cache = to_backend(JAX, planes)
    got = JAX.write_kv(JAX.plan(meta, spec, layout, num_q_heads=2), cache, key=k, value=k)
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w))
    assert all(p.is_deleted() for p in cache)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_empty_step(backend):
    spec = make_spec("full", 16, 1, 64, "float32")
    layout = kvabi.Layout.preset("tpu.combined", spec, 2)
    meta = kvabi.CommonAttentionMetadata.from_lengths([], [], np.zeros((0, 0), int), 16,
                                                      num_blocks=2)
    plan = backend.plan(meta, spec, layout, num_q_heads=2)
    cache = backend.allocate(layout)
    z = to_jax(np.zeros((0, 1, 64), np.float32))
    assert backend.write_kv(plan, cache, key=z, value=z)[0] is cache[0]
    out, lse = backend.attention(plan, cache, query=to_jax(np.zeros((0, 2, 64), np.float32)),
                                 return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_bench_suite_runs_and_reports_json(capsys):
    import json

    from kvabi_tpu.bench import run

    assert run(["--quick", "--json", "--reqs", "3", "--tokens", "9", "--context", "20",
                "--kv-heads", "1", "--q-heads", "2", "--head-dim", "64", "--repeat", "1",
                "--big-mib", "2", "--steps", "12", "--baseline", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    steady = report["steady_state"]
    lim = steady["limits"]  # from --tokens, --reqs, --context (as --quick leaves them)
    assert (lim["max_tokens"], lim["max_reqs"]) == (report["batch"]["query_tokens"],
                                                    report["batch"]["num_reqs"])
    assert steady["token_buckets"][-1] == lim["max_tokens"]
    assert steady["steps"] == len(steady["step_ms"]) == 12
    assert steady["compiles_after_warmup"] == 0 and steady["baseline"]["steps"] == 2
    assert steady["max_over_median"] >= 1 and steady["max_over_work_fit"] > 0
    from kvabi_tpu.bench_steps import report as steady_lines

    text = "\n".join(steady_lines(steady))
    assert "goal: 0 compiles after warm-up; measured: 0" in text
    assert "goal: every step within 3x of the median; measured: slowest" in text
    assert "FAIL" not in text and "NOT met" not in text
    assert report["suite"] == "tpu"
    names = [r["backend"] for r in report["results"]]
    assert names[:2] == ["tpu.jax", "reference"]
    for r in report["results"]:
        assert r["attention_tokens_per_s"] > 0 and r["write_tokens_per_s"] > 0
    sizes = [r["cache_mib"] for r in report["write_scaling"]]
    assert sizes == [1.0, 2.0]
    for r in report["write_scaling"]:
        assert r["tokens"] == 64 and r["in_place_ms"] > 0 and r["copy_ms"] > 0
    with pytest.raises(SystemExit):
        run(["--big-mib", "0"])
    with pytest.raises(SystemExit):
        run(["--steps", "-1"])


def test_without_jax_the_backends_register_as_unavailable():
    """Listing backends must not need jax: both register and say why they are unusable."""
    import subprocess
    import sys

    code = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'jax' or name.startswith('jax.'):\n"
        "        raise ImportError('jax hidden')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "import kvabi\n"
        "for n in ('tpu.pallas', 'tpu.jax'):\n"
        "    print(n, *kvabi.get_backend(n).available())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["tpu.pallas False jax not importable: ImportError: jax hidden",
                   "tpu.jax False jax not importable: ImportError: jax hidden"]
