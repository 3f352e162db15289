"""vLLM on kvabi: an attention-backend plugin (``KVABI_VLLM_BACKEND``), vLLM's compiled CPU
attention as the kvabi backend ``cpu.vllm``, and ``KvabiConnector`` (P/D and a host tier across
layouts). Importing this package imports neither vLLM nor torch."""
