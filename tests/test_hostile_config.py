"""Hugging Face configs under hostile input: strict field types (each error names the field),
KV heads that divide the query heads, linear time in layers with a documented limit; and
mutated bundled configs, each either refused with a KVABIError or read as the config's own
fields say."""
from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from kvabi import KVABIError, KVSpec, LayerKV, ModelKV
from kvabi.util.dtypes import DTYPES
from kvabi.model.hf_config import MAX_LAYERS, MODEL_TYPE_DEFAULTS
from kvabi.testing.profiles import current_profile

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
BUNDLED = sorted(p.name for p in CONFIGS.glob("*.json"))
SMALL = {"num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 16}


@pytest.mark.parametrize("over,field", [
    (dict(use_sliding_window="false", sliding_window=64), "use_sliding_window"),
    (dict(use_sliding_window=1, sliding_window=64), "use_sliding_window"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(num_key_value_heads=16), "num_key_value_heads"),
    (dict(num_key_value_heads=True), "num_key_value_heads"),
    (dict(num_attention_heads=8.0), "num_attention_heads"),
    (dict(head_dim="16"), "head_dim"),
    (dict(num_hidden_layers=MAX_LAYERS + 1), "num_hidden_layers"),
    (dict(num_hidden_layers=[6]), "num_hidden_layers"),
    (dict(num_kv_shared_layers=1.0), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=-1), "num_kv_shared_layers"),
    (dict(layer_types=["full_attention"] * 5 + [None]), "layer_types[5]"),
    (dict(layer_types=["full_attention"] * 5 + [{"a": 1}]), "layer_types[5]"),
    (dict(layer_types="full_attention"), "layer_types"),
    (dict(sliding_window_pattern=0, sliding_window=64), "sliding_window_pattern"),
    (dict(attention_chunk_size=64, no_rope_layers=[1, 1, 1, 0, 1, 2]), "no_rope_layers[5]"),
    (dict(attention_chunk_size=64, no_rope_layer_interval=False), "no_rope_layer_interval"),
    (dict(attention_chunk_size="64", layer_types=["chunked_attention"] * 6),
     "attention_chunk_size"),
    (dict(max_window_layers=2.5, sliding_window=64, use_sliding_window=True),
     "max_window_layers"),
    (dict(attention_k_eq_v="no"), "attention_k_eq_v"),
    (dict(num_global_key_value_heads=5), "num_global_key_value_heads"),
    (dict(global_head_dim=True), "global_head_dim"),
    (dict(kv_lora_rank=512, qk_rope_head_dim=-64), "qk_rope_head_dim"),
    (dict(torch_dtype=["bfloat16"]), "torch_dtype"),
    (dict(model_type={"x": 1}), "model_type"),
    (dict(text_config="llama"), "text_config"),
])
def test_bad_fields_are_named(over, field):
    with pytest.raises(KVABIError) as info:
        ModelKV.from_hf_config({**SMALL, **over})
    assert str(info.value).startswith(field + ":"), str(info.value)


def test_use_sliding_window_false_keeps_the_window_off():
    off = ModelKV.from_hf_config({**SMALL, "sliding_window": 64, "use_sliding_window": False})
    on = ModelKV.from_hf_config({**SMALL, "sliding_window": 64, "use_sliding_window": True})
    assert {l.spec.kind for l in off.layers} == {"full"}
    assert {l.spec.kind for l in on.layers} == {"sliding_window"}


def test_block_size_and_kv_dtype_are_strict():
    with pytest.raises(KVABIError, match="^block_size"):
        ModelKV.from_hf_config(SMALL, block_size=True)
    with pytest.raises(KVABIError, match="^block_size"):
        ModelKV.from_hf_config(SMALL, block_size=16.0)
    with pytest.raises(KVABIError, match="^kv_dtype"):
        ModelKV.from_hf_config(SMALL, kv_dtype=["fp8"])


@pytest.mark.parametrize("n", [MAX_LAYERS])
def test_the_largest_config_is_linear_and_exact(n):
    """MAX_LAYERS layers, half of them KV-shared over alternating types: built in one pass
    (quadratic code would take hours here), with every shared layer reading the last earlier
    owner of its own type (written out directly)."""
    types = ["sliding_attention" if i % 3 else "full_attention" for i in range(n)]
    cfg = {**SMALL, "num_hidden_layers": n, "layer_types": types, "sliding_window": 128,
           "num_kv_shared_layers": n // 2}
    model = ModelKV.from_hf_config(cfg)
    first = n - n // 2
    last = {"full_attention": max(i for i in range(first) if i % 3 == 0),
            "sliding_attention": max(i for i in range(first) if i % 3)}
    shared = model.shared_layers
    assert len(shared) == n // 2
    for i in (first, first + 1, first + 2, n - 1):
        assert shared[f"layers.{i}"] == f"layers.{last[types[i]]}"
    assert model.prefill_skip_layers[0] == f"layers.{first}"
    assert model.owner(f"layers.{n - 1}") == f"layers.{last[types[n - 1]]}"


def test_a_million_layers_costs_nothing():
    cfg = {"num_hidden_layers": 10**6, "num_attention_heads": 8, "head_dim": 64,
           "num_kv_shared_layers": 10**6 - 1}
    tracemalloc.start()
    try:
        with pytest.raises(KVABIError, match=f"^num_hidden_layers: must be <= {MAX_LAYERS}"):
            ModelKV.from_hf_config(cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_model_kv_owner_chains_resolve_in_order():
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=8)
    layers = [LayerKV("a", spec), LayerKV("b", spec, "a"), LayerKV("c", spec, "b"),
              LayerKV("d", spec)]
    m = ModelKV(layers)
    assert m.shared_layers == {"b": "a", "c": "a"}
    assert m.owner("c") == "a" and m.owner("d") == "d"
    with pytest.raises(KVABIError, match="^layer: no layer named"):
        m.owner(["a"])
    with pytest.raises(KVABIError, match=r"^layers\[1\].shares"):
        ModelKV([LayerKV("a", spec), LayerKV("b", spec, ["a"])])
    with pytest.raises(KVABIError, match=r"^layers\[0\].spec"):
        ModelKV([LayerKV("a", "full")])


# -- mutated bundled configs ----------------------------------------------------------------
EXAMPLES = 3_000 if current_profile() == "thorough" else 400
KEYS = ["num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "hidden_size", "sliding_window", "use_sliding_window", "max_window_layers",
        "layer_types", "num_kv_shared_layers", "sliding_window_pattern",
        "attention_chunk_size", "no_rope_layers", "kv_lora_rank", "qk_rope_head_dim",
        "torch_dtype", "model_type", "global_head_dim", "num_global_key_value_heads"]
hostile = st.one_of(
    st.sampled_from([0, 1, -1, 2, 3, 7, 2**31, 2**63 - 1, MAX_LAYERS + 1, 10**6]),
    st.integers(-10, 100), st.floats(allow_nan=False, allow_infinity=False), st.booleans(),
    st.none(), st.sampled_from(["false", "true", "1", "", "full_attention", "bfloat16"]),
    st.lists(st.sampled_from(["full_attention", "sliding_attention", "chunked_attention",
                              0, 1, True, None]), max_size=8),
    st.dictionaries(st.sampled_from(KEYS), st.integers(0, 4), max_size=2))


@st.composite
def mutated_configs(draw):
    cfg = json.loads((CONFIGS / draw(st.sampled_from(BUNDLED))).read_text())
    dec = cfg.get("text_config", cfg)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(KEYS if draw(st.integers(0, 3)) else sorted(dec)))
        op = draw(st.sampled_from(["set", "set", "delete", "scale", "switch"]))
        if op == "switch" or (op == "set" and key == "use_sliding_window"):
            key = "use_sliding_window"
            dec[key] = draw(st.sampled_from(["false", "true", 0, 1, None, True, False, "no"]))
            if draw(st.booleans()):  # a window for it to switch, and no other rule first
                dec["sliding_window"] = draw(st.sampled_from([64, 4096]))
                for k in ("layer_types", "sliding_window_pattern", "attention_chunk_size"):
                    dec.pop(k, None)
        elif op == "set":
            dec[key] = draw(hostile)
        elif op == "delete":
            dec.pop(key, None)
        elif isinstance(dec.get(key), int) and not isinstance(dec[key], bool):
            dec[key] = draw(st.sampled_from([dec[key] * 3, dec[key] + 1, -dec[key],
                                             float(dec[key])]))
    return cfg


def check_read_as_written(cfg: dict, model: ModelKV):
    """What the fields say (independent of kvabi.model.hf_config's code paths)."""
    dec = cfg.get("text_config", cfg)
    n = dec["num_hidden_layers"]
    assert type(n) is int and 1 <= n <= MAX_LAYERS and len(model) == n
    for layer in model.layers:
        s = layer.spec
        assert s.dtype in DTYPES and type(s.block_size) is int
        assert all(type(v) is int and v > 0 for v in (s.num_kv_heads, s.head_dim,
                                                      s.head_dim_v))
    if dec.get("kv_lora_rank") is not None:
        assert {l.spec.kind for l in model.layers} == {"mla"}
        assert type(dec["kv_lora_rank"]) is int
        return
    heads = dec["num_attention_heads"]
    assert type(heads) is int
    for layer in model.layers:
        assert heads % layer.spec.num_kv_heads == 0
    kvh = dec.get("num_key_value_heads")
    assert kvh is None or type(kvh) is int
    usw = dec.get("use_sliding_window")
    # the documented per-model-type defaults (e.g. Gemma 3's pattern of 6) apply first
    dec = {**MODEL_TYPE_DEFAULTS.get(dec.get("model_type"), {}), **dec}
    plain = (dec.get("layer_types") is None and dec.get("model_type") != "gemma2"
             and dec.get("sliding_window_pattern") is None
             and dec.get("_sliding_window_pattern") is None
             and dec.get("attention_chunk_size") is None)
    assert usw is None or type(usw) is bool  # checked whichever rule applies
    if plain and dec.get("sliding_window") is not None:
        if usw is False:
            assert {l.spec.kind for l in model.layers} == {"full"}
    if dec.get("layer_types") is not None:
        kinds = {"full_attention": "full", "sliding_attention": "sliding_window",
                 "chunked_attention": "chunked_local"}
        assert [kinds[t] for t in dec["layer_types"]] == [l.spec.kind for l in model.layers]
    shared = dec.get("num_kv_shared_layers")
    assert shared is None or (type(shared) is int and 0 <= shared < n)
    for i, layer in enumerate(model.layers):
        if layer.shares is not None:
            j = int(layer.shares.split(".")[1])
            assert j < i and model.layers[j].spec == layer.spec
            assert i >= n - (shared or 0) > j


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(cfg=mutated_configs(), as_file=st.booleans())
def test_mutated_bundled_configs_are_read_as_written_or_refused(cfg, as_file, tmp_path_factory):
    src = cfg
    if as_file:
        src = tmp_path_factory.mktemp("cfg") / "config.json"
        src.write_text(json.dumps(cfg))
    try:
        model = ModelKV.from_hf_config(src)
    except KVABIError as e:
        event(f"refused: {str(e).split(':')[0]}")
        return
    event("accepted")
    check_read_as_written(cfg, model)
