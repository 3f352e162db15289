"""kvabi-vllm tests run in the vLLM environment (.venv-vllm); the same Hypothesis profiles as
the core suite."""
from kvabi.testing.profiles import load_profile


def pytest_configure(config):
    load_profile(config.getoption("kvabi_profile", None))
