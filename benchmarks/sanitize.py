"""One small call of every kernel, to run under ``compute-sanitizer`` (memcheck, racecheck) on a GPU.

    compute-sanitizer --tool memcheck  python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize.py

Covers the SIMT forward kernel (fp32 causal with ragged tiles, by cp.async
at D = 64 and D = 128 with seqlen_q ≠ seqlen_k; fp16 bshd with a head dim
that is not a multiple of 8: plain loads), the SIMT backward kernels
(deterministic dQ pass and atomic dQ), the tensor-core kernels (forward at
head dims 40, 64, 128 and 256 — padding, Q in registers or shared memory,
one and two m-tiles per warp, both K/V pipelines; backward at 64 and 128, both dQ routes), and the
PyTorch bridge in bfloat16 (forward and backward, tensor cores), and on a Hopper GPU the wgmma forward
(every pipeline, the warp-specialised ones' named-barrier handshakes included; head dims 40 to 256, ragged
K/V, rows that see no key) and the wgmma backward (one and two warpgroups, streamed tiles of 16 to 64 rows,
two and three buffers each).
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
q2 = cp.random.standard_normal((1, 2, 150, 128), dtype=cp.float32)
nbflash.attention(q2, q2[:, :, :131], q2[:, :, :131], causal=True)  # cp.async copies: ragged K/V, rows with no key
h = cp.random.standard_normal((1, 77, 2, 36)).astype(cp.float16)
nbflash.attention(h, h[:, :50], h[:, :50], causal=True, layout="bshd")
for d in (40, 64, 128, 256):  # tensor cores: ragged tiles, causal, seqlen_q != seqlen_k
    x = cp.random.standard_normal((1, 97, 2, d)).astype(cp.float16)
    o16, lse16 = nbflash.attention(
        x, x[:, :90], x[:, :90], causal=True, layout="bshd", return_lse=True, backend="tensor_core"
    )
    if d in (64, 128):
        for det in (True, False):
            nbflash.attention_backward(
                x,
                x,
                x[:, :90],
                x[:, :90],
                o16,
                lse16,
                causal=True,
                layout="bshd",
                deterministic=det,
                backend="tensor_core",
            )
from nbflash import forward_tc  # noqa: E402

x = cp.random.standard_normal((1, 2, 150, 64)).astype(cp.float16)
o2, l2 = cp.empty_like(x), cp.empty((1, 2, 150), dtype=cp.float32)
forward_tc.launch_forward_tc(forward_tc.TCConfig(128, 64, 64, "float16", m_tiles=2), x, x, x, o2, l2, 0.125, True)
if nbflash._device.compute_capability()[0] == 9:  # the wgmma forward, both pipelines, several panels
    from nbflash import forward_wgmma  # noqa: E402

    for d, bm, bn, pipe in ((64, 128, 64, "plain"), (128, 128, 128, "plain"), (128, 128, 64, "overlap"),
                            (256, 128, 64, "overlap"), (40, 64, 128, "overlap"), (128, 128, 128, "pingpong"),
                            (96, 128, 64, "pingpong"), (128, 128, 128, "ws:2"), (64, 128, 16, "ws:3"),
                            (64, 128, 32, "ws-overlap:3")):  # the last two cycle their stages (9 and 5 key tiles)
        x = cp.random.standard_normal((1, 2, 150, d)).astype(cp.float16)
        o3, l3 = cp.empty_like(x), cp.empty((1, 2, 150), dtype=cp.float32)
        pipe, _, stages = pipe.partition(":")
        cfg = forward_wgmma.WGConfig(bm, bn, d, "float16", pipe, **({"stages": int(stages)} if stages else {}))
        forward_wgmma.launch_forward_wgmma(cfg, x, x[:, :, :131], x[:, :, :131], o3, l3, 0.125, True)
    from nbflash import backward_wgmma  # noqa: E402

    # the wgmma backward: one and two warpgroups, 2 and 3 buffers per streamed tile (products in flight
    # across the next tile's barrier)
    for d, bm, bn, st in ((64, 64, 64, 2), (128, 128, 64, 2), (128, 128, 64, 3), (96, 128, 32, 2), (40, 64, 16, 3)):
        x = cp.random.standard_normal((1, 2, 150, d)).astype(cp.float16)
        kv = x[:, :, :131]  # ragged K/V, seqlen_q != seqlen_k, rows that see no key; the buffers cycle
        o4, l4 = nbflash.attention(x, kv, kv, causal=True, return_lse=True)
        grads = [cp.empty_like(a) for a in (x, kv, kv)]
        cfg = backward_wgmma.WGBackwardConfig(bm, bn, d, "float16", dkdv_stages=st, dq_stages=st)
        backward_wgmma.launch_backward_wgmma(cfg, x, x, kv, kv, o4, l4, *grads, 0.125, True)
qt, kt, vt = (torch.randn(1, 2, 130, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
nbflash.torch.attention(qt, kt, vt, causal=True).sum().backward()
cp.cuda.Device().synchronize()
torch.cuda.synchronize()
print("sanitize: all kernels ran")
