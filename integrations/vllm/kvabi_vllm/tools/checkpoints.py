"""Tiny random-weight float32 checkpoints that vLLM loads from disk, for tests, the demo, the
benchmark and the quick start (no hub).  Without a tokenizer prompts are token ids (vLLM's
``skip_tokenizer_init``); with one (:func:`write_tokenizer`: bytes as tokens) a server takes
text and chat messages and answers in text (random bytes: the weights are random).

``python -m kvabi_vllm.tools.checkpoints --help`` writes one from the command line.

vLLM's ``load_format="dummy"`` fills weights in +-1e-3 and tiny models with default
initialisation repeat one token: greedy continuations that compare nothing.  Here every
matrix except the embeddings is redrawn with std :data:`LINEAR_STD`, so continuations vary
(:func:`distinct_tokens` measures it; the tests check it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvabi.util.errors import KVABIError

LINEAR_STD = 0.3
#: the tokenizer's special tokens, at the ids the configs name (pad 0, bos 1, eos 2), then
#: one token per byte: its vocabulary size
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
TOKENIZER_VOCAB = len(SPECIAL_TOKENS) + 256
#: a chat template for the byte tokenizer: "role: content" lines, then "assistant:"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
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


def write_tokenizer(path) -> Path:
    """Write a byte-level tokenizer (``tokenizer.json``, ``tokenizer_config.json`` with
    :data:`CHAT_TEMPLATE`) into directory ``path``: :data:`SPECIAL_TOKENS`, then one token
    per byte (:data:`TOKENIZER_VOCAB` in all; a model needs at least that vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    pad, bos, eos = SPECIAL_TOKENS
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": pad, "bos_token": bos,
        "eos_token": eos, "model_max_length": 4096, "chat_template": CHAT_TEMPLATE},
        indent=1))
    return path


def write_checkpoint(family: str, path, *, seed: int = 0, tokenizer: bool = False,
                     **config_kwargs) -> Path:
    """Write a random float32 checkpoint of ``family`` (safetensors + config.json) into
    directory ``path`` and return it.  Matrices (embeddings excepted) are redrawn with std
    :data:`LINEAR_STD` from ``seed``; the same arguments give the same bytes.  With
    ``tokenizer`` a byte tokenizer goes with it (:func:`write_tokenizer`; the vocabulary
    defaults to :data:`TOKENIZER_VOCAB`)."""
    import torch
    import transformers as tf

    if tokenizer:
        config_kwargs.setdefault("vocab", TOKENIZER_VOCAB)
        if config_kwargs["vocab"] < TOKENIZER_VOCAB:
            raise KVABIError(f"vocab: the byte tokenizer needs {TOKENIZER_VOCAB} tokens, got "
                             f"{config_kwargs['vocab']}")
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
    if tokenizer:
        write_tokenizer(path)
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


def main(argv=None) -> int:
    """``python -m kvabi_vllm.tools.checkpoints PATH``: write a checkpoint vLLM can serve."""
    from kvabi.util.argtypes import int_arg

    p = argparse.ArgumentParser(
        prog="python -m kvabi_vllm.tools.checkpoints",
        description="Write a tiny random float32 checkpoint (safetensors, config.json and a "
                    "byte tokenizer) that vLLM loads from disk, e.g. for `kvabi-vllm serve "
                    "PATH`. Random weights: the text it generates is random bytes.")
    p.add_argument("path", help="directory to write (created if missing)")
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="architecture (llama; mistral: sliding window; gemma3: sliding and "
                        "full layers; gemma3n: KV-shared layers); default llama")
    p.add_argument("--layers", type=int_arg(1, 1024), default=4,
                   help="decoder layers (default 4)")
    p.add_argument("--head-dim", type=int_arg(1, 1024), default=32,
                   help="head size (default 32; vLLM's CPU kernels take 32 and up)")
    p.add_argument("--seed", type=int_arg(0, 2**31 - 1), default=0,
                   help="seed of the weights (default 0: the same bytes every time)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="leave the tokenizer out (prompts are then token ids and vLLM needs "
                        "--skip-tokenizer-init)")
    a = p.parse_args(argv)
    path = write_checkpoint(a.family, a.path, seed=a.seed, tokenizer=not a.no_tokenizer,
                            layers=a.layers, head_dim=a.head_dim)
    print(f"wrote a random {a.family}-like checkpoint ({a.layers} layers, head size "
          f"{a.head_dim}) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
