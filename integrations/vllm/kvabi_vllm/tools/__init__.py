"""Tooling around kvabi-vllm, apart from the runtime code it exercises: tiny checkpoints
(:mod:`.checkpoints`), in-process engines (:mod:`.engine`), a P/D pair in two processes
(:mod:`.pd`), ``kvabi-vllm demo`` (:mod:`.demo`, :mod:`.demo_pd`) and the benchmarks
(:mod:`.bench`, :mod:`.bench_pd`, :mod:`.cpu_bench`).  Nothing here runs inside a served
engine."""
