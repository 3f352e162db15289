"""The README's three-line use runs as written (on a tiny model)."""
import pathlib
import re

from kvabi_transformers.tools.compare import cb_config, greedy_config

from tf_cases import baseline, model_of, prompts

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_readme_three_lines():
    text = (ROOT / "README.md").read_text()
    section = text.split("### In a real engine: Hugging Face transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code.count("\n") == 3
    model = model_of("llama")
    ns = {"model": model, "prompts": prompts(), "generation_config": greedy_config(6)}
    original = model.generate_batch

    def generate_batch(**kw):  # the README's call, with a small CB budget for CPU
        return original(continuous_batching_config=cb_config(), **kw)

    model.generate_batch = generate_batch
    exec(compile(code, "README.md", "exec"), ns)
    tokens = [list(o.generated_tokens) for o in ns["outputs"].values()]
    assert tokens == baseline("llama")[0]
