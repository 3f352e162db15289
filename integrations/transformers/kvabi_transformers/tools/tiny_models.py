"""Tiny random-weight decoder models built from configs (no downloads), for tests, the demo
and the benchmark.

Default initialisation gives tiny models near-constant greedy continuations (one token
repeated), which would make token comparisons prove nothing; weights are redrawn with a
larger spread (linear layers std ``LINEAR_STD``) so that continuations vary.
"""
from __future__ import annotations

LINEAR_STD = 0.3
FAMILIES = ("llama", "mistral", "gpt_oss", "gemma4")


def tiny_config(family: str, *, layers: int = 2, hidden: int = 64, window: int = 8,
                shared: int | None = None, vocab: int = 128, global_head_dim: int = 16):
    """A transformers config of ``family`` (one of :data:`FAMILIES`) small enough for a CPU
    test: ``layers`` decoder layers of width ``hidden``, sliding window ``window`` where the
    family has one, and (Gemma 4) ``shared`` KV-shared layers (default: half) and the head
    size ``global_head_dim`` of its full-attention layers (transformers' own continuous
    batching needs it equal to ``head_dim``, 16)."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=window)
    if family == "gpt_oss":
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return tf.GptOssConfig(**common, sliding_window=window, layer_types=kinds,
                               num_local_experts=4, num_experts_per_tok=2)
    if family == "gemma4":
        shared = layers // 2 if shared is None else shared
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        kinds[-1] = "full_attention"
        first_shared = layers - shared
        if shared and "sliding_attention" not in kinds[:first_shared]:
            kinds[0] = "sliding_attention"
        common.pop("tie_word_embeddings")
        return tf.Gemma4TextConfig(**common, sliding_window=window, layer_types=kinds,
                                   num_kv_shared_layers=shared, global_head_dim=global_head_dim,
                                   vocab_size_per_layer_input=vocab,
                                   hidden_size_per_layer_input=16,
                                   tie_word_embeddings=True)
    raise ValueError(f"family: must be one of {', '.join(FAMILIES)}, got {family!r}")


def tiny_model(family: str, *, seed: int = 0, dtype: str = "float32", **config_kwargs):
    """A random-weight causal LM of ``family`` (see :func:`tiny_config`), weights redrawn with
    a fixed ``seed`` so that greedy continuations vary; eval mode, CPU, eager attention."""
    import torch
    import transformers as tf

    config = tiny_config(family, **config_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = tf.Gemma4ForCausalLM if family == "gemma4" else tf.AutoModelForCausalLM.from_config
    model = cls(config) if family == "gemma4" else cls(config, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Embeddings keep their default scale: large tied embeddings make Gemma's
            # scaled logits saturate and repeat one token.
            if p.ndim >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * LINEAR_STD)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
    return model.to(getattr(torch, dtype)).eval()


def tiny_prompts(n: int = 6, *, lengths=(3, 5, 11, 17, 23, 29), vocab: int = 128,
                 shared_prefix: int = 12, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of mixed lengths (cycling ``lengths``); those longer than
    ``shared_prefix`` tokens all start with the same ``shared_prefix`` tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, vocab, shared_prefix).tolist()
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        toks = rng.integers(3, vocab, length).tolist()
        if length > shared_prefix:
            toks[:shared_prefix] = prefix
        out.append(toks)
    return out
