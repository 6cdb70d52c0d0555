"""nbflash: FlashAttention as pure-Python Numba CUDA kernels.

Exact attention, ``softmax(Q Kᵀ · scale) V``, computed by fused kernels that
never store the N×N score matrix: tiles of Q, K and V in shared memory, an
online softmax in registers, and recomputation in the backward pass.  The same
kernel source runs on an NVIDIA GPU (CuPy arrays) and, with
``NUMBA_ENABLE_CUDASIM=1``, on any CPU through Numba's CUDA simulator (NumPy arrays).

    >>> import nbflash
    >>> o = nbflash.attention(q, k, v, causal=True)            # doctest: +SKIP
    >>> o, lse = nbflash.attention(q, k, v, return_lse=True)   # doctest: +SKIP
"""

from ._device import SIMULATOR, is_available
from .api import BACKENDS, Plan, attention, attention_backward, which_backend

__version__ = "0.1.0"

__all__ = ["BACKENDS", "SIMULATOR", "Plan", "attention", "attention_backward", "is_available", "which_backend",
           "__version__"]
