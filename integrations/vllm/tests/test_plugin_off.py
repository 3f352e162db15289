"""Without KVABI_VLLM_BACKEND the vLLM plugin changes nothing in vLLM."""
import os
import subprocess
import sys


def test_register_is_a_noop_without_the_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVABI_VLLM")}
    code = (
        "import sys; from kvabi_vllm.vllm_plugin import register; register(); "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False", "the plugin imported vLLM although it was not switched on"
