"""vLLM's CPU cache write, probed: ``vllm._custom_ops.cpu_attn_reshape_and_cache`` (the
compiled kernel CPU_ATTN calls) on the cache CPU_ATTN allocates.

vLLM declares the CPU cache LBHNC: [blocks, kv_heads, block_size, 2 * head_dim], key and
value side by side per token.  Its backend views each block-head as [2 * block_size,
head_dim] and splits K and V on that axis, so the kernel writes all keys of a block-head,
then all values.  The probe finds more: with the ``vec`` kernels (this machine) the keys of
a block-head are stored dim-major ([head_dim, block_size]) and the values token-major
([block_size, head_dim]): two components with their own strides, the preset ``vllm.cpu``,
which infer_layout finds; verify_layout refuses the declared name on the first element it
checks.
"""
import pytest

torch = pytest.importorskip("torch")
ops = pytest.importorskip("vllm._custom_ops")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

import kvabi  # noqa: E402
from kvabi.probe import infer_layout, verify_layout  # noqa: E402

BLOCKS, HEADS, BLOCK, HEAD_DIM = 4, 2, 32, 32  # CPU_ATTN: block a multiple of 32


def vllm_cpu_cache(dtype):
    """The tensor CPU_ATTN allocates for one layer, a write exactly as its
    ``do_kv_cache_update`` makes it, and the kernel ISA vLLM picks here."""
    kv_cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=dtype)
    isa = cpu_attn._get_attn_isa(dtype, BLOCK, HEAD_DIM)

    def write(layer, slots, key, value):
        assert layer == 0
        view = kv_cache.view(BLOCKS, HEADS, BLOCK * 2, -1)
        key_cache, value_cache = view.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            kvabi.tensors.to_torch(key), kvabi.tensors.to_torch(value), key_cache,
            value_cache, torch.as_tensor(slots, dtype=torch.int64), isa)
    return kv_cache, write, isa


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_cpu_kernel_is_not_the_declared_lbhnc_but_vllm_cpu(dtype):
    kv_cache, write, isa = vllm_cpu_cache(getattr(torch, dtype))
    item = kv_cache.element_size()
    spec = kvabi.KVSpec("full", block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                        dtype=dtype)
    declared = kvabi.Layout.preset("vllm.LBHNC", spec, BLOCKS)
    if isa != "vec":  # other kernels (amx, neon, ...) may tile otherwise: LBHNC still fails
        with pytest.raises(kvabi.KVABIError, match="from where vllm.LBHNC puts it"):
            verify_layout(declared, [kv_cache], write)
        return
    # B: 2 heads x 2 x 32 x 32; H: 2 x 32 x 32; keys dim-major (N 1, D 32 elements), values
    # token-major (N 32, D 1) after the 32 x 32 keys: two components, the preset vllm.cpu
    b, h, e = 2 * HEADS * BLOCK * HEAD_DIM * item, 2 * BLOCK * HEAD_DIM * item, item
    got = infer_layout(spec, [kv_cache], write, num_blocks=BLOCKS)
    assert got.name == "vllm.cpu"
    assert dict(got.component("key").strides) == {"L": BLOCKS * b, "B": b, "N": e, "H": h,
                                                  "E": BLOCK * e}
    assert dict(got.component("value").strides) == {"L": BLOCKS * b, "B": b,
                                                    "N": HEAD_DIM * e, "H": h, "E": e}
    # The first element checked, key dim 1: LBHNC puts it one element on; the kernel one
    # block of tokens on.
    with pytest.raises(kvabi.KVABIError, match=(
            rf"^key of layer 0, block 0, token 0, head 0, dim 1 found {(BLOCK - 1) * e} bytes "
            rf"from where vllm.LBHNC puts it \(plane 0, byte {e}\)")):
        verify_layout(declared, [kv_cache], write)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_vllm_cpu_preset_is_what_the_kernel_writes(dtype):
    """The preset ``vllm.cpu`` (keys [D, N] then values [N, D] per block-head, stated by
    components) is verified through the kernel's own write; ``vllm.cpu_kt`` (values
    transposed too) is refused at the first value it checks."""
    kv_cache, write, isa = vllm_cpu_cache(getattr(torch, dtype))
    if isa != "vec":
        pytest.skip(f"this machine's CPU_ATTN kernels are {isa}, whose tile order is not pinned")
    spec = kvabi.KVSpec("full", block_size=BLOCK, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                        dtype=dtype)
    layout = kvabi.Layout.preset("vllm.cpu", spec, BLOCKS)
    verify_layout(layout, [kv_cache], write, samples=64, seed=1)
    with pytest.raises(kvabi.KVABIError, match=r"^value of layer 0, block 0, token 0, head 0, "
                                                 r"dim 1 found .* from where vllm.cpu_kt puts"):
        verify_layout(kvabi.Layout.preset("vllm.cpu_kt", spec, BLOCKS), [kv_cache], write)
