"""``kvabi layout show`` and ``kvabi probe --draw``: the drawings hold what the formats say
(offsets on the axis, component names, runs), and a mismatch is shown where it is."""
from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from kvabi import KVSpec, Layout
from kvabi.commands.cli import main
from kvabi.layout.byte_map import block_map, differences, svg, text
from kvabi.layout.regions import block_cells

from test_probe_cli import liar  # noqa: F401  (the planted backend's fixture)

SVG = "{http://www.w3.org/2000/svg}"
SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=16, dtype="float16")


def test_per_token_head_text_map_shows_the_record(capsys):
    """vLLM's record [K 16 | K_scale 4 | V 16 | V_scale 4] (fp8: one byte per value)."""
    assert main(["layout", "show", "vllm.fp8_per_token_head", "--head-dim", "16",
                 "--colour", "never"]) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if "|" in r]
    assert rows[0].split("|")[0].strip() == "0" and rows[1].split("|")[0].strip() == "64"
    assert rows[0].split("|")[1].startswith("K" * 16 + "k" * 4 + "V" * 16 + "v" * 4 + "K")
    assert "runs of plane 0: 0-15 key, 16-19 key_scale, 20-35 value, 36-39 value_scale, " \
           "40-55 key" in out
    for name in ("key (float8_e4m3fn x 16)", "key_scale (float32 x 1)",
                 "value_scale (float32 x 1)", ". padding"):
        assert name in out
    # 2 heads x 4 tokens x 40 bytes; block 1 of layer 1 starts 3 blocks on
    assert "bytes 0..319 (320 bytes)" in out
    assert main(["layout", "show", "vllm.fp8_per_token_head", "--head-dim", "16",
                 "--layer", "1", "--block", "1", "--colour", "never"]) == 0
    assert "bytes 960..1279" in capsys.readouterr().out


def test_padding_and_colour(capsys):
    assert main(["layout", "show", "flashinfer.HND.fp8_inline_scale", "--head-dim", "16",
                 "--colour", "always"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[34mK\x1b[0m" in out and "\x1b[90m.\x1b[0m" in out  # keys blue, padding grey
    plain = main(["layout", "show", "flashinfer.HND.fp8_inline_scale", "--head-dim", "16",
                  "--colour", "never"])
    out = capsys.readouterr().out
    assert plain == 0 and "16-19 key_scale, 20-31 padding, 32-47 key" in out


def test_svg_holds_offsets_names_and_runs(tmp_path, capsys):
    path = tmp_path / "map.svg"
    assert main(["layout", "show", "deepseek.fp8_ds_mla", "--block-size", "2", "--svg",
                 str(path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {path}"
    root = ET.fromstring(path.read_text())
    titles = [t.text for t in root.iter(f"{SVG}title")]
    # one rectangle per run per row of 64 bytes: the record's parts at 0, 512 and 528
    assert "latent bytes 448-511" in titles and "latent_scale bytes 512-527" in titles
    assert "rope bytes 528-575" in titles and "rope bytes 640-655" in titles
    assert "latent bytes 656-703" in titles  # the second token's record
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "0" in texts and "640" in texts and "+16" in texts  # row and column offsets
    assert any(t.startswith("latent_scale (float32 x 4)") for t in texts)
    fills = {r.get("fill") for r in root.iter(f"{SVG}rect")}
    assert len(fills) >= 4  # three components and padding in the legend, each its colour


def test_a_mismatch_is_drawn_where_it_is():
    """vllm.cpu_kt claims values [D, N]; vLLM's CPU cache (vllm.cpu) holds them [N, D]:
    keys agree, value bytes differ from the second value element on."""
    a = Layout.preset("vllm.cpu", SPEC, 2, 1)
    b = Layout.preset("vllm.cpu_kt", SPEC, 2, 1)
    cells = block_cells(a, [(0, 0)])
    da, db = block_map(a, cells=cells), block_map(b, cells=cells)
    t = text(da, against=db)
    lines = t.splitlines()
    # the first value row (byte 128: 4 tokens x 16 dims x 2 bytes of keys): marked from
    # byte 130 on (token 0's dim 1 declared, token 1's dim 0 landed)
    at = next(i for i, x in enumerate(lines) if x.split("|")[0].strip() == "128")
    assert lines[at + 1].startswith("    landed")
    assert lines[at + 2].index("^") == 12 + 2  # 12 characters of margin, then byte 130
    # value (n, d) sits at n * 16 + d declared, d * 4 + n claimed: equal where d = 5n, so
    # 60 of 64 elements per head differ: 2 heads x 60 x 2 bytes
    assert differences(da, db) == ("mismatch: 240 bytes differ; first at plane 0, byte 130: "
                                   "declared value token 0, head 0, element 1, landed value "
                                   "token 1, head 0, element 0")
    root = ET.fromstring(svg(da, against=db))
    diff = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "diff"]
    assert diff and all(r.get("stroke") == "#d62728" for r in diff)
    assert differences(da, block_map(a, cells=cells)) == \
        "every byte where the declared layout puts it"


def test_probe_draws_a_liar(liar, tmp_path, capsys):  # noqa: F811
    assert main(["probe", "planted.liar", "--head-dim", "8", "--dtype", "float32",
                 "--draw", "--svg", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "planted.liar vllm.LBHNC (components found: key, value)" in out
    # the liar writes all keys of a block-head first: LBHNC's first value (byte 32, after
    # token 0's 8 key floats) holds token 1's first key
    assert "first at plane 0, byte 32: declared value token 0, head 0, element 0, landed " \
           "key token 1, head 0, element 0" in out
    assert (tmp_path / "planted.liar_vllm.LBHNC.svg").exists()
    root = ET.fromstring((tmp_path / "planted.liar_vllm.LBHNC.svg").read_text())
    assert any(r.get("class") == "diff" for r in root.iter(f"{SVG}rect"))
    clean = ET.fromstring((tmp_path / "planted.liar_flash_attn.svg").read_text())
    assert not any(r.get("class") == "diff" for r in clean.iter(f"{SVG}rect"))


def test_descriptor_files_are_read_as_untrusted(tmp_path, capsys):
    f = tmp_path / "bad.json"
    f.write_text('{"kvabi_abi": [2, 0], "sizes": {"B": 1, "N": 1, "H": 1}, "components": '
                 '[{"name": "key", "dtype": "int8", "count": 4, "strides": {"B": 8, "E": 1}},'
                 ' {"name": "value", "dtype": "int8", "count": 4, "offset": 2, '
                 '"strides": {"B": 8, "E": 1}}]}')
    assert main(["layout", "show", str(f)]) == 2
    assert "components.value: may share bytes with components.key" in capsys.readouterr().err
    assert main(["layout", "show", "no.such"]) == 2
    assert main(["layout", "show", "vllm.cpu", "--block", "9"]) == 2
    assert "block: 9 out of range [0, 2)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["layout", "show", "--help"])
