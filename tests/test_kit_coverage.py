"""Every conformance report says what each check drew (kinds, dtype x quant x rounding,
layouts, examples) and which claims it did not draw and why: in the table, ``--json`` and
JUnit; ``--quant``/``--rounding`` (and the pytest plugin's and the base class's knobs) narrow
the draw; a check with nothing to draw says why in the kit's own words."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvabi.backend import registry
from kvabi.commands.cli import main
from kvabi.testing import KitOptions, get_check, run_check
from kvabi.testing.coverage import claimed_combos
from kvabi.testing.pytest_plugin import _knobs, conformance_class
from kit_fixtures import planted  # noqa: F401 - fixture

sys.path.insert(0, str(Path(__file__).parent / "plugins"))
import kvabi_planted_quant as pq  # noqa: E402


@pytest.fixture
def quantized(planted):  # noqa: F811 - the fixture above
    registry.register(pq, name="plantedq")
    yield pq


def test_json_junit_and_table_carry_what_was_drawn(quantized, capsys, tmp_path):
    junit = tmp_path / "c.xml"
    argv = ["conformance", "planted.q_correct", "--check", "write_kv", "--check", "quantize",
            "--check", "poisoned_per_query", "--max-examples", "2"]
    assert main(argv + ["--json", "--junit-xml", str(junit)]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {r["check"]: r for r in doc["results"]}
    claims = set(claimed_combos(pq.QuantBackend().capabilities(None)))
    # quantize draws every claim the backend serves in every example
    cov = by["quantize"]["coverage"]
    drawn = {(d["dtype"], d["quant"], d["rounding"]) for d in cov["drawn"]}
    never = {(n["dtype"], n["quant"], n["rounding"]): n["why"] for n in cov["not_drawn"]}
    assert drawn | set(never) == claims and not drawn & set(never)
    # every example draws every claim its kind takes (an MLA example has no per-token-head
    # cache): per_tensor in both, per_token_head in each non-MLA one
    assert all(n == 2 for k, n in cov["dtypes"].items() if "per_tensor" in k), cov["dtypes"]
    assert all(n >= 1 for k, n in cov["dtypes"].items()), cov["dtypes"]
    # e5m2 has no per-token-head preset: claimed, refused for every spec, and said so
    assert never[("float8_e5m2", "per_token_head", "nearest_even")].startswith(
        "claimed by capabilities(None), refused by capabilities(spec): quant "
        "'per_token_head' not in")
    assert sum(cov["kinds"].values()) == sum(d["examples"] for d in cov["drawn"])
    assert set(cov["dtypes"]) == {f"{d} {q} {r}" for d, q, r in drawn}
    # the check of quant none only: n/a in the kit's words, nothing from Hypothesis
    ppq = by["poisoned_per_query"]
    assert ppq["status"] == "n/a" and "caches of quant none only" in ppq["message"]
    assert "planted.q_correct claims quantized caches only" in ppq["message"]
    assert "Unable to satisfy" not in json.dumps(doc)
    # JUnit: each test case carries what it drew
    props = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        p = case.find("properties")
        props[case.get("name")] = {} if p is None else \
            {x.get("name"): x.get("value") for x in p.iter("property")}
    assert "int8 per_tensor nearest_away 2" in props["quantize"]["drawn.dtypes"]
    assert "float8_e5m2 per_token_head nearest_even: claimed by capabilities(None)" in \
        props["quantize"]["not_drawn"]
    assert props["write_kv"]["drawn.kinds"]
    # the table: a DRAWN column, then what each check drew and what it did not
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "DRAWN" in out.splitlines()[0] and "what each check drew" in out
    assert "i8 tensor away 2" in out and "claimed but not drawn:" in out
    assert "planted.q_correct poisoned_per_query: n/a: poisoned_per_query puts NaN/inf" in out


def test_quant_and_rounding_narrow_the_draw(quantized, capsys):
    assert main(["conformance", "reference", "--check", "write_kv", "--quant",
                 "per_token_head", "--max-examples", "4", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["examples"] == 4
    assert {d["quant"] for d in res["coverage"]["drawn"]} == {"per_token_head"}
    assert main(["conformance", "reference", "--check", "write_kv", "--rounding",
                 "nearest_away", "--max-examples", "3", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert {(d["dtype"], d["rounding"]) for d in res["coverage"]["drawn"]} == \
        {("int8", "nearest_away")}
    # nothing left to draw: n/a, said by the kit
    assert main(["conformance", "reference", "--check", "quantize", "--quant", "none"]) == 0
    out = capsys.readouterr().out
    assert "reference quantize: n/a: quantize needs a quantized cache; reference claims " \
           "quant none, per_tensor, per_token_head" in out
    assert "the dtype/quant/rounding options leave none" in out
    assert main(["conformance", "reference", "--quant", "per_block"]) == 2
    assert "invalid choice: 'per_block'" in capsys.readouterr().err


def test_knobs_of_the_base_class_and_the_pytest_plugin():
    res = run_check(get_check("write_kv"), pq.QuantBackend(), max_examples=3,
                    options=KitOptions(quants=("per_tensor",), dtypes=("float8_e5m2",)))
    assert {k[1:4] for k in res.coverage.drawn} <= {("float8_e5m2", "per_tensor", r)
                                                    for r in ("nearest_even", "toward_zero")}

    class Config:
        def __init__(self, **given):
            self.given = given

        def getoption(self, name, default=None):
            return self.given.get(name, default)

    knobs = _knobs(Config(kvabi_quant=["per_tensor"], kvabi_rounding=["toward_zero"]))
    assert knobs == {"quants": ("per_tensor",), "roundings": ("toward_zero",)}
    cls = conformance_class("planted.q_correct", **knobs)
    assert cls().kit_options().quants == ("per_tensor",)
    assert cls().kit_options().roundings == ("toward_zero",)
    with pytest.raises(pytest.UsageError, match="--kvabi-quant: 'per_row' is not one of"):
        _knobs(Config(kvabi_quant=["per_row"]))


def test_quant_none_does_not_need_a_claimed_rounding():
    """Capabilities.roundings are those of quantized caches: a backend that claims quant
    none and per_tensor with toward_zero only (vLLM's CPU fp8 writer) still has every plain
    dtype drawn; a rounding option keeps quant none only when it names nearest_even."""
    import attrs

    from kvabi.backend.capabilities import Capabilities

    caps = Capabilities(dtypes=("float16", "float8_e5m2"), quant=("none", "per_tensor"),
                        roundings=("toward_zero",))
    assert claimed_combos(caps) == (("float16", "none", "nearest_even"),
                                    ("float8_e5m2", "none", "nearest_even"),
                                    ("float8_e5m2", "per_tensor", "toward_zero"))
    assert claimed_combos(caps, roundings=("toward_zero",)) == (
        ("float8_e5m2", "per_tensor", "toward_zero"),)
    assert claimed_combos(attrs.evolve(caps, quant=("per_tensor",)), dtypes=("float16",)) == ()
