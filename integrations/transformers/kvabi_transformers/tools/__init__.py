"""Tooling around kvabi-transformers, apart from the runtime code it exercises: tiny random
models (:mod:`.tiny_models`), ``generate_batch`` runs to compare (:mod:`.compare`), timing
(:mod:`.timing`), ``kvabi-transformers demo`` (:mod:`.demo`) and ``kvabi bench transformers``
(:mod:`.bench`)."""
