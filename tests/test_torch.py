"""nbflash.torch: the PyTorch bridge, its custom ops, autograd and torch.compile.

In the simulator (CPU tensors) every test but the ``gpu`` ones runs: the
bridge, autograd and compile wiring are the same code on both.  Sizes are tiny
and odd on purpose (each simulator call costs 0.1-1 s).  The ``gpu`` tests
check what only a GPU can show: zero-copy pointers, PyTorch's stream and
allocator, real sizes.

References: the textbook formula materialised in float64 with torch (its
autograd gives the reference gradients); in low precision the flash-attn rule —
at most twice the error of the same formula computed in that precision.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nbflash  # noqa: E402
import nbflash.api  # noqa: E402
import nbflash.torch as nbt  # noqa: E402

LOW_PRECISION = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------
# References and helpers
# ----------------------------------------------------------------------------


def attention_ref(q, k, v, *, causal=False, scale=None, layout="bhsd", dtype=torch.float64):
    """``(o, lse)`` of softmax(Q Kᵀ · scale) V computed in ``dtype`` from the materialised S and P.

    Differentiable; bottom-right causal mask (query i sees key j iff
    j <= i + Nk - Nq); a row that sees no key gives o = 0, lse = -inf and no gradient.
    """
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.to(dtype) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2:]
        i = torch.arange(nq, device=s.device)[:, None]
        j = torch.arange(nk, device=s.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()  # o does not depend on m: keep it out of the graph
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    o = (p @ v) / torch.where(l > 0, l, torch.ones_like(l))
    lse = (m + torch.log(l)).squeeze(-1)
    if layout == "bshd":
        o = o.transpose(1, 2)
    return o, lse


#: Where the bridge runs here: CPU tensors in the simulator, CUDA tensors on a GPU.
DEV = "cpu" if nbflash.SIMULATOR else "cuda"


def make_qkv(shape_q, shape_kv, dtype, *, device=DEV, requires_grad=False, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    return tuple(x.to(device=device, dtype=dtype).requires_grad_(requires_grad) for x in (q, k, v))


def shapes(b, h, nq, nk, d, layout):
    if layout == "bhsd":
        return (b, h, nq, d), (b, h, nk, d)
    return (b, nq, h, d), (b, nk, h, d)


def assert_flash_rule(out, ref64, naive, what):
    """flash-attn's rule: ``|out - ref| <= 2 |naive - ref| + one rounding step at the output's magnitude``."""
    err = (out.double() - ref64).abs().max().item()
    naive_err = (naive.double() - ref64).abs().max().item()
    slack = torch.finfo(out.dtype).eps * max(1.0, ref64.abs().max().item())
    assert err <= 2 * naive_err + slack, f"{what}: error {err:.3g} > 2 x naive {out.dtype} error {naive_err:.3g}"


def grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def reference_grads(q, k, v, do, **kwargs):
    """``(o, (dq, dk, dv))`` of :func:`attention_ref`, all float64 (from float64 copies of the inputs)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    o, _ = attention_ref(q, k, v, **kwargs)
    return o, grads(o, (q, k, v), do.double())


# ----------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------

FWD_CASES = [(1, 2, 5, 7, 3), (2, 1, 9, 4, 5)]  # (B, H, Nq, Nk, D)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", FWD_CASES)
def test_forward_matches_float64_reference(case, causal, layout):
    b, h, nq, nk, d = case
    q, k, v = make_qkv(*shapes(b, h, nq, nk, d, layout), torch.float32)
    o, lse = torch.ops.nbflash.attention_fwd(q, k, v, causal, None, layout)
    o_ref, lse_ref = attention_ref(q, k, v, causal=causal, layout=layout)
    assert o.shape == q.shape and o.dtype == torch.float32 and o.is_contiguous()
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(nbt.attention(q, k, v, causal=causal, layout=layout), o, atol=0, rtol=0)


def test_forward_float64_and_scale():
    q, k, v = make_qkv((1, 2, 6, 3), (1, 2, 5, 3), torch.float64)
    o, lse = torch.ops.nbflash.attention_fwd(q, k, v, True, 0.7, "bhsd")
    o_ref, lse_ref = attention_ref(q, k, v, causal=True, scale=0.7)
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12)  # first row: -inf on both sides


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_forward_low_precision_flash_rule(dtype):
    q, k, v = make_qkv((1, 2, 11, 6), (1, 2, 13, 6), dtype, seed=1)
    o = nbt.attention(q, k, v, causal=True)
    assert o.dtype == dtype
    o_ref, _ = attention_ref(q, k, v, causal=True)
    o_naive, _ = attention_ref(q, k, v, causal=True, dtype=dtype)
    assert_flash_rule(o, o_ref, o_naive, f"o {dtype}")


# ----------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------

# fp32 against the float64 gradients directly; fp16/bf16 by the flash-attn rule.
GRAD_CASES = [
    pytest.param(torch.float32, (1, 2, 5, 7, 3), id="fp32-Nq<Nk"),
    pytest.param(torch.float32, (2, 1, 7, 4, 5), id="fp32-Nq>Nk"),
    pytest.param(torch.float16, (1, 2, 9, 6, 4), id="fp16"),
    pytest.param(torch.bfloat16, (1, 2, 6, 9, 4), id="bf16"),
]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, case", GRAD_CASES)
def test_gradients_match_float64_autograd(dtype, case, causal, layout):
    b, h, nq, nk, d = case
    q, k, v = make_qkv(*shapes(b, h, nq, nk, d, layout), dtype, requires_grad=True, seed=2)
    o = nbt.attention(q, k, v, causal=causal, layout=layout)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEV, dtype)
    dq, dk, dv = grads(o, (q, k, v), do)
    assert [g.dtype for g in (dq, dk, dv)] == [dtype] * 3
    assert [g.shape for g in (dq, dk, dv)] == [q.shape, k.shape, v.shape]

    o_ref, ref = reference_grads(q, k, v, do, causal=causal, layout=layout)
    if dtype == torch.float32:
        torch.testing.assert_close(o.double(), o_ref, atol=2e-6, rtol=1e-5)
        for name, g, r in zip("qkv", (dq, dk, dv), ref, strict=True):
            torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")
        return
    o_naive, _ = attention_ref(q, k, v, causal=causal, layout=layout, dtype=dtype)
    naive = grads(o_naive, (q, k, v), do)
    assert_flash_rule(o, o_ref, o_naive, "o")
    for name, g, r, n in zip("qkv", (dq, dk, dv), ref, naive, strict=True):
        assert_flash_rule(g, r, n, f"d{name}")


@pytest.mark.parametrize("causal, nq, nk", [(False, 3, 4), (True, 3, 4), (True, 4, 3)])
def test_gradcheck_float64(causal, nq, nk):
    # (True, 4, 3): query 0 sees no key -- its output is the constant 0.
    q, k, v = make_qkv((1, 1, nq, 2), (1, 1, nk, 2), torch.float64, requires_grad=True, seed=4)
    assert torch.autograd.gradcheck(lambda q, k, v: nbt.attention(q, k, v, causal=causal), (q, k, v))


def test_lse_is_not_differentiable():
    q, k, v = make_qkv((1, 1, 3, 2), (1, 1, 3, 2), torch.float32, requires_grad=True)
    o, lse = torch.ops.nbflash.attention_fwd(q, k, v, False, None, "bhsd")
    assert o.requires_grad and not lse.requires_grad


def test_inference_skips_autograd_and_matches_training_forward():
    """No input needs a gradient (or grad mode is off): the forward builds no autograd node, same bits."""
    q, k, v = make_qkv((1, 2, 5, 3), (1, 2, 6, 3), torch.float32, requires_grad=True)
    o_train = nbt.attention(q, k, v, causal=True)
    assert o_train.grad_fn is not None
    with torch.no_grad():
        o_nograd = nbt.attention(q, k, v, causal=True)
    o_plain = nbt.attention(*(x.detach() for x in (q, k, v)), causal=True)
    for o in (o_nograd, o_plain):
        assert o.grad_fn is None and not o.requires_grad
        assert torch.equal(o, o_train.detach())


def test_double_backward_refused():
    """Gradients are kernel outputs: differentiating them again must raise, never give zeros."""
    q, k, v = make_qkv((1, 1, 3, 2), (1, 1, 4, 2), torch.float64, requires_grad=True)
    (dq,) = torch.autograd.grad(nbt.attention(q, k, v).square().sum(), (q,), create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()
    # without create_graph the same gradient comes from the unwrapped path
    (dq_plain,) = torch.autograd.grad(nbt.attention(q, k, v).square().sum(), (q,))
    assert torch.equal(dq.detach(), dq_plain)


# ----------------------------------------------------------------------------
# Strides and zero-copy
# ----------------------------------------------------------------------------


def spy(monkeypatch, name):
    """Record the arrays nbflash.api.<name> receives and returns."""
    calls = []
    real = getattr(nbflash.api, name)

    def wrapper(*arrays, **kwargs):
        out = real(*arrays, **kwargs)
        calls.append((arrays, out, kwargs))
        return out

    monkeypatch.setattr(nbflash.api, name, wrapper)
    return calls


def host_ptr(a) -> int:
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_simulator_bridge_is_zero_copy(monkeypatch, dtype):
    if not nbflash.SIMULATOR:
        pytest.skip("the NumPy bridge runs in the simulator")
    fwd = spy(monkeypatch, "forward_arrays")
    bwd = spy(monkeypatch, "backward_arrays")
    # Slices of a packed (B, N, 3, H, D) tensor: bshd views whose last axis is contiguous.
    qkv = torch.randn(1, 5, 3, 2, 4, dtype=dtype)
    q, k, v = (qkv[:, :, i].requires_grad_() for i in range(3))
    o = nbt.attention(q, k, v, layout="bshd")
    o.backward(torch.ones_like(o))
    (arrays, (o_arr, lse_arr), kwargs) = fwd[0]
    assert [host_ptr(a) for a in arrays] == [t.data_ptr() for t in (q, k, v)]
    assert kwargs["bf16_bits"] == (dtype == torch.bfloat16)
    assert host_ptr(o_arr) == o.data_ptr()
    (arrays, (dq_arr, _, _), _) = bwd[0]
    assert host_ptr(arrays[1]) == q.data_ptr()
    assert host_ptr(arrays[4]) == o.data_ptr()
    assert host_ptr(dq_arr) == q.grad.data_ptr()


def test_strided_inputs_and_gradients():
    """Packed-qkv slices go in as they are; a strided last axis is copied; so is an expanded ``do``."""
    b, n, h, d = 1, 6, 2, 3
    qkv = torch.randn(b, n, 3, h, d, dtype=torch.float64, device=DEV)
    q = qkv[:, :, 0].requires_grad_()  # bshd view, last axis contiguous
    k_t = torch.randn(b, n, h, d, dtype=torch.float64, device=DEV).transpose(-1, -2).contiguous().transpose(-1, -2)
    k = k_t.requires_grad_()  # last axis stride n*... != 1: copied by the bridge
    v = qkv[:, :, 2].requires_grad_()
    assert k.stride(-1) != 1
    o = nbt.attention(q, k, v, causal=True, layout="bshd")
    o.sum().backward()  # do = ones expanded: every stride 0
    o_ref, _ = attention_ref(q, k, v, causal=True, layout="bshd")
    ref = torch.autograd.grad(o_ref.sum(), (q, k, v))
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12)
    for g, r in zip((q.grad, k.grad, v.grad), ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-10)


def test_inputs_not_modified():
    q, k, v = make_qkv((1, 2, 5, 3), (1, 2, 4, 3), torch.bfloat16, requires_grad=True)
    saved = [x.detach().clone() for x in (q, k, v)]
    o = nbt.attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    do_saved, o_saved = do.clone(), o.detach().clone()
    o.backward(do)
    for x, s in zip((q, k, v, do, o), (*saved, do_saved, o_saved), strict=True):
        assert torch.equal(x.detach().view(torch.int16), s.view(torch.int16))


# ----------------------------------------------------------------------------
# torch.library: opcheck and torch.compile
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_opcheck(layout):
    q, k, v = make_qkv(*shapes(1, 2, 5, 4, 3, layout), torch.float32, requires_grad=True, seed=5)
    torch.library.opcheck(torch.ops.nbflash.attention_fwd.default, (q, k, v, True, None, layout))
    o, lse = torch.ops.nbflash.attention_fwd(q, k, v, True, 0.5, layout)
    do = torch.randn_like(o)
    args = (do, q.detach(), k.detach(), v.detach(), o.detach(), lse, True, 0.5, layout)
    torch.library.opcheck(torch.ops.nbflash.attention_bwd.default, args)


def test_opcheck_bfloat16():
    q, k, v = make_qkv((1, 1, 3, 2), (1, 1, 4, 2), torch.bfloat16, requires_grad=True)
    torch.library.opcheck(torch.ops.nbflash.attention_fwd.default, (q, k, v, False, None, "bhsd"))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def f(q, k, v):
        return nbt.attention(q, k, v, causal=True, layout="bshd") * 2.0

    q, k, v = make_qkv((1, 5, 2, 3), (1, 7, 2, 3), torch.float32, requires_grad=True, seed=6)
    compiled = torch.compile(f, fullgraph=True)
    o = compiled(q, k, v)
    g = grads(o, (q, k, v), torch.ones_like(o))
    o_eager = f(q, k, v)
    g_eager = grads(o_eager, (q, k, v), torch.ones_like(o_eager))
    torch.testing.assert_close(o, o_eager, atol=0, rtol=0)
    for a, b in zip(g, g_eager, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ----------------------------------------------------------------------------
# Errors: refused before any launch
# ----------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if a kernel would be launched."""

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    # Both forward kernels, patched on their modules: nbflash.api and the bridge's GPU route look them up there.
    monkeypatch.setattr(nbflash.forward, "launch_forward", refuse)
    monkeypatch.setattr(nbflash.forward_tc, "launch_forward_tc", refuse)
    monkeypatch.setattr(nbflash.backward, "launch_backward", refuse)
    monkeypatch.setattr(nbflash.backward_tc, "launch_backward_tc", refuse)


def _qkv(dtype=torch.float32, nq=3, nk=4, d=2, device=DEV):
    return make_qkv((1, 1, nq, d), (1, 1, nk, d), dtype, device=device)


def test_error_not_a_tensor(no_launch):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got numpy.ndarray"):
        nbt.attention(q, k, v.detach().cpu().numpy())


def test_error_unsupported_dtype(no_launch):
    q, k, v = (x.to(torch.int32) for x in _qkv())
    with pytest.raises(TypeError, match="q must be float16, bfloat16, float32 or float64, got torch.int32"):
        nbt.attention(q, k, v)


def test_error_mixed_dtypes(no_launch):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="k must have dtype torch.float32 like q, got torch.float16"):
        nbt.attention(q, k.half(), v)


def test_error_mixed_devices(no_launch):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"v is on meta but q is on {DEV}"):
        nbt.attention(q, k, v.to("meta"))


def test_error_cuda_tensor_in_simulator(no_launch):
    if not nbflash.SIMULATOR:
        pytest.skip("simulator only")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # CUDA tensors without a GPU: they carry a device and a dtype, no data
        q, k, v = (torch.empty(1, 1, 3, 2, device="cuda") for _ in range(3))
    with pytest.raises(TypeError, match="q is on cuda:0, but the CUDA simulator is active"):
        nbt.attention(q, k, v)


def test_error_cpu_tensor_without_simulator(monkeypatch, no_launch):
    monkeypatch.setattr(nbt, "SIMULATOR", False)
    with pytest.raises(TypeError, match="nbflash.torch needs CUDA tensors; q is on cpu"):
        nbt.attention(*_qkv(device="cpu"))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(layout="sbhd"), ValueError, "layout must be 'bhsd'"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(scale="0.5"), TypeError, "scale must be a real number"),
    ],
)
def test_error_flags(no_launch, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        nbt.attention(*_qkv(), **kwargs)


def test_error_shapes(no_launch):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        nbt.attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="must be 4-D"):
        nbt.attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="head dim must be at most 256"):
        nbt.attention(*_qkv(d=257))


def test_error_backward_op_dtypes(no_launch):
    q, k, v = _qkv()
    o, lse = q.clone(), q.new_zeros(1, 1, 3)
    with pytest.raises(TypeError, match="do must have dtype torch.float32 like q, got torch.float64"):
        torch.ops.nbflash.attention_bwd(o.double(), q, k, v, o, lse, False, None, "bhsd")
    with pytest.raises(TypeError, match="lse must have dtype float32"):
        torch.ops.nbflash.attention_bwd(o, q, k, v, o, lse.double(), False, None, "bhsd")


# ----------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------


def launch_spy(monkeypatch):
    """Record the descriptors (nbflash._launch.ArrayArg) the bridge's GPU forward launches a kernel on."""
    calls = []
    launchers = ((nbt._fwd, "launch_forward"), (nbt._tc, "launch_forward_tc"), (nbt._wg, "launch_forward_wgmma"))
    for module, name in launchers:
        real = getattr(module, name)

        def wrapper(cfg, q, k, v, o, lse, *args, real=real, **kwargs):
            calls.append(([a.ptr for a in (q, k, v)], [o.ptr, lse.ptr], q.dtype))
            return real(cfg, q, k, v, o, lse, *args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def replay_spy(monkeypatch):
    """Record the pointers each replayed recipe (nbflash._launch.Recipe) launches on: what the kernels read
    and write, in the order the bridge records them (forward: q, k, v, o, lse; backward: do, q, k, v, o, lse,
    dq, dk, dv, scratch)."""
    from nbflash import _launch

    calls = []
    real = _launch.Recipe.__call__

    def spy(self, ptrs, stream, device):
        calls.append(list(ptrs))
        return real(self, ptrs, stream, device)

    monkeypatch.setattr(_launch.Recipe, "__call__", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_zero_copy_and_torch_owned_outputs(monkeypatch, dtype):
    fwd = launch_spy(monkeypatch)  # (kernel dtype) the descriptors a recipe was recorded from
    replays = replay_spy(monkeypatch)  # (pointers) every replay, the first call's included
    qkv = torch.randn(2, 200, 3, 4, 64, device="cuda", dtype=dtype)
    q, k, v = (qkv[:, :, i].requires_grad_() for i in range(3))  # bshd slices: no copies
    gc.collect()  # earlier tests' tensors freed now, not during the call we measure
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    o = nbt.attention(q, k, v, causal=True, layout="bshd")
    o_bytes = o.numel() * o.element_size()
    lse_bytes = 2 * 4 * 200 * 4
    # o and lse came from PyTorch's caching allocator (CuPy's pool would not show here).
    assert torch.cuda.memory_allocated() - before >= o_bytes + lse_bytes
    kernel_dtype = fwd[0][2]
    ptrs = replays[0]
    assert ptrs[:3] == [t.data_ptr() for t in (q, k, v)]
    assert ptrs[3] == o.data_ptr()
    assert (kernel_dtype == np.uint16) == (dtype == torch.bfloat16)
    assert o.untyped_storage().data_ptr() == o.data_ptr() and o._base is None
    o.record_stream(torch.cuda.Stream())  # works only on allocator-owned storage, must not raise

    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    ptrs = replays[1]
    assert ptrs[0] == do.data_ptr()
    assert ptrs[1:5] == [t.data_ptr() for t in (q, k, v, o)]
    # dq, dk, dv are written by the kernels straight into the tensors autograd returns.  (Accumulating
    # into .grad of a strided leaf may copy: that is autograd's gradient-layout rule, not the bridge.)
    assert ptrs[6:9] == [t.data_ptr() for t in (dq, dk, dv)]
    # A second call of the same signature replays the recipe on its own tensors.
    o2 = nbt.attention(q, k, v, causal=True, layout="bshd")
    assert replays[2][:4] == [t.data_ptr() for t in (q, k, v, o2)] and o2.data_ptr() != o.data_ptr()
    assert torch.equal(o2, o)


@pytest.mark.gpu
def test_gpu_runs_on_torch_current_stream(monkeypatch):
    """Launch on a side stream whose inputs are produced late: wrong-stream launches would read garbage."""
    # Deterministic dq, so the two runs below can be compared bit for bit.
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 513, 64
    q0, k0, v0 = (torch.randn(b, h, n, d, device="cuda", dtype=torch.float16) for _ in range(3))
    do0 = torch.randn(b, h, n, d, device="cuda", dtype=torch.float16)
    o_ref, _ = attention_ref(q0, k0, v0, causal=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keep the side stream busy for a while
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))  # ready only after the sleep
        o = nbt.attention(q, k, v, causal=True)
        o.backward(do0)
        result = (o.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(result[0].double(), o_ref, atol=2e-3, rtol=0)
    q1, k1, v1 = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
    o1 = nbt.attention(q1, k1, v1, causal=True)
    o1.backward(do0)
    for got, want in zip(result, (o1, q1.grad, k1.grad, v1.grad), strict=True):
        assert torch.equal(got, want.detach())  # deterministic: the same bits on either stream
    torch.cuda.synchronize()  # before tensors made on the side stream are freed


@pytest.mark.gpu
def test_gpu_bf16_forward_vs_pytorch_math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    b, h, n, d = 2, 8, 1024, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for causal in (False, True):
        o = nbt.attention(q, k, v, causal=causal)
        o_ref, _ = attention_ref(q, k, v, causal=causal)
        with sdpa_kernel(SDPBackend.MATH):  # Nq == Nk: its top-left causal mask is ours
            o_pt = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert_flash_rule(o, o_ref, o_pt, f"bf16 o causal={causal}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_gpu_gradients_real_sizes(dtype, causal, layout):
    b, h, nq, nk, d = 2, 3, 300, 457, 64
    q, k, v = make_qkv(*shapes(b, h, nq, nk, d, layout), dtype, device="cuda", requires_grad=True, seed=7)
    o = nbt.attention(q, k, v, causal=causal, layout=layout)
    do = torch.randn_like(o)
    got = grads(o, (q, k, v), do)
    o_ref, ref = reference_grads(q, k, v, do, causal=causal, layout=layout)
    o_naive, _ = attention_ref(q, k, v, causal=causal, layout=layout, dtype=dtype)
    naive = grads(o_naive, (q, k, v), do)
    assert_flash_rule(o, o_ref, o_naive, "o")
    for name, g, r, n in zip("qkv", got, ref, naive, strict=True):
        assert_flash_rule(g, r, n, f"d{name}")


@pytest.mark.gpu
def test_gpu_float32_gradients_and_compile():
    torch._dynamo.reset()
    q, k, v = make_qkv((2, 2, 130, 32), (2, 2, 97, 32), torch.float32, device="cuda", requires_grad=True, seed=8)

    def f(q, k, v):
        return nbt.attention(q, k, v, causal=True).square().sum()

    loss = torch.compile(f, fullgraph=True)(q, k, v)
    got = torch.autograd.grad(loss, (q, k, v))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.autograd.grad(attention_ref(q64, k64, v64, causal=True)[0].square().sum(), (q64, k64, v64))
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_errors():
    q, k, v = make_qkv((1, 1, 8, 16), (1, 1, 8, 16), torch.float16, device="cuda")
    with pytest.raises(TypeError, match="nbflash.torch needs CUDA tensors; q is on cpu"):
        nbt.attention(q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda:0"):
        nbt.attention(q, k.cpu(), v)


@pytest.mark.gpu
def test_gpu_second_device():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    q, k, v = make_qkv((1, 2, 70, 64), (1, 2, 70, 64), torch.float16, device="cuda:1", requires_grad=True)
    with torch.cuda.device(0):
        o = nbt.attention(q, k, v, causal=True)
        o.sum().backward()
    assert o.device == q.grad.device == torch.device("cuda", 1)
    o_ref, _ = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(o.double(), o_ref, atol=2e-3, rtol=0)


def test_deterministic_follows_torch_setting(monkeypatch):
    """dq by the backend's faster route by default (None); its own kernel under
    torch.use_deterministic_algorithms(True)."""
    if not nbflash.SIMULATOR:
        pytest.skip("spies on the NumPy bridge")
    bwd = spy(monkeypatch, "backward_arrays")
    q, k, v = make_qkv((1, 1, 5, 4), (1, 1, 6, 4), torch.float32, requires_grad=True)
    for flag in (False, True):
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda flag=flag: flag)
        nbt.attention(q, k, v, causal=True).sum().backward()
    assert [call[2]["deterministic"] for call in bwd] == [None, True]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_choice_through_the_bridge(dtype):
    """backend="tensor_core" and "simt" give the same attention (and gradients) through the custom op."""
    q, k, v = make_qkv((1, 2, 21, 32), (1, 2, 35, 32), dtype, requires_grad=True)
    outs = {}
    for backend in ("tensor_core", "simt"):
        o = nbt.attention(q, k, v, causal=True, backend=backend)
        outs[backend] = (o.detach().double(), grads(o, (q, k, v), torch.ones_like(o)))
    ref, _ = reference_grads(q, k, v, torch.ones_like(q), causal=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for backend, (o, _) in outs.items():
        assert (o - ref).abs().max() < tol, backend
    assert (outs["tensor_core"][0] - outs["simt"][0]).abs().max() < tol
    for a, b in zip(outs["tensor_core"][1], outs["simt"][1], strict=True):
        assert (a.double() - b.double()).abs().max() < 5 * tol
    with pytest.raises(ValueError, match="backend must be one of"):
        nbt.attention(q, k, v, backend="fast")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_copied_inputs_outlive_the_replay(monkeypatch, dtype):
    """A cached call copies an input with a strided last axis (here the all-zero-stride gradient of
    ``o.sum()``); the copy must stay allocated until the kernels are queued, so no output of the same call
    can be given its memory while the kernels still read it."""
    replays = replay_spy(monkeypatch)
    q, k, v = (torch.randn(1, 2, 96, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    for _ in range(3):  # the first call records the signature; the later ones replay it
        o = nbt.attention(q, k, v)
        o.sum().backward()
    backward = [p for p in replays if len(p) >= 9][-1]  # do, q, k, v, o, lse, dq, dk, dv[, scratch]
    assert backward[0] not in backward[6:], "the copy of do was freed and its memory reused by an output"
    want = torch.ones_like(o)
    q2, k2, v2 = (x.detach().double().requires_grad_() for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2).backward(want.double())
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert (q.grad.double() / 3 - q2.grad).abs().max().item() < tol
