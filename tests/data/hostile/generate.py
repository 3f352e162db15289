"""Writes the hostile corpus of this folder: descriptors and configs, each with the error
it must get in ``manifest.json`` (file -> the field the KVABIError message starts with and
a substring it holds).  Run from anywhere: ``python tests/data/hostile/generate.py``."""
import json
from pathlib import Path

HERE = Path(__file__).parent

DESC = {"dtype": "float32", "extents": {}, "folds": [], "kvabi_abi": [1, 1],
        "name": "flashinfer.NHD", "order": ["B", "KV", "N", "H", "D"], "packing": None,
        "plane_bytes": None, "planes": ["L"],
        "sizes": {"B": 3, "D": 8, "H": 2, "KV": 2, "L": 2, "N": 4}, "strides": None}
# A 2.0 component descriptor: per (layer, block, head, token) a 24-byte record
# [key int8 x 8 | key_scale float32 | value int8 x 8 | value_scale float32].
REC = {"L": 576, "B": 192, "H": 96, "N": 24}
COMP = {"kvabi_abi": [2, 0], "name": "custom", "sizes": {"L": 2, "B": 3, "N": 4, "H": 2},
        "plane_bytes": None, "components": [
            {"name": "key", "dtype": "int8", "count": 8, "offset": 0, "plane": 0,
             "strides": {**REC, "E": 1}},
            {"name": "key_scale", "dtype": "float32", "count": 1, "offset": 8, "plane": 0,
             "strides": REC},
            {"name": "value", "dtype": "int8", "count": 8, "offset": 12, "plane": 0,
             "strides": {**REC, "E": 1}},
            {"name": "value_scale", "dtype": "float32", "count": 1, "offset": 20, "plane": 0,
             "strides": REC}]}


def comp(i=None, drop=None, **over):
    """COMP with component ``i``'s fields (or, i None, the top level's) overridden."""
    d = json.loads(json.dumps(COMP))
    if drop is not None:
        del d["components"][drop]
    (d if i is None else d["components"][i]).update(over)
    return json.dumps(d).encode()


CONFIG = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "hidden_size": 512, "head_dim": 64,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def doc(base, **over):
    d = json.loads(json.dumps(base))
    for k, v in over.items():
        if "." in k:
            a, b = k.split(".")
            d[a][b] = v
        else:
            d[k] = v
    return json.dumps(d).encode()


def raw(base, replace: dict) -> bytes:
    """``base`` as JSON text with literal text substitutions (for what json.dumps cannot
    write: duplicate keys, NaN, invalid bytes)."""
    text = json.dumps(base).encode()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def nested(base, depth: int) -> bytes:
    d = json.dumps(base)[:-1] + ', "x": ' + "[" * depth + "]" * depth + "}"
    return d.encode()


# file -> (bytes, field prefix of the message, substring of the message, extra args)
descriptors = {
    "deep_nesting.json": (nested(DESC, 5000), "descriptor", "nested 5001 deep"),
    "duplicate_dtype.json": (raw(DESC, {b'"dtype": "float32"':
                                        b'"dtype": "float32", "dtype": "int8"'}),
                             "descriptor", "duplicate key 'dtype'"),
    "non_utf8_name.json": (raw(DESC, {b'"flashinfer.NHD"': b'"flash\xffinfer"'}),
                           "descriptor", "not UTF-8"),
    "utf16.json": (json.dumps(DESC).encode("utf-16"), "descriptor", "not UTF-8"),
    "bom.json": (b"\xef\xbb\xbf" + json.dumps(DESC).encode(), "descriptor", "byte-order mark"),
    "nan_plane_bytes.json": (raw(DESC, {b'"plane_bytes": null': b'"plane_bytes": NaN'}),
                             "plane_bytes", "NaN"),
    "infinity_packing.json": (raw(DESC, {b'"packing": null': b'"packing": -Infinity'}),
                              "packing", "-Infinity"),
    "float_overflow.json": (raw(DESC, {b'"packing": null': b'"packing": 1e400'}),
                            "packing", "overflows"),
    "int_beyond_int64.json": (doc(DESC, plane_bytes=2**64), "plane_bytes", "beyond"),
    "int_5000_digits.json": (raw(DESC, {b'"plane_bytes": null':
                                        b'"plane_bytes": ' + b"9" * 5000}),
                             "plane_bytes", "beyond"),
    "oversized.json": (doc(DESC, name="x" * 70000), "descriptor", "limit"),
    "empty.json": (b"", "descriptor", "not valid JSON"),
    "truncated.json": (json.dumps(DESC).encode()[:40], "descriptor", "not valid JSON"),
    "top_level_array.json": (b"[1, 2]", "descriptor", "JSON object"),
    "abi_major_3.json": (doc(DESC, kvabi_abi=[3, 0]), "kvabi_abi", "major"),
    "abi_bools.json": (doc(DESC, kvabi_abi=[True, 0]), "kvabi_abi", "[major, minor]"),
    "span_reaches_2_63.json": (doc(DESC, **{"sizes.B": 2**61}), "sizes", "int64"),
    "stride_reaches_2_63.json": (doc(DESC, strides={"B": 2**62, "KV": 256, "N": 64, "H": 32,
                                                    "D": 4}), "strides", "int64"),
    "planes_total_beyond_int64.json": (doc(DESC, **{"sizes.L": 2**40, "sizes.B": 2**20}),
                                       "sizes", "int64"),
    "plane_bytes_2_63.json": (doc(DESC, plane_bytes=2**63), "plane_bytes", "beyond"),
    "huge_but_representable_over_max_bytes.json": (
        doc(DESC, **{"sizes.L": 2**30}), "descriptor", "total_nbytes", {"max_bytes": 2**20}),
    "bool_size.json": (doc(DESC, **{"sizes.D": True}), "sizes.D", "integer"),
    "float_size.json": (doc(DESC, **{"sizes.N": 4.0}), "sizes.N", "integer"),
    "string_size.json": (doc(DESC, **{"sizes.N": "4"}), "sizes.N", "integer"),
    "negative_size.json": (doc(DESC, **{"sizes.B": -3}), "sizes.B", ">= 1"),
    "zero_size.json": (doc(DESC, **{"sizes.H": 0}), "sizes.H", ">= 1"),
    "kv_size_3.json": (doc(DESC, **{"sizes.KV": 3}), "sizes.KV", "must be 2"),
    "extents_false.json": (doc(DESC, extents=False), "extents", "object"),
    "extents_null.json": (doc(DESC, extents=None), "extents", "object"),
    "extents_float.json": (doc(DESC, extents={"D": 16.0}), "extents.D", "integer"),
    "strides_bool.json": (doc(DESC, strides={"B": 256, "KV": 128, "N": 32, "H": 16,
                                             "D": True}), "strides.D", "integer"),
    "strides_list.json": (doc(DESC, strides=[256, 128, 32, 16, 4]), "strides", "object"),
    "plane_bytes_float.json": (doc(DESC, plane_bytes=1e3), "plane_bytes", "integer"),
    "plane_bytes_true.json": (doc(DESC, plane_bytes=True), "plane_bytes", "integer"),
    "packing_true.json": (doc(DESC, packing=True), "packing", "integer"),
    "order_string.json": (doc(DESC, order="BKVNHD"), "order", "list of axis names"),
    "order_nested.json": (doc(DESC, order=[["B"], "KV", "N", "H", "D"]), "order",
                          "list of axis names"),
    "folds_string.json": (doc(DESC, folds="HD"), "folds", "list"),
    "folds_of_numbers.json": (doc(DESC, folds=[[1, 2]]), "folds[0]", "axis names"),
    "planes_b.json": (doc(DESC, planes=["B", "L"]), "order", "twice"),
    "dtype_list.json": (doc(DESC, dtype=["float32"]), "dtype", "string"),
    "dtype_float64.json": (doc(DESC, dtype="float64"), "dtype", "unknown dtype"),
    "name_number.json": (doc(DESC, name=5), "name", "string"),
    "sizes_unknown_axis.json": (doc(DESC, **{"sizes.Q": 4}), "sizes", "not in the layout"),
    "sizes_missing_h.json": (json.dumps({**DESC, "sizes": {"B": 3, "D": 8, "KV": 2, "L": 2,
                                                          "N": 4}}).encode(),
                             "sizes.H", "missing"),
    "missing_order.json": (json.dumps({k: v for k, v in DESC.items() if k != "order"}
                                      ).encode(), "order", "missing"),
    "shard_unknown_field.json": (doc(DESC, shard={"heads": [2, 3], "of": 4, "rank": 1,
                                                  "ranks": 2, "replica": 0}),
                                 "shard.replica", "unknown field"),
    "shard_head_count.json": (doc(DESC, shard={"heads": [2], "of": 4, "rank": 1, "ranks": 2}),
                              "shard.heads", "sizes.H = 2"),
    "shard_head_twice.json": (doc(DESC, shard={"heads": [3, 3], "of": 4, "rank": 1,
                                               "ranks": 2}), "shard.heads", "twice"),
    "shard_head_beyond_of.json": (doc(DESC, shard={"heads": [2, 4], "of": 4, "rank": 1,
                                                   "ranks": 2}), "shard.heads", "out of range"),
    "shard_rank_beyond.json": (doc(DESC, shard={"heads": [2, 3], "of": 4, "rank": 2,
                                                "ranks": 2}), "shard.rank", "out of range"),
    "shard_heads_string.json": (doc(DESC, shard={"heads": "23", "of": 4, "rank": 1,
                                                 "ranks": 2}), "shard.heads", "list"),
    # component descriptors (2.0)
    "components_overlap.json": (comp(2, offset=4), "components.value", "share bytes"),
    "component_leaves_plane.json": (comp(plane_bytes=1150), "components.value_scale",
                                    "leaves the plane"),
    "component_dtype_disagrees.json": (comp(dtype="float16"), "dtype", "disagrees"),
    "component_misaligned_scale.json": (comp(1, offset=9), "components.key_scale.offset",
                                        "multiple of the float32 unit"),
    "component_unknown_name.json": (comp(0, name="keys"), "components[0].name",
                                    "must be one of"),
    "component_without_its_pair.json": (comp(None, drop=0), "components.key", "missing"),
    "component_scale_count.json": (comp(1, count=3, strides={**REC, "E": 4}),
                                   "components.key_scale.count",
                                   "must divide"),
    "component_unknown_field.json": (comp(0, future=1), "components.key.future",
                                     "unknown component field"),
    "component_missing_plane.json": (comp(3, plane=2),
                                     "plane_bytes", "holds no component"),
    "component_plane_beyond_list.json": (json.dumps({**json.loads(comp(3, plane=5)),
                                                     "plane_bytes": [2000]}).encode(),
                                         "components.value_scale.plane", "reaches plane 5"),
    "component_and_order.json": (json.dumps({**COMP, "order": ["B", "N", "H", "D"]}).encode(),
                                 "components", "not both"),
    "component_negative_stride.json": (comp(0, strides={**REC, "N": -24, "E": 1}),
                                       "components.key.strides.N", ">= 1"),
    "component_self_overlap.json": (comp(0, strides={**REC, "N": 4, "E": 1}),
                                    "components.key.strides.N", "overlaps"),
    "component_span_beyond_int64.json": (comp(sizes={"L": 2, "B": 2**61, "N": 4, "H": 2}),
                                          "components.key.strides", "int64"),
    "component_bool_count.json": (comp(0, count=True), "components.key.count", "integer"),
    "component_sizes_d.json": (comp(sizes={"B": 3, "N": 4, "H": 2, "D": 8}), "sizes.D",
                               "component layout"),
    "component_list_not_object.json": (comp(components=[1]), "components[0]", "object"),
}

MILLION = {"num_hidden_layers": 10**6, "num_attention_heads": 8, "head_dim": 64,
           "num_kv_shared_layers": 10**6 - 1}
configs = {
    "deep_nesting.json": (nested(CONFIG, 5000), "config", "nested 5001 deep"),
    "duplicate_kv_heads.json": (raw(CONFIG, {b'"num_key_value_heads": 2':
                                             b'"num_key_value_heads": 2, '
                                             b'"num_key_value_heads": 8'}),
                                "config", "duplicate key 'num_key_value_heads'"),
    "non_utf8.json": (raw(CONFIG, {b'"llama"': b'"ll\xe9ama"'}), "config", "not UTF-8"),
    "latin1_everywhere.json": (json.dumps({**CONFIG, "name": "caf\u00e9"}, ensure_ascii=False
                                          ).encode("latin-1"), "config", "not UTF-8"),
    "bom.json": (b"\xef\xbb\xbf" + json.dumps(CONFIG).encode(), "config", "byte-order mark"),
    "million_layers.json": (json.dumps(MILLION).encode(), "num_hidden_layers", "<= 65536"),
    "use_sliding_window_string.json": (doc(CONFIG, sliding_window=128,
                                           use_sliding_window="false"),
                                       "use_sliding_window", "true or false"),
    "use_sliding_window_int.json": (doc(CONFIG, sliding_window=128, use_sliding_window=0),
                                    "use_sliding_window", "true or false"),
    "heads_bool.json": (doc(CONFIG, num_attention_heads=True), "num_attention_heads",
                        "integer"),
    "head_dim_float.json": (doc(CONFIG, head_dim=64.0), "head_dim", "integer"),
    "layers_string.json": (doc(CONFIG, num_hidden_layers="4"), "num_hidden_layers",
                           "integer"),
    "layers_zero.json": (doc(CONFIG, num_hidden_layers=0), "num_hidden_layers", ">= 1"),
    "layers_missing.json": (json.dumps({k: v for k, v in CONFIG.items()
                                        if k != "num_hidden_layers"}).encode(),
                            "num_hidden_layers", "required"),
    "kv_heads_3_of_8.json": (doc(CONFIG, num_key_value_heads=3), "num_key_value_heads",
                             "must divide num_attention_heads=8"),
    "kv_heads_negative.json": (doc(CONFIG, num_key_value_heads=-8), "num_key_value_heads",
                               ">= 1"),
    "global_kv_heads_3.json": (doc(CONFIG, num_global_key_value_heads=3),
                               "num_global_key_value_heads", "must divide"),
    "sliding_window_huge.json": (doc(CONFIG, sliding_window=10**30), "config", "beyond"),
    "sliding_window_zero.json": (doc(CONFIG, sliding_window=0), "sliding_window", ">= 1"),
    "sliding_window_float.json": (doc(CONFIG, sliding_window=4096.0), "sliding_window",
                                  "integer"),
    "layer_types_nested.json": (doc(CONFIG, layer_types=[["full_attention"]] * 4),
                                "layer_types[0]", "unsupported layer type"),
    "layer_types_short.json": (doc(CONFIG, layer_types=["full_attention"]), "layer_types",
                               "num_hidden_layers=4"),
    "layer_types_object.json": (doc(CONFIG, layer_types={"0": "full_attention"}),
                                "layer_types", "must be a list"),
    "no_rope_bools.json": (doc(CONFIG, attention_chunk_size=64,
                               no_rope_layers=[True, False, True, True]),
                           "no_rope_layers[0]", "must be 1"),
    "no_rope_string.json": (doc(CONFIG, attention_chunk_size=64, no_rope_layers="1101"),
                            "no_rope_layers", "must list"),
    "pattern_bool.json": (doc(CONFIG, sliding_window=128, sliding_window_pattern=True),
                          "sliding_window_pattern", "integer"),
    "shared_bool.json": (doc(CONFIG, num_kv_shared_layers=True), "num_kv_shared_layers",
                         "integer"),
    "shared_all.json": (doc(CONFIG, num_kv_shared_layers=4), "num_kv_shared_layers", "< "),
    "k_eq_v_string.json": (doc(CONFIG, attention_k_eq_v="false"), "attention_k_eq_v",
                           "true or false"),
    "text_config_list.json": (doc(CONFIG, text_config=[CONFIG]), "text_config", "object"),
    "model_type_list.json": (doc(CONFIG, model_type=["gemma2"]), "model_type", "string"),
    "torch_dtype_number.json": (doc(CONFIG, torch_dtype=16), "torch_dtype", "dtype name"),
    "kv_lora_rank_string.json": (doc(CONFIG, kv_lora_rank="512", qk_rope_head_dim=64),
                                 "kv_lora_rank", "integer"),
    "rope_theta_nan.json": (raw(CONFIG, {b'"torch_dtype": "bfloat16"':
                                         b'"torch_dtype": "bfloat16", "rope_theta": NaN'}),
                            "config", "NaN"),
    "top_level_list.json": (b"[]", "config", "JSON object"),
    "not_json.json": (b"num_hidden_layers = 4\n", "config", "not valid JSON"),
}
# (an oversized config, 16 MiB, is written by the test itself rather than kept here)


def write(folder: str, items: dict) -> dict:
    (HERE / folder).mkdir(exist_ok=True)
    manifest = {}
    for name, (data, field, match, *extra) in sorted(items.items()):
        (HERE / folder / name).write_bytes(data)
        manifest[name] = {"field": field, "match": match, **(extra[0] if extra else {})}
    return manifest


if __name__ == "__main__":
    manifest = {"descriptors": write("descriptors", descriptors),
                "configs": write("configs", configs)}
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
