"""Tiny random-weight float32 checkpoints that vLLM loads from disk, for tests, the demo and
the benchmark (no hub, no tokenizer: prompts are token ids).

vLLM's ``load_format="dummy"`` fills weights in +-1e-3 and tiny models with default
initialisation repeat one token: greedy continuations that compare nothing.  Here every
matrix except the embeddings is redrawn with std :data:`LINEAR_STD`, so continuations vary
(:func:`distinct_tokens` measures it; the tests check it).
"""
from __future__ import annotations

import json
from pathlib import Path

from kvabi.errors import KVABIError

LINEAR_STD = 0.3
#: Llama-like; Mistral-like (sliding window on every layer); Gemma-3-like (sliding and full
#: layers: two KV groups in vLLM's hybrid allocator); Gemma-3n-like (its last layers read
#: earlier layers' caches: KV sharing, and ``kv_sharing_fast_prefill``).
FAMILIES = ("llama", "mistral", "gemma3", "gemma3n")


def tiny_config(family: str, *, layers: int = 4, hidden: int = 128, head_dim: int = 32,
                heads: int = 4, kv_heads: int = 2, window: int = 16, vocab: int = 256,
                shared: int | None = None):
    """A transformers config of ``family`` (:data:`FAMILIES`) small enough for a CPU test:
    ``layers`` decoder layers of width ``hidden``, ``heads`` query heads over ``kv_heads`` KV
    heads of ``head_dim`` (vLLM's CPU kernels take head sizes from 32), sliding ``window``
    where the family has one, and (Gemma 3n) ``shared`` KV-shared layers (default: half)."""
    import transformers as tf

    if family not in FAMILIES:
        raise KVABIError(f"family: must be one of {', '.join(FAMILIES)}, got {family!r}")
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=4096, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**common)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=window)
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if family == "gemma3":
        return tf.Gemma3TextConfig(**common, sliding_window=window, layer_types=kinds,
                                   query_pre_attn_scalar=head_dim)
    shared = layers // 2 if shared is None else shared
    if not 0 <= shared < layers - 1:
        raise KVABIError(f"shared: must be in [0, {layers - 1}) for {layers} layers, "
                         f"got {shared}")
    # The last layer of each kind before the shared ones is the one they read: both kinds
    # must occur there.
    kinds[-1] = "full_attention"
    common["intermediate_size"] = [2 * hidden] * layers
    common["tie_word_embeddings"] = True  # vLLM's Gemma 3n has no separate lm_head
    return tf.Gemma3nTextConfig(**common, sliding_window=window, layer_types=kinds,
                                num_kv_shared_layers=shared,
                                activation_sparsity_pattern=[0.0] * layers,
                                vocab_size_per_layer_input=vocab,
                                hidden_size_per_layer_input=16, laurel_rank=8,
                                altup_num_inputs=4)


def write_checkpoint(family: str, path, *, seed: int = 0, **config_kwargs) -> Path:
    """Write a random float32 checkpoint of ``family`` (safetensors + config.json) into
    directory ``path`` and return it.  Matrices (embeddings excepted) are redrawn with std
    :data:`LINEAR_STD` from ``seed``; the same arguments give the same bytes."""
    import torch
    import transformers as tf

    config = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "gemma3": tf.Gemma3ForCausalLM, "gemma3n": tf.Gemma3nForCausalLM}[family]
    model = cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Embeddings keep their default scale: Gemma multiplies them by sqrt(hidden) and
            # large ones saturate the logits into one repeated token.
            if p.ndim >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * LINEAR_STD)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


def prompts(n: int = 4, *, lengths=(5, 13, 29, 41), vocab: int = 256, shared_prefix: int = 16,
            seed: int = 0) -> list[list[int]]:
    """``n`` prompts of token ids of mixed lengths (cycling ``lengths``); those longer than
    ``shared_prefix`` start with the same ``shared_prefix`` tokens (prefix-cache hits)."""
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


def distinct_tokens(outputs: list[list[int]]) -> int:
    """The fewest distinct tokens in any one continuation: 1 means a repeated token (a
    comparison of such outputs proves little)."""
    return min((len(set(o)) for o in outputs), default=0)
