"""Memory planning, parse_bytes and the ``kvabi plan`` command."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi import KVABIError, KVSpec, LayerKV, ModelKV
from kvabi.commands import plan as plan_cmd
from kvabi.util.dtypes import DTYPE_BITS
from kvabi.memory.planning import parse_bytes, plan_memory

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
GiB = 1 << 30


def cdiv(a, b):
    return -(-a // b)


def page_bytes(s: KVSpec) -> int:
    """Direct formula: block_size tokens x (K+V heads, or one latent row), padded."""
    per_token = (s.head_dim if s.kind == "mla" else s.num_kv_heads * (s.head_dim + s.head_dim_v))
    raw = s.block_size * per_token * DTYPE_BITS[s.dtype] // 8
    return cdiv(raw, s.page_align) * s.page_align


def blocks_needed(s: KVSpec, length: int, q: int) -> int:
    full = cdiv(length, s.block_size)
    span = s.window if s.kind == "sliding_window" else s.chunk
    return full if span is None else min(full, cdiv(span - 1 + q, s.block_size) + 1)


# ---- parse_bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("16GiB", 16 * 2**30), ("16 GiB", 16 * 2**30), ("16gib", 16 * 2**30),
    ("512MiB", 512 * 2**20), ("3KiB", 3 * 1024), ("2TiB", 2 * 2**40),
    ("80GB", 80 * 10**9), ("1.5GB", 1_500_000_000), ("1.1GB", 1_100_000_000),
    ("7KB", 7000), ("5MB", 5 * 10**6), ("4096", 4096), ("10B", 10), (4096, 4096),
    ("0.5KiB", 512), (".5KiB", 512), ("1.0000001KiB", 1024),
])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


def test_parse_bytes_takes_numpy_and_torch_integers():
    torch = pytest.importorskip("torch")
    for n in (np.int64(4096), np.uint32(4096), torch.tensor(4096)):
        got = parse_bytes(n)
        assert got == 4096 and type(got) is int
    for bad in (np.float64(4096), torch.tensor(4096.0), np.int64(-1), np.bool_(True)):
        with pytest.raises(KVABIError, match="^memory"):
            parse_bytes(bad)


@pytest.mark.parametrize("text", ["", "GiB", "16XB", "-1GiB", "1e9", "16 GiB extra",
                                  "16G", "1,000", None, 1.5, True, -3, "nan"])
def test_parse_bytes_rejects_garbage(text):
    with pytest.raises(KVABIError, match="memory"):
        parse_bytes(text)


# ---- plans of real configs --------------------------------------------------------------

def test_llama3_plan_by_formula():
    model = ModelKV.from_hf_config(CONFIGS / "llama-3-8b.json")
    p = plan_memory(model, 16 * GiB, max_model_len=8192)
    page = 16 * 8 * 2 * 128 * 2  # tokens x heads x (K,V) x dims x bytes
    blocks = 16 * GiB // (32 * page)
    (g,) = p.groups
    assert (g.kind, g.page_bytes, g.num_blocks, len(g.layers)) == ("full", page, blocks, 32)
    assert p.used_bytes == g.bytes == blocks * page * 32 <= 16 * GiB
    assert p.max_tokens == blocks * 16
    assert p.context_bounded
    assert p.max_concurrent_requests == blocks // cdiv(8192, 16)


def test_gemma3n_plan_shared_layers_cost_nothing():
    model = ModelKV.from_hf_config(CONFIGS / "gemma-3n-e4b.json")
    p = plan_memory(model, 4 * GiB)
    page = 16 * 2 * 2 * 256 * 2
    owners = 35 - 15
    blocks = 4 * GiB // (owners * page)
    assert [g.num_blocks for g in p.groups] == [blocks, blocks]
    assert sum(len(g.layers) for g in p.groups) == owners
    assert p.used_bytes == blocks * page * owners
    assert p.prefill_skip_layers == tuple(f"layers.{i}" for i in range(20, 35))
    assert set(p.shared_layers) == set(p.prefill_skip_layers)
    assert p.max_concurrent_requests is None


def test_all_windowed_model_is_not_context_bounded():
    model = ModelKV.from_hf_config(CONFIGS / "mistral-7b-v0.1.json")
    p = plan_memory(model, 2 * GiB, max_model_len=32768)
    (g,) = p.groups
    assert not p.context_bounded
    assert p.max_tokens == g.num_blocks * 16
    # a request holds only the blocks covering its 4096-token window
    assert p.max_concurrent_requests == g.num_blocks // (cdiv(4095 + 1, 16) + 1)


def test_demand_scheme_admits_more_long_requests_for_mostly_windowed_models():
    model = ModelKV.from_hf_config(CONFIGS / "gemma-3-27b.json")
    eq = plan_memory(model, 40 * GiB, max_model_len=131072)
    dm = plan_memory(model, 40 * GiB, max_model_len=131072, scheme="demand")
    assert dm.max_concurrent_requests > eq.max_concurrent_requests
    assert dm.used_bytes <= 40 * GiB and eq.used_bytes <= 40 * GiB


# ---- never over budget (property) -------------------------------------------------------

@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["full", "sliding_window", "chunked_local", "mla"]))
    hd = draw(st.integers(1, 12))
    return KVSpec(kind, draw(st.sampled_from([1, 2, 4, 16])),
                  1 if kind == "mla" else draw(st.integers(1, 4)), hd,
                  dtype=draw(st.sampled_from(sorted(DTYPE_BITS))),
                  head_dim_v=draw(st.integers(1, hd)),
                  window=draw(st.integers(1, 40)) if kind == "sliding_window" else None,
                  chunk=draw(st.integers(1, 40)) if kind == "chunked_local" else None,
                  page_align=draw(st.sampled_from([1, 64, 256])))


@st.composite
def models(draw):
    pool = draw(st.lists(specs(), min_size=1, max_size=3))
    layers: list[LayerKV] = []
    for i in range(draw(st.integers(1, 7))):
        if layers and draw(st.booleans()):
            target = draw(st.sampled_from(layers))
            layers.append(LayerKV(f"l{i}", target.spec, target.name))
        else:
            layers.append(LayerKV(f"l{i}", draw(st.sampled_from(pool))))
    return ModelKV(layers)


@settings(max_examples=300, deadline=None)
@given(models(), st.integers(1, 1 << 16), st.one_of(st.none(), st.integers(1, 300)),
       st.integers(1, 8), st.sampled_from(["equal", "demand"]))
def test_plan_never_exceeds_budget(model, budget, max_len, q, scheme):
    owners = [l for l in model.layers if l.shares is None]
    by_spec: dict = {}
    for l in owners:
        by_spec.setdefault(l.spec, []).append(l.name)
    stride = sum(page_bytes(s) * len(names) for s, names in by_spec.items())
    if scheme == "demand" and max_len is None:
        with pytest.raises(KVABIError, match="max_model_len"):
            plan_memory(model, budget, max_len, q, scheme)
        return
    if scheme == "demand":
        need = {s: blocks_needed(s, max_len, q) for s in by_spec}
        per_request = sum(need[s] * page_bytes(s) * len(n) for s, n in by_spec.items())
        if budget < per_request:
            with pytest.raises(KVABIError, match="memory_bytes"):
                plan_memory(model, budget, max_len, q, scheme)
            return
    elif budget < stride:
        with pytest.raises(KVABIError, match="memory_bytes"):
            plan_memory(model, budget, max_len, q, scheme)
        return

    p = plan_memory(model, budget, max_len, q, scheme)
    assert {g.spec: list(g.layers) for g in p.groups} == by_spec  # shared layers cost 0
    used = 0
    for g in p.groups:
        assert g.page_bytes == page_bytes(g.spec)
        assert g.bytes == g.num_blocks * page_bytes(g.spec) * len(g.layers)
        used += g.bytes
    assert p.used_bytes == used <= budget
    assert budget - used < stride or scheme == "demand"  # equal: nothing more fits
    if scheme == "equal":
        assert len({g.num_blocks for g in p.groups}) == 1
    else:
        requests = budget // per_request
        assert all(g.num_blocks >= requests * need[g.spec] for g in p.groups)
        assert budget - used < stride + per_request
    if max_len is not None:
        assert p.max_concurrent_requests == min(
            g.num_blocks // blocks_needed(g.spec, max_len, q) for g in p.groups)
        if scheme == "demand":
            assert p.max_concurrent_requests >= 1
    unbounded = [g for g in p.groups if g.spec.span is None]
    assert p.context_bounded == bool(unbounded)
    assert p.max_tokens == min(g.num_blocks * g.spec.block_size
                               for g in (unbounded or p.groups))


@pytest.mark.parametrize("kwargs,field", [
    ({"memory_bytes": 0}, "memory_bytes"), ({"memory_bytes": -1}, "memory_bytes"),
    ({"memory_bytes": True}, "memory_bytes"), ({"memory_bytes": 1.0e9}, "memory_bytes"),
    ({"memory_bytes": 1}, "memory_bytes"), ({"max_model_len": 0}, "max_model_len"),
    ({"max_query_len": 0}, "max_query_len"), ({"scheme": "greedy"}, "scheme"),
    ({"scheme": "demand"}, "max_model_len"), ({"max_model_len": True}, "max_model_len"),
    ({"max_model_len": 4096.0}, "max_model_len"), ({"max_query_len": True}, "max_query_len"),
    ({"memory_bytes": 2**63}, "memory_bytes"), ({"scheme": ["equal"]}, "scheme"),
])
def test_plan_rejects_bad_arguments(kwargs, field):
    model = ModelKV([LayerKV("a", KVSpec("full", 16, 2, 8))])
    args = {"memory_bytes": GiB, **kwargs}
    with pytest.raises(KVABIError, match=f"^{field}"):
        plan_memory(model, **args)


# ---- the command --------------------------------------------------------------------------

def run_cli(argv, capsys):
    parser = argparse.ArgumentParser()
    plan_cmd.configure(parser)
    assert plan_cmd.run(parser.parse_args(argv)) == 0
    return capsys.readouterr().out


def test_cli_json_one_config_is_an_object(capsys):
    path = str(CONFIGS / "gemma-3n-e4b.json")
    d = json.loads(run_cli([path, "--memory", "1GiB", "--json"], capsys))
    assert d["config"] == path and d["layers"] == 35
    assert d["kv_bytes_per_token"] == 20 * 2 * 2 * 256 * 2
    assert [g["kind"] for g in d["groups"]] == ["sliding_window", "full"]
    blocks = GiB // (20 * 16 * 2 * 2 * 256 * 2)
    for g in d["groups"]:
        assert g["page_bytes"] == 16 * 2 * 2 * 256 * 2 and g["num_blocks"] == blocks
    assert sorted(d["shared_layers"]) == sorted(f"layers.{i}" for i in range(20, 35))
    assert d["prefill_skip_layers"] == [f"layers.{i}" for i in range(20, 35)]
    assert d["max_tokens"] == blocks * 16
    assert d["max_model_len"] == 32768  # from max_position_embeddings
    assert d["used_bytes"] <= d["memory_bytes"] == GiB


def test_cli_json_several_configs_is_an_array(capsys):
    paths = sorted(str(p) for p in CONFIGS.glob("*.json"))
    out = json.loads(run_cli([*paths, "--json", "--memory", "80GB", "--block-size", "32",
                              "--max-model-len", "4096", "--kv-dtype", "fp8"], capsys))
    assert [d["config"] for d in out] == paths
    for d in out:
        assert d["memory_bytes"] == 80 * 10**9 and d["used_bytes"] <= 80 * 10**9
        assert d["max_model_len"] == 4096
        assert all(g["dtype"] == "float8_e4m3fn" for g in d["groups"])
        for g in d["groups"]:
            per_token = (g["head_dim"] if g["kind"] == "mla"
                         else g["num_kv_heads"] * (g["head_dim"] + g["head_dim_v"]))
            assert g["page_bytes"] == 32 * per_token * 1  # 32 tokens, 1-byte fp8
            assert g["bytes"] == g["page_bytes"] * g["num_blocks"] * len(g["layers"])


def test_cli_human_output_names_each_config(capsys):
    paths = [str(CONFIGS / "llama-3-8b.json"), str(CONFIGS / "gemma-3-27b.json")]
    out = run_cli(paths, capsys)
    for p in paths:
        assert p in out
    assert "sliding_window" in out and "5-59:6" in out  # Gemma 3 full layers, stride 6
    assert "concurrent requests at 8,192 tokens" in out


def test_cli_errors(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    plan_cmd.configure(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([str(CONFIGS / "llama-3-8b.json"), "--memory", "lots"])
    with pytest.raises(KVABIError, match="config"):
        plan_cmd.run(parser.parse_args([str(tmp_path / "none.json")]))
    with pytest.raises(KVABIError, match="memory_bytes"):
        plan_cmd.run(parser.parse_args([str(CONFIGS / "llama-3-8b.json"), "--memory", "1KiB"]))


def test_layout_padding_is_paid_for():
    """tpu.combined pads head dim 64 to 128: a page costs twice the unpadded bytes, and the
    plan still never exceeds the budget."""
    from kvabi import KVSpec, LayerKV, ModelKV
    from kvabi.memory.planning import layout_page_bytes, plan_memory

    spec = KVSpec(kind="full", block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    model = ModelKV([LayerKV(f"l{i}", spec) for i in range(3)])
    assert layout_page_bytes(spec) == 16 * 4 * 2 * 64 * 2
    assert layout_page_bytes(spec, "tpu.combined") == 16 * 4 * 2 * 128 * 2
    assert layout_page_bytes(spec, "vllm.LHBNC") == layout_page_bytes(spec)
    budget = 10**7
    plain = plan_memory(model, budget)
    tpu = plan_memory(model, budget, layout="tpu.combined")
    assert tpu.groups[0].num_blocks == budget // (3 * 16 * 4 * 2 * 128 * 2)
    assert plain.groups[0].num_blocks == budget // (3 * 16 * 4 * 2 * 64 * 2)
    assert tpu.used_bytes <= budget and tpu.to_dict()["groups"][0]["page_bytes"] == 32768
