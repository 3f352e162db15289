"""The cases the integration tests share: tiny models, prompts, transformers' baselines."""
from kvabi_transformers.tools.compare import cb_config, run_batch
from kvabi_transformers.tools.tiny_models import tiny_model, tiny_prompts

NEW_TOKENS = 6
#: layers per family: Gemma 4 needs owners of both kinds before its KV-shared half
LAYERS = {"llama": 2, "mistral": 2, "gpt_oss": 2, "gemma4": 4}
_BASELINES: dict = {}


def prompts():
    """7 prompts of 3..29 tokens (window 8: most are longer); the three longer than 12
    tokens share a 12-token prefix."""
    return tiny_prompts(7)


def model_of(family):
    return tiny_model(family, layers=LAYERS[family], seed=1)


def model_state(model):
    """What use() changes on a model (a refused use() must leave all of it as it was)."""
    return (model.config._attn_implementation, getattr(model, "_kvabi_integration", None),
            tuple(getattr(model, "_kvabi_hooks", ()) or ()),
            dict(model._forward_pre_hooks), dict(model._forward_hooks),
            model.__dict__.get("init_continuous_batching"))


def baseline(family):
    """transformers' own generate_batch (its default CB attention) on the tiny model:
    (tokens per prompt, logits per step), computed once per family."""
    if family not in _BASELINES:
        _BASELINES[family] = run_batch(model_of(family), prompts(), NEW_TOKENS,
                                       config=cb_config())
    return _BASELINES[family]
