"""Small torch float64 emulators of the documented semantics of FlashInfer's paged API and
flash-attn's varlen paged interface.  Written from the libraries' documentation, not from
kvabi's code, so that the adapters' argument translation is checked against what the real
kernels are documented to compute.  Each validates the documented argument constraints."""
