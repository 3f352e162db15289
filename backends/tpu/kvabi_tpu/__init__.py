"""kvabi-tpu: the TPU attention backends of kvabi.

``tpu.pallas`` runs Pallas TPU kernels (compiled on a TPU, interpreted elsewhere) and
``tpu.jax`` the same contract in plain jax.numpy.  Both register through the ``kvabi``
entry-point group; get them with ``kvabi.get_backend("tpu.pallas")``.
"""
__version__ = "0.1.0"
