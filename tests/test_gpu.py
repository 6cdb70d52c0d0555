"""GPU-only checks at real sizes (skipped in the simulator): the backward pass on CuPy arrays.

The flash-attn rule: in float16 the max error of each output against a float64
reference is at most 2× (plus a hair) the error of PyTorch's own float16 math
attention against the same reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import nbflash

pytestmark = pytest.mark.gpu


def _torch_ref(q, k, v, do, causal, dtype):
    """(o, dq, dk, dv) of the materialised formula in ``dtype`` through PyTorch autograd."""
    import torch

    qt, kt, vt = (torch.as_tensor(a).to(dtype).requires_grad_() for a in (q, k, v))
    s = qt @ kt.transpose(-1, -2) / math.sqrt(qt.shape[-1])
    if causal:
        nq, nk = qt.shape[2], kt.shape[2]
        i = torch.arange(nq, device="cuda")[:, None]
        j = torch.arange(nk, device="cuda")[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    o = torch.softmax(s, -1) @ vt
    o.backward(torch.as_tensor(do).to(dtype))
    return o.detach().double(), qt.grad.double(), kt.grad.double(), vt.grad.double()


@pytest.mark.parametrize("backend", ["auto", "tensor_core"])
@pytest.mark.parametrize("n,d,causal", [(1025, 64, True), (2048, 128, False), (4096, 64, True), (4096, 128, True),
                                        (1025, 96, False)])
@pytest.mark.parametrize("deterministic", [True, False, None])
def test_backward_flash_attn_rule_fp16(n, d, causal, deterministic, backend):
    """Every dQ route of the default backward (wgmma on Hopper) and of the mma.sync one (``tensor_core``: above
    D = 64 its atomic route runs the dK/dV kernel in FlashAttention-2's warp grid, the default there; at D = 64,
    N = 4096 on sm_90 that kernel adds dQ by bulk reductions)."""
    import cupy as cp
    import torch

    q, k, v, do = (cp.random.standard_normal((1, 2, n, d)).astype(cp.float16) for _ in range(4))
    o, lse = nbflash.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic,
                                            backend=backend)
    ref = _torch_ref(q, k, v, do, causal, torch.float64)
    naive = _torch_ref(q, k, v, do, causal, torch.float16)
    for name, got, r, nv in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), ref, naive, strict=True):
        err = float((torch.as_tensor(got).double() - r).abs().max())
        bound = 2 * float((nv - r).abs().max()) + 1e-4
        assert err <= bound, f"{name}: error {err:.2e} > 2 × naive fp16 ({bound:.2e})"


@pytest.mark.parametrize("causal", [False, True])
def test_backward_fp32_real_size(causal):
    import cupy as cp
    import torch

    q, k, v, do = (cp.random.standard_normal((2, 3, 1500, 128), dtype=cp.float32) for _ in range(4))
    o, lse = nbflash.attention(q, k, v, causal=causal, return_lse=True)
    grads = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    ref = _torch_ref(q, k, v, do, causal, torch.float64)
    for got, r in zip(grads, ref[1:], strict=True):
        assert float((torch.as_tensor(got).double() - r).abs().max()) < 5e-4 * float(r.abs().max())


def test_deterministic_is_bitwise_repeatable():
    import cupy as cp

    q, k, v, do = (cp.random.standard_normal((2, 4, 1000, 64), dtype=cp.float32) for _ in range(4))
    o, lse = nbflash.attention(q, k, v, causal=True, return_lse=True)
    first = [a.get() for a in nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)]
    for _ in range(20):
        again = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again, strict=True):
            assert np.array_equal(a, b.get())


def test_side_stream_cupy():
    """Launches go on CuPy's current stream: correct without synchronising with the default stream."""
    import cupy as cp

    q, k, v = (cp.random.standard_normal((4, 8, 2048, 64), dtype=cp.float32) for _ in range(3))
    expected = nbflash.attention(q, k, v, causal=True).get()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        q2 = q * 1.0  # produced on the side stream just before use
        o = nbflash.attention(q2, k, v, causal=True)
        o2 = o + 0.0
    stream.synchronize()
    np.testing.assert_array_equal(o2.get(), expected)


def test_dynamic_shared_memory_limit_was_raised():
    """A tile configuration needing > 48 KB of shared memory runs because its kernel's limit was raised."""
    import cupy as cp

    from nbflash._device import max_dynamic_shared
    from nbflash.forward import forward_kernel, shared_bytes

    q = cp.random.standard_normal((1, 1, 300, 128), dtype=cp.float32)
    cfg = nbflash.which_backend(q, q, q).config  # the configuration the call below launches
    assert shared_bytes(cfg) > 48 * 1024
    nbflash.attention(q, q, q)
    limits = max_dynamic_shared(forward_kernel(cfg))
    assert limits and all(limit >= shared_bytes(cfg) for limit in limits)


@pytest.mark.parametrize("backend", ["tensor_core", "wgmma"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    "n_q,n_k,d,causal",
    [(97, 97, 40, True), (200, 131, 96, False), (1025, 1025, 160, True), (128, 200, 256, False),
     (1025, 1025, 256, True), (2048, 2048, 72, True), (513, 700, 136, True), (300, 300, 192, False)],
)
def test_tensor_core_backward_every_head_dim(backend, dtype_name, n_q, n_k, d, causal):
    """The tensor-core backwards forced (``backend="tensor_core"``: mma.sync; ``"wgmma"``: Hopper's) at head
    dims that are not multiples of 16 (padded inside) and above 128 (cut into 128-column slices; 136 and 192
    pad the wgmma's last slice with a zero panel), through the torch bridge and autograd: output and every
    gradient within the flash-attn 2× rule against float64."""
    import torch

    import nbflash.torch as nt

    if backend == "wgmma" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("wgmma needs compute capability 9.x")

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(n_q * 1000 + d)
    q, k, v = (torch.randn(2, 3, n, d, device="cuda", generator=gen).to(dtype) for n in (n_q, n_k, n_k))
    do = torch.randn(2, 3, n_q, d, device="cuda", generator=gen).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = nt.attention(*leaves, causal=causal, backend=backend)
    o.backward(do)
    got = (o.detach(), *(x.grad for x in leaves))
    for x, x0 in zip(leaves, (q, k, v), strict=True):
        assert torch.equal(x.detach(), x0), "an input was modified"
    ref = _torch_ref(*(x.clone() for x in (q, k, v, do)), causal, torch.float64)
    naive = _torch_ref(*(x.clone() for x in (q, k, v, do)), causal, dtype)
    for name, g, r, nv in zip(("o", "dq", "dk", "dv"), got, ref, naive, strict=True):
        assert torch.isfinite(g).all(), f"{name}: not finite"
        err = float((g.double() - r).abs().max())
        bound = 2 * float((nv - r).abs().max()) + 1e-4
        assert err <= bound, f"{backend} D={d} {name}: error {err:.2e} > 2 × naive {dtype_name} ({bound:.2e})"
