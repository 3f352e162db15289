"""kvabi inside Hugging Face transformers: continuous batching (``generate_batch``) with K/V
in kvabi layouts and attention on any kvabi backend.

    import kvabi_transformers
    kvabi_transformers.use(model, backend="tpu.jax", layout="tpu.combined")
    outputs = model.generate_batch(inputs=prompts, generation_config=config)
"""
from .compat import TransformersMismatch

__all__ = ["TransformersMismatch", "use"]
__version__ = "0.1.0"


def __getattr__(name):
    # ``use`` imported on first use: kvabi loads this package's plugin hooks with every
    # backend lookup, and transformers' continuous batching imports torch._dynamo and so
    # triton, before kvabi-cuda could turn Triton's interpreter on where there is no GPU.
    if name == "use":
        from .integration import use

        return use
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
