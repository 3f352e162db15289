"""The hostile corpus (tests/data/hostile): every descriptor and config in it is refused with
the KVABIError its manifest names, by the library and by the ``kvabi`` command (one line,
exit status 2, no traceback)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvabi import KVABIError, Layout, ModelKV
from kvabi.commands.cli import main

HOSTILE = Path(__file__).parent / "data" / "hostile"
MANIFEST = json.loads((HOSTILE / "manifest.json").read_text())


def _generator():
    spec = importlib.util.spec_from_file_location("hostile_generate", HOSTILE / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_message(e: KVABIError, expect: dict):
    msg = str(e)
    assert msg.startswith(expect["field"] + ":") or msg.startswith(expect["field"] + " "), msg
    assert expect["match"] in msg, msg


def test_corpus_is_what_the_generator_writes():
    gen = _generator()
    for folder, items in (("descriptors", gen.descriptors), ("configs", gen.configs)):
        assert sorted(MANIFEST[folder]) == sorted(items)
        for name, (data, field, match, *_) in items.items():
            assert (HOSTILE / folder / name).read_bytes() == data, name
            assert MANIFEST[folder][name]["field"] == field


def test_the_unmutated_bases_are_accepted():
    """So that each refusal below comes from its one mutation."""
    gen = _generator()
    layout = Layout.from_json(json.dumps(gen.DESC))
    assert layout.name == "flashinfer.NHD" and layout.num_planes == 2
    comp = Layout.from_json(json.dumps(gen.COMP))
    assert comp.component_names == ("key", "value", "key_scale", "value_scale")
    assert comp.plane_sizes == (1152,)
    model = ModelKV.from_hf_config(gen.CONFIG)
    assert len(model) == 4 and model.layers[0].spec.num_kv_heads == 2


@pytest.mark.parametrize("name", sorted(MANIFEST["descriptors"]))
def test_hostile_descriptor_is_refused(name):
    expect = MANIFEST["descriptors"][name]
    data = (HOSTILE / "descriptors" / name).read_bytes()
    with pytest.raises(KVABIError) as info:
        Layout.from_json(data, max_bytes=expect.get("max_bytes"))
    check_message(info.value, expect)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return
    with pytest.raises(KVABIError) as info:  # the same as text
        Layout.from_json(text, max_bytes=expect.get("max_bytes"))
    check_message(info.value, expect)


@pytest.mark.parametrize("name", sorted(MANIFEST["configs"]))
def test_hostile_config_is_refused(name):
    expect = MANIFEST["configs"][name]
    with pytest.raises(KVABIError) as info:
        ModelKV.from_hf_config(HOSTILE / "configs" / name)
    check_message(info.value, expect)


@pytest.mark.parametrize("name", sorted(MANIFEST["configs"]))
def test_kvabi_plan_refuses_in_one_line(name, capsys):
    expect = MANIFEST["configs"][name]
    assert main(["plan", str(HOSTILE / "configs" / name)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvabi: error: "), err
    assert expect["match"] in err and "Traceback" not in err


def test_oversized_config_is_refused_before_parsing(tmp_path):
    from kvabi.model.hf_config import MAX_CONFIG_BYTES

    path = tmp_path / "config.json"
    path.write_bytes(b'{"pad": "' + b"x" * MAX_CONFIG_BYTES + b'"}')
    with pytest.raises(KVABIError, match=r"^config .*more than the limit of 16777216"):
        ModelKV.from_hf_config(tmp_path)  # the folder: its config.json


def test_unreadable_config_paths_are_refused(tmp_path):
    with pytest.raises(KVABIError, match="^config: cannot read"):
        ModelKV.from_hf_config(tmp_path / "missing.json")
    with pytest.raises(KVABIError, match="^config: cannot read"):
        ModelKV.from_hf_config(tmp_path)  # a folder without config.json
    with pytest.raises(KVABIError, match="^config: cannot read"):
        ModelKV.from_hf_config(str(tmp_path) + "/a\0b.json")
    with pytest.raises(KVABIError, match="^config: expected a mapping or a path"):
        ModelKV.from_hf_config(42)
