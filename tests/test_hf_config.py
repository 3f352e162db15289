"""ModelKV.from_hf_config against the configs' own fields, and ModelKV validation."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvabi import KVABIError, KVSpec, LayerKV, ModelKV
from kvabi.model.hf_config import hf_max_model_len, resolve_kv_dtype

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
BUNDLED = sorted(p.name for p in CONFIGS.glob("*.json"))
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def decoder(cfg: dict) -> dict:
    return cfg.get("text_config", cfg)


def expected_layers(name: str, cfg: dict) -> list[tuple]:
    """(kind, span, kv_heads, head_dim, head_dim_v, shares-index) per layer, written out
    per model from its config fields as the model cards describe them."""
    t = decoder(cfg)
    n = t["num_hidden_layers"]
    kvh = t.get("num_key_value_heads", t.get("num_attention_heads"))
    hd = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    if name == "deepseek-v3.json":
        latent = t["kv_lora_rank"] + t["qk_rope_head_dim"]
        return [("mla", None, 1, latent, t["kv_lora_rank"], None)] * n
    if name == "llama-3-8b.json":
        return [("full", None, kvh, hd, hd, None)] * n
    if name == "mistral-7b-v0.1.json":
        return [("sliding_window", t["sliding_window"], kvh, hd, hd, None)] * n
    if name == "gemma-2-9b.json":  # sliding on even layers
        return [("sliding_window", t["sliding_window"], kvh, hd, hd, None) if i % 2 == 0
                else ("full", None, kvh, hd, hd, None) for i in range(n)]
    if name == "gemma-3-27b.json":  # the HF default pattern 6: every 6th layer full
        return [("full", None, kvh, hd, hd, None) if i % 6 == 5
                else ("sliding_window", t["sliding_window"], kvh, hd, hd, None)
                for i in range(n)]
    if name == "llama-4-scout.json":  # 1 = RoPE = chunked, 0 = NoPE = full
        return [("chunked_local", t["attention_chunk_size"], kvh, hd, hd, None) if r
                else ("full", None, kvh, hd, hd, None) for r in t["no_rope_layers"][:n]]
    if name in ("gpt-oss-20b.json", "gemma-3n-e4b.json"):
        types = t["layer_types"]
        out = [("sliding_window", t["sliding_window"], kvh, hd, hd, None)
               if k == "sliding_attention" else ("full", None, kvh, hd, hd, None)
               for k in types]
        first = n - t.get("num_kv_shared_layers", 0)
        for i in range(first, n):
            src = max(j for j in range(first) if types[j] == types[i])
            out[i] = out[i][:5] + (src,)
        return out
    raise AssertionError(f"no expectation written for {name}")


def test_every_bundled_config_has_an_expectation():
    assert set(BUNDLED) == {"deepseek-v3.json", "gemma-2-9b.json", "gemma-3-27b.json",
                            "gemma-3n-e4b.json", "gpt-oss-20b.json", "llama-3-8b.json",
                            "llama-4-scout.json", "mistral-7b-v0.1.json"}


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_config_layer_kinds(name):
    cfg = load(name)
    model = ModelKV.from_hf_config(CONFIGS / name, block_size=16)
    exp = expected_layers(name, cfg)
    assert len(model) == len(exp) == decoder(cfg)["num_hidden_layers"]
    dtype = decoder(cfg).get("torch_dtype", cfg.get("torch_dtype", "bfloat16"))
    for i, (layer, (kind, span, kvh, hd, hdv, src)) in enumerate(zip(model.layers, exp)):
        s = layer.spec
        assert layer.name == f"layers.{i}"
        assert (s.kind, s.span, s.num_kv_heads, s.head_dim, s.head_dim_v) == \
            (kind, span, kvh, hd, hdv), layer.name
        assert s.block_size == 16 and s.dtype == dtype
        assert layer.shares == (None if src is None else f"layers.{src}")
    # bytes per token, by direct formula over the layers that own a cache
    per_token = sum((hd if kind == "mla" else kvh * (hd + hdv)) * BYTES[dtype]
                    for kind, _, kvh, hd, hdv, src in exp if src is None)
    assert model.kv_bytes_per_token == per_token


def test_llama3_8b_token_cost():
    cfg = load("llama-3-8b.json")
    model = ModelKV.from_hf_config(cfg)
    # 32 layers x 8 KV heads x (K + V) x 128 dims x 2 bytes
    direct = (cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 2
              * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2)
    assert model.kv_bytes_per_token == direct == 131072
    assert model.shared_layers == {} and model.prefill_skip_layers == ()
    assert [g.spec.kind for g in model.groups] == ["full"]


def test_gemma3n_shared_layers_cost_nothing_and_are_prefill_skip():
    cfg = load("gemma-3n-e4b.json")
    t = cfg["text_config"]
    model = ModelKV.from_hf_config(cfg)
    n, k = t["num_hidden_layers"], t["num_kv_shared_layers"]
    shared = [f"layers.{i}" for i in range(n - k, n)]
    assert list(model.shared_layers) == shared
    assert model.prefill_skip_layers == tuple(shared)
    owners = {name for g in model.groups for name in g.layers}
    assert owners == {f"layers.{i}" for i in range(n - k)}
    per_layer = t["num_key_value_heads"] * 2 * t["head_dim"] * 2
    assert model.kv_bytes_per_token == (n - k) * per_layer
    # each shared layer reads the last owner of its own type
    types = t["layer_types"]
    for i in range(n - k, n):
        owner = int(model.owner(f"layers.{i}").split(".")[1])
        assert types[owner] == types[i]
        assert all(types[j] != types[i] for j in range(owner + 1, n - k))


def test_max_model_len_from_config():
    assert hf_max_model_len(load("llama-3-8b.json")) == 8192
    assert hf_max_model_len(load("gemma-3-27b.json")) == 131072  # gemma3_text default
    assert hf_max_model_len({"num_hidden_layers": 1}) is None


# ---- variants of real configs -------------------------------------------------------

def test_dtype_from_config_and_override():
    cfg = load("llama-3-8b.json")
    for torch_dtype, want in [("float16", "float16"), ("float32", "float32"),
                              ("auto", "bfloat16"), ("float64", "bfloat16")]:
        c = dict(cfg, torch_dtype=torch_dtype)
        assert ModelKV.from_hf_config(c).layers[0].spec.dtype == want
    c = {k: v for k, v in cfg.items() if k != "torch_dtype"}
    assert ModelKV.from_hf_config(c).layers[0].spec.dtype == "bfloat16"
    assert ModelKV.from_hf_config(dict(c, dtype="float16")).layers[0].spec.dtype == "float16"
    m = ModelKV.from_hf_config(cfg, kv_dtype="fp8")
    assert m.layers[0].spec.dtype == "float8_e4m3fn"
    assert m.kv_bytes_per_token == 131072 // 2
    assert resolve_kv_dtype("bf16") == "bfloat16"


def test_nested_config_inherits_outer_dtype():
    cfg = load("gemma-3-27b.json")
    assert "torch_dtype" not in cfg["text_config"]
    cfg["torch_dtype"] = "float16"
    assert ModelKV.from_hf_config(cfg).layers[0].spec.dtype == "float16"


def test_head_dim_and_kv_heads_defaults():
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    spec = ModelKV.from_hf_config(cfg).layers[0].spec
    assert (spec.num_kv_heads, spec.head_dim, spec.kind) == (4, 16, "full")


def test_llama4_empty_no_rope_layers_uses_interval():
    cfg = load("llama-4-scout.json")
    t = cfg["text_config"]
    t["no_rope_layers"] = []
    kinds = [l.spec.kind for l in ModelKV.from_hf_config(cfg).layers]
    assert kinds == ["full" if (i + 1) % 4 == 0 else "chunked_local" for i in range(48)]
    t["no_rope_layer_interval"] = 3
    kinds = [l.spec.kind for l in ModelKV.from_hf_config(cfg).layers]
    assert kinds == ["full" if (i + 1) % 3 == 0 else "chunked_local" for i in range(48)]
    t["attention_chunk_size"] = None  # no chunking at all
    assert {l.spec.kind for l in ModelKV.from_hf_config(cfg).layers} == {"full"}


def test_gemma3_explicit_pattern_and_layer_types():
    cfg = load("gemma-3-27b.json")
    cfg["text_config"]["sliding_window_pattern"] = 2
    kinds = [l.spec.kind for l in ModelKV.from_hf_config(cfg).layers]
    assert kinds == ["full" if i % 2 else "sliding_window" for i in range(62)]
    types = ["full_attention" if i < 3 else "sliding_attention" for i in range(62)]
    cfg["text_config"]["layer_types"] = types
    kinds = [l.spec.kind for l in ModelKV.from_hf_config(cfg).layers]
    assert kinds == ["full" if i < 3 else "sliding_window" for i in range(62)]


def test_qwen2_style_sliding_window_switch():
    base = {"model_type": "qwen2", "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "hidden_size": 64, "sliding_window": 32}
    off = ModelKV.from_hf_config(dict(base, use_sliding_window=False))
    assert {l.spec.kind for l in off.layers} == {"full"}
    on = ModelKV.from_hf_config(dict(base, use_sliding_window=True, max_window_layers=4))
    assert [l.spec.kind for l in on.layers] == ["full"] * 4 + ["sliding_window"] * 2


def test_gemma3n_shared_layer_without_earlier_type_keeps_its_cache():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 8,
           "sliding_window": 4, "num_kv_shared_layers": 2,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                           "sliding_attention"]}
    m = ModelKV.from_hf_config(cfg)
    assert [l.shares for l in m.layers] == [None, None, None, "layers.1"]


def test_config_from_path_and_folder(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3-8b.json").read_text())
    a = ModelKV.from_hf_config(tmp_path)
    b = ModelKV.from_hf_config(str(tmp_path / "config.json"))
    assert a == b and a.kv_bytes_per_token == 131072


# ---- bad configs ---------------------------------------------------------------------

LLAMA = load("llama-3-8b.json")


def _with(base, **changes):
    c = copy.deepcopy(base)
    for k, v in changes.items():
        if v is _DROP:
            c.pop(k, None)
        else:
            c[k] = v
    return c


_DROP = object()

BAD = [
    (_with(LLAMA, num_hidden_layers=_DROP), "num_hidden_layers"),
    (_with(LLAMA, num_hidden_layers=0), "num_hidden_layers"),
    (_with(LLAMA, num_hidden_layers="32"), "num_hidden_layers"),
    (_with(LLAMA, num_hidden_layers=True), "num_hidden_layers"),
    (_with(LLAMA, num_attention_heads=_DROP), "num_attention_heads"),
    (_with(LLAMA, hidden_size=4097), "hidden_size"),
    (_with(LLAMA, num_key_value_heads=-8), "num_key_value_heads"),
    (_with(LLAMA, head_dim=1.5), "head_dim"),
    (_with(LLAMA, torch_dtype=16), "torch_dtype"),
    (_with(LLAMA, sliding_window=0), "sliding_window"),
    (_with(LLAMA, layer_types=["full_attention"] * 31), "layer_types"),
    (_with(LLAMA, layer_types=["full_attention"] * 31 + ["linear_attention"]),
     "layer_types[31]"),
    (_with(LLAMA, attention_chunk_size=8192, no_rope_layers=[1, 0]), "no_rope_layers"),
    (_with(LLAMA, attention_chunk_size=8192, no_rope_layers=[2] * 32), "no_rope_layers[0]"),
    (_with(LLAMA, num_kv_shared_layers=32), "num_kv_shared_layers"),
    (_with(LLAMA, num_kv_shared_layers=-1), "num_kv_shared_layers"),
    (_with(load("deepseek-v3.json"), qk_rope_head_dim=_DROP), "qk_rope_head_dim"),
    (_with(load("deepseek-v3.json"), kv_lora_rank=0), "kv_lora_rank"),
    ({"text_config": [1, 2]}, "text_config"),
]


@pytest.mark.parametrize("cfg,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_the_field(cfg, field):
    with pytest.raises(KVABIError) as e:
        ModelKV.from_hf_config(cfg)
    assert str(e.value).startswith(field + ":"), str(e.value)


def test_bad_arguments_and_files(tmp_path):
    with pytest.raises(KVABIError, match="kv_dtype"):
        ModelKV.from_hf_config(LLAMA, kv_dtype="float64")
    with pytest.raises(KVABIError, match="block_size"):
        ModelKV.from_hf_config(LLAMA, block_size=0)
    with pytest.raises(KVABIError, match="config"):
        ModelKV.from_hf_config(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KVABIError, match="config"):
        ModelKV.from_hf_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(KVABIError, match="config"):
        ModelKV.from_hf_config(tmp_path / "list.json")
    with pytest.raises(KVABIError, match="config"):
        ModelKV.from_hf_config(42)


# ---- ModelKV validation ----------------------------------------------------------------

FULL = KVSpec("full", 16, 2, 8)
SLIDE = KVSpec("sliding_window", 16, 2, 8, window=32)


def test_model_rejects_sharing_unknown_or_later_layer():
    with pytest.raises(KVABIError, match="layers\\[1\\].shares"):
        ModelKV([LayerKV("a", FULL), LayerKV("b", FULL, shares="zzz")])
    with pytest.raises(KVABIError, match="layers\\[0\\].shares"):
        ModelKV([LayerKV("a", FULL, shares="b"), LayerKV("b", FULL)])
    with pytest.raises(KVABIError, match="layers\\[0\\].shares"):
        ModelKV([LayerKV("a", FULL, shares="a")])


def test_model_rejects_sharing_a_different_spec_and_duplicates():
    with pytest.raises(KVABIError, match="layers\\[1\\].spec"):
        ModelKV([LayerKV("a", FULL), LayerKV("b", SLIDE, shares="a")])
    with pytest.raises(KVABIError, match="layers\\[1\\].name"):
        ModelKV([LayerKV("a", FULL), LayerKV("a", FULL)])
    with pytest.raises(KVABIError, match="layers"):
        ModelKV([])


def test_sharing_chains_resolve_to_the_owner():
    m = ModelKV([LayerKV("a", FULL), LayerKV("s", SLIDE), LayerKV("b", FULL, shares="a"),
                 LayerKV("c", FULL, shares="b"), LayerKV("d", SLIDE, shares="s")])
    assert m.owner("c") == "a" and m.owner("b") == "a" and m.owner("a") == "a"
    assert m.shared_layers == {"b": "a", "c": "a", "d": "s"}
    assert m.prefill_skip_layers == ("b", "c", "d")
    assert [(g.spec, g.layers) for g in m.groups] == [(FULL, ("a",)), (SLIDE, ("s",))]
    assert m.kv_bytes_per_token == 2 * (2 * 2 * 8 * 2)

