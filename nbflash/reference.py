"""A float64 NumPy reference that materialises the N×N matrices — the textbook formula.

Used by the tests and the demo to check the kernels.  Shapes ``(B, H, N, D)``.
The causal mask is the bottom-right aligned one documented in :mod:`nbflash.masking`,
written here independently of the kernels' tile logic.
"""

from __future__ import annotations

import math

import numpy as np


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """Boolean ``(seqlen_q, seqlen_k)``: True where query i sees key j."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, *, causal=False, scale=None, dtype=np.float64):
    """``(o, lse)`` computed in ``dtype`` (float64 by default) from materialised S and P.

    Rows that see no key give ``o = 0`` and ``lse = -inf``.
    """
    q, k, v = (np.asarray(x).astype(dtype) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, k) * dtype(scale)
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe)
    l = p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.einsum("bhij,bhjd->bhid", p, v) / l
        lse = (m_safe + np.log(l))[..., 0]
    o = np.where(l > 0, o, 0)
    return o.astype(dtype), lse.astype(dtype)


def attention_backward_ref(do, q, k, v, *, causal=False, scale=None):
    """``(dq, dk, dv)`` in float64 from the materialised formula."""
    do, q, k, v = (np.asarray(x).astype(np.float64) for x in (do, q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhij,bhjd->bhid", ds, k) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * scale
    return dq, dk, dv
