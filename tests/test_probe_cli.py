"""``kvabi probe``: a backend whose kernel writes another order than it declares is caught."""
import json

import numpy as np
import pytest

import kvabi
from kvabi.backend import registry
from kvabi.commands.cli import main
from kvabi.backend.reference import ReferenceBackend
from kvabi.testing.writers import layout_writer


class _Liar(ReferenceBackend):
    """Declares vllm.LBHNC, but writes each block-head as all keys then all values (the
    order vLLM's CPU kernels use on that allocation)."""

    name = "planted.liar"

    def preferred_layouts(self, spec):
        return ("vllm.LBHNC", "flash_attn")

    def write(self, plan, cache, key, value, layer, **scales):
        layout = plan.layout
        if layout.name != "vllm.LBHNC":
            return super().write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              **scales)
        real = kvabi.Layout(order=("L", "B", "H", "KV", "N", "D"), sizes=layout.sizes,
                            dtype=layout.dtype)
        layout_writer(real, list(cache))(layer, plan.meta.slot_mapping, np.asarray(key),
                                         np.asarray(value))
        return cache


class _ScaleSwapper(ReferenceBackend):
    """Quantizes per token and head, but stores each key's scale where its value's goes and
    the other way round."""

    name = "planted.scale_swapper"

    def write(self, plan, cache, key, value, layer, **scales):
        super().write(plan=plan, cache=cache, key=key, value=value, layer=layer, **scales)
        if plan.spec.quant == "per_token_head":
            ks = cache.component_view(layer, "key_scale")
            vs = cache.component_view(layer, "value_scale")
            k = np.array(ks)
            ks[...] = vs
            vs[...] = k
        return cache


class _Plugin:
    @kvabi.hookimpl
    def kvabi_backends(self):
        return [_Liar(), _ScaleSwapper()]


@pytest.fixture
def liar():
    registry.reset()
    registry.register(_Plugin(), name="planted")
    yield
    registry.reset()


def test_reference_matches_every_preferred_layout(capsys):
    assert main(["probe", "reference", "--json", "--head-dim", "8", "--blocks", "3"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(ReferenceBackend().preferred_layouts(
        kvabi.KVSpec("full", block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16")))
    assert all(r["match"] and r["inferred"] == r["layout"] for r in rows)


def test_liar_is_caught(liar, capsys):
    assert main(["probe", "planted.liar", "--head-dim", "8", "--dtype", "float32"]) == 1
    out = capsys.readouterr().out
    assert "planted.liar  flash_attn  float32  none   flash_attn           match" in out
    assert "planted.liar  vllm.LBHNC  float32  none   custom L,B,H,KV,N,D  MISMATCH" in out
    # the first value: LBHNC puts it after the token's 8 key floats (32 bytes); the kernel
    # after the block-head's 16 tokens of keys (16 x 8 x 4 = 512 bytes)
    assert "planted.liar vllm.LBHNC: kv 1: vllm.LBHNC puts it at plane 0, byte 32; " \
           "the custom layout at plane 0, byte 512" in out


def test_unknown_and_help(capsys):
    assert main(["probe", "no.such"]) == 2
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    assert "write_kv really produces" in capsys.readouterr().out


def test_refused_is_not_a_mismatch(liar, capsys):
    """A spec the backend does not claim is refused, said so, exit status 3: nothing was
    verified and nothing found wrong."""
    assert main(["probe", "example.torch", "--dtype", "int8", "--head-dim", "8"]) == 3
    out = capsys.readouterr().out
    assert "example.torch  flash_attn      int8   none   -         refused" in out
    assert "example.torch flash_attn: refused (nothing verified): example.torch does not " \
           "serve it: dtype 'int8' not in" in out
    assert "MISMATCH" not in out


def test_quantized_caches_are_verified_through_their_writer(liar, capsys):
    assert main(["probe", "reference", "--quant", "per_token_head", "--dtype", "int8",
                 "--head-dim", "16", "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["layout"] for r in rows] == ["vllm.int8_per_token_head"]
    assert rows[0]["result"] == "match" and rows[0]["rounding"] == "nearest_even"
    assert main(["probe", "planted.scale_swapper", "--quant", "per_token_head", "--head-dim",
                 "16", "--rounding", "nearest_away", "--dtype", "int8"]) == 1
    out = capsys.readouterr().out
    assert "planted.scale_swapper  vllm.int8_per_token_head  int8   per_token_head  -" in out
    assert "MISMATCH" in out and "key_scale of layer" in out and "its bytes are at" in out
    assert main(["probe", "reference", "--quant", "per_tensor", "--dtype", "float8_e5m2",
                 "--head-dim", "8", "--blocks", "2"]) == 0
    assert main(["probe", "reference", "--quant", "per_tensor", "--dtype", "float32"]) == 2
    assert "dtype: --quant per_tensor needs an int8 or float8 cache" in capsys.readouterr().err
