"""One small call of every kernel, to run under ``compute-sanitizer`` (memcheck, racecheck) on a GPU.

    compute-sanitizer --tool memcheck  python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py

Covers the forward kernel (fp32 causal with ragged tiles, fp16 bshd with a
padded head dim), the backward kernels (deterministic dQ pass and atomic dQ),
and the PyTorch bridge in bfloat16 (forward and backward).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy as cp  # noqa: E402
import torch  # noqa: E402

import nbflash  # noqa: E402
import nbflash.torch  # noqa: E402

q, k, v, do = (cp.random.standard_normal((1, 2, 200, 64), dtype=cp.float32) for _ in range(4))
o, lse = nbflash.attention(q, k, v, causal=True, return_lse=True)
for det in (True, False):
    nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=det)
h = cp.random.standard_normal((1, 77, 2, 40)).astype(cp.float16)
nbflash.attention(h, h[:, :50], h[:, :50], causal=True, layout="bshd")
qt, kt, vt = (torch.randn(1, 2, 130, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
nbflash.torch.attention(qt, kt, vt, causal=True).sum().backward()
cp.cuda.Device().synchronize()
torch.cuda.synchronize()
print("sanitize: all kernels ran")
