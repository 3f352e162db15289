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


class _Plugin:
    @kvabi.hookimpl
    def kvabi_backends(self):
        return [_Liar()]


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
    assert "planted.liar  flash_attn  float32  flash_attn" in out
    assert "planted.liar  vllm.LBHNC  float32  custom L,B,H,KV,N,D  NO" in out
    # the first value: LBHNC puts it after the token's 8 key floats (32 bytes); the kernel
    # after the block-head's 16 tokens of keys (16 x 8 x 4 = 512 bytes)
    assert "planted.liar vllm.LBHNC: kv 1: vllm.LBHNC puts it at plane 0, byte 32; " \
           "the custom layout at plane 0, byte 512" in out


def test_unknown_and_help(capsys):
    assert main(["probe", "no.such"]) == 2
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    assert "write_kv really produces" in capsys.readouterr().out
