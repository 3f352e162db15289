"""``kvabi-transformers serve``: transformers' own OpenAI-compatible server
(``transformers serve --continuous-batching``) with attention and the KV cache on kvabi and,
with ``--kv-transfer-config``, kvabi's P/D protocol (:mod:`.serve`, :mod:`.routes`)."""
