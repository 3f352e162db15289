"""A refusal caused by how the two engines were started carries its fix
(``kvabi_vllm.connector.fixes``), checked on the refusals kvabi itself raises."""
import pytest

from kvabi import KVABIError, KVSpec, Layout
from kvabi.transfer import plan_transfer
from kvabi_vllm.connector.fixes import fix_for, with_fix


def refusal(src: KVSpec, dst: KVSpec) -> str:
    """kvabi's own refusal of a copy plan from ``src``'s cache to ``dst``'s."""
    a = Layout.preset("vllm.LBHNC", src, num_blocks=4, num_layers=2)
    b = Layout.preset("vllm.LBHNC", dst, num_blocks=4, num_layers=2)
    with pytest.raises(KVABIError) as e:
        plan_transfer(a, b, [0, 1], [0, 1])
    return str(e.value)


SPEC = dict(kind="full", block_size=32, num_kv_heads=2, head_dim=32)


def test_another_dtype_names_the_option():
    msg = with_fix(refusal(KVSpec(dtype="float32", **SPEC), KVSpec(dtype="bfloat16", **SPEC)))
    assert "dtype" in msg and "float32" in msg and "fix: " in msg and "--dtype" in msg, msg


def test_another_model_shape_names_the_model_and_the_tensor_parallel_size():
    other = {**SPEC, "num_kv_heads": 4}
    msg = with_fix(refusal(KVSpec(dtype="float32", **SPEC), KVSpec(dtype="float32", **other)))
    assert "fix: serve the same model, with the same tensor-parallel size" in msg, msg


def test_other_kv_cache_groups_name_the_model():
    msg = with_fix("kvabi_handshakes: the peer must serve 2 KV cache groups, got 1")
    assert msg.endswith("fix: serve the same model on both engines (their KV cache groups "
                        "differ)")


def test_a_refusal_of_the_request_itself_gets_no_configuration_fix():
    for m in ("kvabi_handshakes[0]: must be an object of part -> message",
              "transfer: READ of 12 bytes from 'p' did not finish within 30 s"):
        assert fix_for(m) is None and with_fix(m) == m
    once = with_fix("dst_layout.dtype: differs")
    assert with_fix(once) == once
