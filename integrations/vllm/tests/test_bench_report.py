"""``kvabi bench vllm``'s report with sections left out: --skip-prefill leaves the
throughput section alone (what timing a model of a real layer count needs)."""
from kvabi_vllm.tools import bench


def _throughput(layers: int) -> dict:
    paths = {"vllm": {"backend": None, "seconds": 2.0, "tokens_per_s": 128.0,
                      "tokens_match_vllm": True, "time_vs_vllm": 1.0},
             "kvabi cpu.vllm": {"backend": "cpu.vllm", "seconds": 2.5, "tokens_per_s": 102.4,
                                "tokens_match_vllm": True, "time_vs_vllm": 1.25},
             "kvabi reference": {"backend": "reference", "skipped": "not registered here"}}
    return {"model": {"family": "llama", "layers": layers, "hidden": 256, "head_dim": 64},
            "batch": {"prompts": 8, "prompt_len": 64, "new_tokens": 32, "block_size": 32},
            "kvabi_plans": 0, "paths": paths}


def test_skip_prefill_is_a_flag_and_the_report_has_no_prefill_lines():
    args = bench.parser().parse_args(["--layers", "32", "--skip-prefill", "--skip-pd"])
    assert args.skip_prefill and args.layers == 32
    assert not bench.parser().parse_args([]).skip_prefill
    text = bench.report({"repeat": 3, "throughput": _throughput(32)})
    assert "32 layers" in text
    assert "measured: 1.25x" in text
    assert "prefill" not in text
