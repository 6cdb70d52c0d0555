"""``python -m nbflash``: run the kernel, check it, and watch the online softmax at work.

1. Attention on random inputs (on the GPU if there is one, otherwise in Numba's
   CUDA simulator) compared with the float64 textbook formula.
2. The classic worked example of the online softmax, computed by the real
   forward kernel with its ``trace`` switch on: one query whose scores against
   four keys are (1, 2, 3, 0), seen as two key tiles of two.  The kernel
   records its running max ``m`` and running sum ``l`` after each tile:

       tile 1 (scores 1, 2):  m = 2,  l = e^(1-2) + e^(2-2)           = 1.368
       tile 2 (scores 3, 0):  m = 3,  l = 1.368·e^(2-3) + e^0 + e^-3  = 1.553

   and its output equals the softmax computed all at once.
"""

from __future__ import annotations

import math
import time

import numpy as np

from . import SIMULATOR, attention
from ._tiles import TileConfig
from .forward import launch_forward
from .reference import attention_ref


def _xp():
    if SIMULATOR:
        return np
    import cupy

    return cupy


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def worked_example():
    """Run the forward kernel on scores (1, 2, 3, 0) in two key tiles of two, with tracing on.

    Returns ``(m, l, o, lse, expected_o)``: the running max and running sum
    after each tile (natural-log units), the kernel's output and logsumexp,
    and the textbook softmax-weighted output.
    """
    xp = _xp()
    # One query, four keys, head dim 1, scale 1: the scores are just k.
    q = xp.asarray(np.array([1.0], np.float32).reshape(1, 1, 1, 1))
    k = xp.asarray(np.array([1.0, 2.0, 3.0, 0.0], np.float32).reshape(1, 1, 4, 1))
    v = xp.asarray(np.array([10.0, 20.0, 30.0, 40.0], np.float32).reshape(1, 1, 4, 1))
    o = xp.full((1, 1, 1, 1), np.nan, np.float32)  # poisoned: the kernel must write it
    lse = xp.full((1, 1, 1), np.nan, np.float32)
    trace = xp.full((1, 1, 1, 2, 2), np.nan, np.float32)
    # Key tiles of two (BLOCK_N = 2, two lanes per row); 16 rows × 2 lanes = one warp.
    cfg = TileConfig(block_m=16, block_n=2, head_dim_pad=2, threads_x=2, threads_y=16,
                     input_kind="float32", trace=True)
    launch_forward(cfg, q, k, v, o, lse, scale=1.0, causal=False, trace=trace)
    t = _host(trace)[0, 0, 0]
    scores = np.array([1.0, 2.0, 3.0, 0.0])
    p = np.exp(scores - scores.max())
    p /= p.sum()
    expected = float(p @ np.array([10.0, 20.0, 30.0, 40.0]))
    return t[:, 0], t[:, 1], float(_host(o).ravel()[0]), float(_host(lse).ravel()[0]), expected


def main() -> None:
    where = "Numba's CUDA simulator (no GPU found: NumPy arrays, one Python thread per CUDA thread)" \
        if SIMULATOR else "the GPU (CuPy arrays)"
    print(f"nbflash: running on {where}\n")

    # 1. Random attention against the float64 reference.
    xp = _xp()
    rng = np.random.default_rng()
    b, h, n_q, n_k, d = (1, 2, 19, 23, 16) if SIMULATOR else (2, 8, 1000, 1000, 64)
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for n in (n_q, n_k, n_k))
    for causal in (False, True):
        t0 = time.perf_counter()
        o = _host(attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=causal))
        dt = time.perf_counter() - t0
        ref, _ = attention_ref(q, k, v, causal=causal)
        err = float(np.abs(o - ref).max())
        verdict = "equal to the reference" if err < 1e-5 else "MISMATCH"
        print(f"attention B={b} H={h} N_q={n_q} N_k={n_k} D={d} causal={causal}: "
              f"max |o - o_ref| = {err:.1e}  ({verdict}; {dt:.2f} s incl. compilation)")

    # 2. The online softmax, traced inside the kernel.
    m, l, o, lse, expected = worked_example()
    print("\nOnline softmax, worked example: one query, scores (1, 2, 3, 0), key tiles of two")
    for j, (mj, lj) in enumerate(zip(m, l, strict=True), start=1):
        print(f"  after key tile {j}: running max m = {mj:.3f}   running sum l = {lj:.3f}")
    print(f"  output o = {o:.4f}; textbook softmax(scores) · v = {expected:.4f}; "
          f"lse = {lse:.4f} (log sum e^s = {math.log(sum(math.exp(s) for s in (1, 2, 3, 0))):.4f})")


if __name__ == "__main__":
    main()
