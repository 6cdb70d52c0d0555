"""PyTorch bridge: :func:`attention` on ``torch.Tensor``, differentiable, ``torch.compile``-able.

    >>> import nbflash.torch
    >>> o = nbflash.torch.attention(q, k, v, causal=True)   # doctest: +SKIP
    >>> o.sum().backward()                                   # doctest: +SKIP

The file reads bottom-up in four layers, as flash-attn's interface does:

1. **Raw kernel call** (:func:`_flash_fwd`, :func:`_flash_bwd`): tensors in,
   tensors out.  Nothing is copied on the way (see *Memory and streams* below).
2. **Custom ops** ``nbflash::attention_fwd`` → ``(o, lse)`` and
   ``nbflash::attention_bwd`` → ``(dq, dk, dv)``, registered with
   ``torch.library.custom_op``, each with a ``register_fake`` that gives the
   output shapes, dtypes and strides without running anything — what
   ``torch.compile`` traces with.
3. **Autograd**: ``register_autograd`` on the forward op saves
   ``q, k, v, o, lse`` (``lse`` is all the backward needs to recompute the
   softmax: nothing N×N is stored) and calls the backward op.
4. **Public function** :func:`attention`: checks the arguments, returns ``o``.
   In eager mode it calls the raw layer through a plain
   ``torch.autograd.Function`` (:class:`_Attention`): the custom op's Python
   dispatch costs tens of µs per call, more than the kernel at small shapes.
   Under ``torch.compile`` (and for anyone calling the ops) the custom ops run
   — the same raw calls, so both routes compute the same bits.

Tensors, by where nbflash runs:

* **GPU** (CUDA tensors).  Forward and backward hand the kernels
  *descriptors* of the tensors — data pointer, shape, strides in bytes, dtype
  (:class:`nbflash._launch.ArrayArg`) — straight from tensor metadata, and
  allocate outputs and scratch with ``torch.empty``: zero copy as through
  DLPack, but without its tens of µs per tensor, no CuPy, and one
  ``cuLaunchKernel`` per kernel (:mod:`nbflash._launch`).  Kernel choice
  (tensor cores or SIMT) is :func:`nbflash.api.plan_forward` /
  :func:`~nbflash.api.plan_backward`, as for CuPy arrays.  So PyTorch's caching allocator owns all memory and the
  outputs are ordinary PyTorch tensors (``record_stream``, CUDA graphs and
  memory statistics work on them).  Kernels run on PyTorch's current stream
  of that device (its raw handle), with no synchronisation: ordered after the
  work that produced the inputs, before the work that reads the outputs, and
  captured when that stream is capturing a CUDA graph (``torch.cuda.graph``).
* **Simulator** (``nbflash.SIMULATOR``, CPU tensors).  Inputs are viewed as
  NumPy arrays (``Tensor.numpy()`` shares memory) and the outputs wrapped with
  ``torch.from_numpy``, so the bridge and the autograd wiring are tested on any
  CPU — slowly: one Python thread per CUDA thread.

bfloat16 needs no conversion: NumPy and CuPy have no bfloat16, so the bridge
hands the kernels the raw 16 bits (an integer view of the same memory) and the
kernels convert on load and round to nearest-even on store.

Strides.  The kernels read any view whose last (head-dim) axis is contiguous —
slices of a packed ``qkv`` tensor, ``bhsd``/``bshd`` transposes — without a
copy.  A view with a strided last axis is copied with ``.contiguous()`` first;
so is the incoming gradient ``do`` when autograd hands over one (``o.sum()``
produces an all-zero-stride ``do``).  Outputs are always contiguous in the
caller's layout.

Not supported: double backward, gradients through ``lse`` (it is marked
non-differentiable), and mixing devices.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import _launch
from . import api as _api
from . import forward as _fwd
from . import forward_tc as _tc
from . import forward_wgmma as _wg
from ._device import SIMULATOR
from ._launch import ArrayArg
from ._validate import LAYOUTS, MAX_HEAD_DIM, check_scale

#: Tensor dtypes the kernels take; bfloat16 travels as its raw bits (uint16).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Tensor dtypes as the kernels see them (bfloat16 as its bits) and their sizes.
_NP_DTYPE = {
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(np.uint16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
_ITEMSIZE = {t: d.itemsize for t, d in _NP_DTYPE.items()}


# ----------------------------------------------------------------------------
# Argument checks: everything is refused here or in nbflash.api, before a launch
# ----------------------------------------------------------------------------


def _check_tensors(names, tensors, dtype_names) -> None:
    """Tensors of one device of the kind this process runs on; the ``dtype_names`` ones of one supported dtype."""
    for name, t in zip(names, tensors, strict=True):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    device = tensors[0].device
    for name, t in zip(names[1:], tensors[1:], strict=True):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but {names[0]} is on {device}; all inputs must share a device")
    if SIMULATOR and device.type != "cpu":
        raise TypeError(
            f"{names[0]} is on {device}, but the CUDA simulator is active (NUMBA_ENABLE_CUDASIM=1): "
            "it runs on CPU tensors and cannot read GPU memory"
        )
    if not SIMULATOR and device.type != "cuda":
        raise TypeError(
            f"nbflash.torch needs CUDA tensors; {names[0]} is on {device} "
            "(move the inputs with .cuda(), or set NUMBA_ENABLE_CUDASIM=1 to run on CPU in the simulator)"
        )
    first = names.index(dtype_names[0])
    dtype = tensors[first].dtype
    if dtype not in DTYPES:
        raise TypeError(f"{names[first]} must be float16, bfloat16, float32 or float64, got {dtype}")
    for name, t in zip(names, tensors, strict=True):
        if name in dtype_names and t.dtype != dtype:
            raise TypeError(f"{name} must have dtype {dtype} like {names[first]}, got {t.dtype}")


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _seqlen_heads(x: torch.Tensor, layout: str):
    """``(batch, heads, seqlen)`` of a 4-D tensor in ``layout``."""
    if layout == "bhsd":
        return x.shape[0], x.shape[1], x.shape[2]
    return x.shape[0], x.shape[2], x.shape[1]


# ----------------------------------------------------------------------------
# 1. Raw kernel call: tensors -> kernels -> tensors, no copies
# ----------------------------------------------------------------------------


def _check_problem(q, k, v, causal, scale, layout):
    """Shapes and flags of a forward call, checked on the tensors: ``(B, H, Nq, D, scale)``.

    The checks and messages of :func:`nbflash._validate.check_attention`
    (dtypes and devices are :func:`_check_tensors`'), read from tensor
    metadata only, so the GPU route needs no array views to validate.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (batch, heads, seqlen, headdim) or 'bshd', got {layout!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    names = ("q", "k", "v")
    for n, t in zip(names, (q, k, v), strict=True):
        if t.dim() != 4:
            dims = "(batch, heads, seqlen, headdim)" if layout == "bhsd" else "(batch, seqlen, heads, headdim)"
            raise ValueError(f"{n} must be 4-D {dims} for layout={layout!r}, got shape {tuple(t.shape)}")
    B, H, Nq = _seqlen_heads(q, layout)
    D = q.shape[3]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    kb, kh, _ = _seqlen_heads(k, layout)
    if kb != B or kh != H:
        raise ValueError(
            f"k must have the batch size and number of heads of q ({B}, {H}), got shape {tuple(k.shape)} "
            f"with layout={layout!r}"
        )
    if k.shape[3] != D:
        raise ValueError(f"k and v must have the head dim of q ({D}), got {k.shape[3]}")
    for n, t in zip(names, (q, k, v), strict=True):
        if t.numel() == 0:
            raise ValueError(f"{n} is empty (shape {tuple(t.shape)}); every dimension must be at least 1")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {D}")
    return B, H, Nq, D, check_scale(scale, D)


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels can read it: the tensor itself unless its last axis is strided (then a copy)."""
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


# --- Simulator: NumPy views through nbflash.api ------------------------------


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing ``t``'s memory (bfloat16 as uint16 bits)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (uint16 bits back to bfloat16)."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _run_simulator(entry, tensors, **kwargs):
    """Call the array-level ``entry`` (``forward_arrays``/``backward_arrays``) on NumPy views of CPU ``tensors``."""
    tensors = [_kernel_view(t) for t in tensors]
    bf16 = any(t.dtype == torch.bfloat16 for t in tensors)
    outs = entry(*(_numpy_view(t) for t in tensors), bf16_bits=bf16, stream=0, **kwargs)
    return tuple(_from_numpy(a) for a in outs)


# --- GPU: descriptors and PyTorch's stream, device and allocator --------------


def _describe(t: torch.Tensor) -> ArrayArg:
    """The kernel's view of a CUDA tensor: pointer, shape, byte strides, dtype (bfloat16 as uint16). No DLPack."""
    itemsize = _ITEMSIZE[t.dtype]
    return ArrayArg(t.data_ptr(), tuple(t.shape), tuple(s * itemsize for s in t.stride()), _NP_DTYPE[t.dtype])


def _raw_stream(index: int) -> int:
    """The handle of PyTorch's current stream on GPU ``index`` (what ``current_stream().cuda_stream`` gives)."""
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:  # pragma: no cover - older or newer PyTorch
        return torch.cuda.current_stream(index).cuda_stream


def _on_device(index: int):
    """PyTorch's (and so the CUDA runtime's current context's) device ``index`` for the block; free if current."""
    if torch.cuda.current_device() == index:
        return contextlib.nullcontext()
    return torch.cuda.device(index)


# The hot path, as nbflash.api's for CuPy arrays: the first call of a signature (tensor shapes, strides,
# dtypes, device, flags, 16-byte alignment) is checked in full and its launches recorded as a recipe
# (nbflash._launch.Recipe); later calls allocate their outputs and replay it with their own pointers.

_FORWARD_RECIPES = _launch.SignatureCache()
_BACKWARD_RECIPES = _launch.SignatureCache()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


#: The current CUDA device's index, without torch.cuda's Python wrapper (None: a CPU-only PyTorch).
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_device() -> int:
    return _cuda_get_device() if _cuda_get_device is not None else torch.cuda.current_device()


def _signature(tensors, flags):
    """``(key, pointers, device, copies)`` of a call on CUDA tensors of the current device — each read as the
    kernels will (:func:`_kernel_view`) — or ``(None, None, None, None)`` where the hot path does not apply.

    ``copies``: the contiguous copies made of tensors with a strided last axis.  The caller must hold them
    until the kernels are queued: a copy freed earlier could be handed by the caching allocator to the
    outputs allocated next, which the kernels would then write while still reading the copy.
    """
    none = None, None, None, None
    first = tensors[0]
    if type(first) not in _PLAIN or _cuda_get_device is None:
        return none
    device = first.get_device()
    if device < 0 or device != _cuda_get_device():
        return none
    meta, ptrs, copies, aligned = [], [], [], []
    for t in tensors:
        if type(t) not in _PLAIN or t.get_device() != device:
            return none
        shape, stride = t.shape, t.stride()
        if len(shape) > 1 and shape[-1] > 1 and stride[-1] != 1:  # as _kernel_view: a copy the kernels can read
            t = t.contiguous()
            stride = t.stride()
            copies.append(t)
        ptr = t.data_ptr()
        meta.append((shape, stride, t.dtype))
        ptrs.append(ptr)
        aligned.append(not ptr & 15)
    key = _launch.signature_key(device, meta, aligned, flags)
    return (key, ptrs, device, copies) if key is not None else none


def _gpu_forward(
    q, k, v, causal: bool, scale: float, layout: str, B: int, H: int, Nq: int, D: int, backend: str, key=None
):
    """``(o, lse)`` on the GPU: outputs from ``torch.empty``, the kernel launched on tensor descriptors.

    ``o`` is allocated in the caller's layout; the kernel sees canonical
    ``(B, H, N, D)`` descriptors (for ``bshd`` the axes of the same memory
    reordered).  It runs on PyTorch's current stream of the tensors' device,
    which also owns the outputs' memory (the caching allocator's stream).
    The launch is recorded as the recipe of ``key`` and replayed.
    """
    index = q.device.index
    with _on_device(index):
        q, k, v = _kernel_view(q), _kernel_view(k), _kernel_view(v)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, Nq), dtype=_lse_dtype(q.dtype), device=q.device)
        tensors = (q, k, v, o, lse)
        arrays = [_describe(t) for t in tensors]
        if layout == "bshd":
            arrays[:4] = [a.permute((0, 2, 1, 3)) for a in arrays[:4]]
        kind = "bfloat16" if q.dtype == torch.bfloat16 else str(q.dtype).removeprefix("torch.")
        plan = _api.plan_forward(D, kind, scale, *arrays[:3], backend, bool(causal))
        with _launch.record() as launches:
            _launch_forward(plan, _launch.placeholder_args(arrays), scale, causal, stream=0)
        try:
            recipe = _launch.Recipe(launches)
        except NotImplementedError:  # pragma: no cover - every kernel argument here is a descriptor or a scalar
            _launch_forward(plan, arrays, scale, causal, stream=_raw_stream(index))
            return o, lse
        if key is not None and index == _current_device():
            _FORWARD_RECIPES.put(key, (recipe, o.shape, o.dtype, lse.shape, lse.dtype))
        recipe([t.data_ptr() for t in tensors], _raw_stream(index), index)
    return o, lse


def _launch_forward(plan, arrays, scale: float, causal: bool, stream) -> None:
    """The forward kernel of ``plan`` on descriptors ``q, k, v, o, lse``."""
    if plan.backend == "tensor_core":
        _tc.launch_forward_tc(plan.config, *arrays, scale, bool(causal), stream=stream, check=False)
    elif plan.backend == "wgmma":
        _wg.launch_forward_wgmma(plan.config, *arrays, scale, bool(causal), stream=stream, check=False)
    else:
        _fwd.launch_forward(plan.config, *arrays, scale, bool(causal), stream=stream)


def _flash_fwd(q, k, v, causal: bool, scale: float | None, layout: str, backend: str = "auto"):
    """``(o, lse)`` from the forward kernel; ``o`` contiguous in ``layout``."""
    key = None
    if not SIMULATOR:
        key, ptrs, device, copies = _signature((q, k, v), _api._flags(causal, scale, layout, backend))
        entry = _FORWARD_RECIPES.get(key) if key is not None else None
        if entry is not None:  # checked in full when first seen: allocate and replay
            recipe, o_shape, dtype, lse_shape, lse_dtype = entry
            o = torch.empty(o_shape, dtype=dtype, device=q.device)
            lse = torch.empty(lse_shape, dtype=lse_dtype, device=q.device)
            recipe((*ptrs, o.data_ptr(), lse.data_ptr()), _raw_stream(device), device)
            del copies  # any copy of an input is queued for reading now: back to the allocator, stream-ordered
            return o, lse
    _check_tensors(("q", "k", "v"), (q, k, v), ("q", "k", "v"))
    B, H, Nq, D, scale_ = _check_problem(q, k, v, causal, scale, layout)
    if SIMULATOR:
        return _run_simulator(
            _api.forward_arrays, (q, k, v), causal=causal, scale=scale, layout=layout, backend=backend
        )
    return _gpu_forward(q, k, v, causal, scale_, layout, B, H, Nq, D, backend, key)


def _check_backward(do, q, o, lse, layout):
    """``do`` and ``o`` shaped like ``q``, ``lse`` ``(B, H, Nq)`` of the forward's dtype: the custom op is public."""
    for name, t in (("do", do), ("o", o)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    B, H, Nq = _seqlen_heads(q, layout)
    expected = _lse_dtype(q.dtype)
    if lse.dtype != expected:
        raise TypeError(f"lse must have dtype {str(expected).removeprefix('torch.')} (the forward's), got {lse.dtype}")
    if lse.shape != (B, H, Nq):
        raise ValueError(f"lse must have shape {(B, H, Nq)} (the forward's), got {tuple(lse.shape)}")


def _gpu_backward(
    do, q, k, v, o, lse, causal: bool, scale: float, layout: str, deterministic, backend: str, key=None
):
    """``(dq, dk, dv)`` on the GPU, like :func:`_gpu_forward`: outputs and scratch (one buffer) from
    ``torch.empty``, kernels launched on descriptors on PyTorch's current stream, recorded as the recipe of
    ``key`` and replayed."""
    index = q.device.index
    with _on_device(index):
        do, q, k, v, o = (_kernel_view(t) for t in (do, q, k, v, o))
        grads = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v)]
        tensors = (do, q, k, v, o, lse, *grads)
        arrays = [_describe(t) for t in tensors]
        if layout == "bshd":
            arrays = [a if i == 5 else a.permute((0, 2, 1, 3)) for i, a in enumerate(arrays)]  # lse is (B, H, N)
        kind = "bfloat16" if q.dtype == torch.bfloat16 else str(q.dtype).removeprefix("torch.")
        plan = _api.plan_backward(q.shape[3], kind, scale, *arrays[:5], backend, causal)
        arena = _launch.Arena(len(arrays))
        with _launch.record() as launches:
            _api.run_backward(
                plan,
                *_launch.placeholder_args(arrays),
                scale,
                causal,
                deterministic=deterministic,
                stream=0,
                empty=arena,
            )
        recipe = _launch.Recipe(launches, arena.nbytes)
        if key is not None and index == _current_device():
            _BACKWARD_RECIPES.put(key, (recipe, tuple(g.shape for g in grads), q.dtype))
        ptrs = [t.data_ptr() for t in tensors]
        if recipe.scratch_bytes:  # alive until the launches are queued, then back to the allocator, stream-ordered
            scratch = torch.empty(recipe.scratch_bytes, dtype=torch.uint8, device=q.device)
            ptrs.append(scratch.data_ptr())
        recipe(ptrs, _raw_stream(index), index)
    return tuple(grads)


def _flash_bwd(do, q, k, v, o, lse, causal: bool, scale: float | None, layout: str, backend: str = "auto"):
    """``(dq, dk, dv)`` from the backward kernels, each contiguous in ``layout``."""
    # dq by the faster route of the chosen kernels, unless the caller asked PyTorch for deterministic algorithms.
    deterministic = True if torch.are_deterministic_algorithms_enabled() else None
    key = None
    if not SIMULATOR:
        flags = _api._flags(causal, scale, layout, backend, deterministic)
        key, ptrs, device, copies = _signature((do, q, k, v, o, lse), flags)
        entry = _BACKWARD_RECIPES.get(key) if key is not None else None
        if entry is not None:  # checked in full when first seen: allocate and replay
            recipe, shapes, dtype = entry
            grads = [torch.empty(shape, dtype=dtype, device=q.device) for shape in shapes]
            ptrs += [g.data_ptr() for g in grads]
            if recipe.scratch_bytes:
                scratch = torch.empty(recipe.scratch_bytes, dtype=torch.uint8, device=q.device)
                ptrs.append(scratch.data_ptr())
            recipe(ptrs, _raw_stream(device), device)
            del copies  # e.g. of a zero-stride incoming gradient: queued for reading, back to the allocator
            return tuple(grads)
    names = ("do", "q", "k", "v", "o", "lse")
    _check_tensors(names, (do, q, k, v, o, lse), ("q", "k", "v", "o", "do"))
    _, _, _, _, scale_ = _check_problem(q, k, v, causal, scale, layout)
    _check_backward(do, q, o, lse, layout)
    if not SIMULATOR:
        return _gpu_backward(do, q, k, v, o, lse, causal, scale_, layout, deterministic, backend, key)
    outs = _run_simulator(
        _api.backward_arrays,
        (do, q, k, v, o, lse),
        causal=causal,
        scale=scale,
        layout=layout,
        deterministic=deterministic,
        backend=backend,
    )
    # The fake implementation promises contiguous outputs; torch.compile relies on it.
    return tuple(x if x.is_contiguous() else x.contiguous() for x in outs)


# ----------------------------------------------------------------------------
# 2. Custom ops, with fake implementations for tracing
# ----------------------------------------------------------------------------


@torch.library.custom_op("nbflash::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    layout: str,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: ``o`` like ``q``, contiguous in ``layout``; ``lse`` ``(B, H, Nq)``, float32 or float64."""
    return _flash_fwd(q, k, v, causal, scale, layout, backend)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, layout, backend="auto"):
    batch, heads, seqlen_q = _seqlen_heads(q, layout)
    o = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads, seqlen_q), dtype=_lse_dtype(q.dtype))
    return o, lse


@torch.library.custom_op("nbflash::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    layout: str,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``q, k, v``, contiguous in ``layout``, from ``do = dL/do`` and the forward's ``o, lse``."""
    return _flash_bwd(do, q, k, v, o, lse, causal, scale, layout, backend)


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, causal, scale, layout, backend="auto"):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------
# 3. Autograd: the forward op saves what the backward op recomputes from
# ----------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, layout, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale, ctx.layout, ctx.backend = causal, scale, layout, backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.layout, ctx.backend)
    return dq, dk, dv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _Attention(torch.autograd.Function):
    """Eager-mode autograd over the raw calls: what the custom ops do, minus their dispatch cost."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, backend):
        o, lse = _flash_fwd(q, k, v, causal, scale, layout, backend)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, layout, backend)
        return o

    @staticmethod
    def backward(ctx, do):
        # The gradients are kernel outputs with no graph of their own.  Under create_graph=True (grad mode on
        # here) they come back wrapped by once_differentiable, so that differentiating them again raises
        # instead of silently giving zero; in the usual case that wrapper's cost (about 10 µs) is skipped.
        if torch.is_grad_enabled():
            return _grads_once(ctx, do)
        return _grads(ctx, do)


def _grads(ctx, do):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _flash_bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None


_grads_once = torch.autograd.function.once_differentiable(_grads)


# ----------------------------------------------------------------------------
# 4. The public function
# ----------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    backend: str = "auto",
) -> torch.Tensor:
    """Exact attention ``softmax(Q Kᵀ · scale) V`` on PyTorch tensors, differentiable in ``q, k, v``.

    Args:
        q: queries, ``(batch, heads, seqlen_q, headdim)`` for ``layout="bhsd"``
            (the order of ``torch.nn.functional.scaled_dot_product_attention``)
            or ``(batch, seqlen_q, heads, headdim)`` for ``"bshd"``
            (flash-attn's).  float16, bfloat16, float32 or float64; CUDA
            tensors (CPU tensors when the CUDA simulator is active).
        k, v: keys and values, ``seqlen_k`` rows (may differ from
            ``seqlen_q``), same batch, heads, head dim, dtype and device as ``q``.
            Head dims 1..256.
        causal: mask aligned to the bottom-right corner (flash-attn ≥ 2.1):
            query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``::

                seqlen_q=3, seqlen_k=5     seqlen_q=4, seqlen_k=2
                   k: 0 1 2 3 4               k: 0 1
                q0    x x x . .            q0    . .   <- no key: o = 0,
                q1    x x x x .            q1    . .      and no gradient
                q2    x x x x x            q2    x .
                                           q3    x x

            For ``seqlen_q == seqlen_k`` this is the usual lower triangle (and
            matches ``scaled_dot_product_attention(is_causal=True)``, which
            aligns top-left).  Costs nothing extra: tiles above the diagonal
            are skipped, about half the work of a square problem.
        scale: multiplies ``Q Kᵀ`` before the softmax; default ``1/sqrt(headdim)``.
            Free.
        layout: ``"bhsd"`` or ``"bshd"``; the output uses the same layout.
            Free either way: the other layout is a strided view, never a copy.
        backend: the kernels: ``"auto"`` (tensor cores for float16 and
            bfloat16 on an sm_80+ GPU where they apply, SIMT otherwise),
            ``"simt"``, ``"tensor_core"`` or ``"wgmma"`` (the Hopper forward;
            its backward is the tensor-core one) — for the forward and, through
            autograd, the backward (see :func:`nbflash.which_backend`).

    Returns:
        ``o``, shaped like ``q`` (contiguous in ``layout``), dtype of ``q``.

    Raises:
        TypeError: not tensors, CPU tensors without the simulator (CUDA tensors
            with it), an unsupported or mismatched dtype, a non-bool ``causal``.
        ValueError: tensors on different devices, bad shapes, empty tensors,
            head dim > 256, an unknown layout, a non-finite ``scale``.

    Costs.  Forward: one fused kernel, memory O(N) beyond the inputs — the
    output and the float32 log-sum-exp per query row, which is saved for the
    backward along with ``q, k, v, o``.  Backward: the softmax is recomputed
    tile by tile from that log-sum-exp — five matrix products to the forward's
    two.  dq comes from whichever route was measured faster for the kernels in
    use (see :func:`nbflash.attention_backward`): float32 atomics for SIMT (its
    last bits may differ from run to run), its own kernel for tensor cores.
    Under ``torch.use_deterministic_algorithms(True)`` it always gets its own
    kernel (two more matrix products, the same bits on every run).
    bfloat16 is read as raw bits: no conversion pass.  Any view whose last
    axis is contiguous is read in place; a strided last axis costs one copy
    (of that input, or of the incoming gradient).
    float64 runs at the GPU's float64 rate.  Gradients w.r.t. ``q, k, v`` only;
    no double backward.
    """
    # The flags here; the tensors by the raw forward (in full the first time a signature is seen).
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (batch, heads, seqlen, headdim) or 'bshd', got {layout!r}")
    if type(causal) is not bool:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        scale = check_scale(scale, 1)  # the head dim only matters for the default
    if backend not in _api.BACKENDS:
        raise ValueError(f"backend must be one of {_api.BACKENDS}, got {backend!r}")
    if torch.compiler.is_compiling():
        _check_tensors(("q", "k", "v"), (q, k, v), ("q", "k", "v"))
        o, _ = attention_fwd(q, k, v, causal, scale, layout, backend)
        return o
    if _needs_graph(q, k, v):
        return _Attention.apply(q, k, v, causal, scale, layout, backend)
    return _flash_fwd(q, k, v, causal, scale, layout, backend)[0]  # inference: no autograd node to build


#: True while a functorch transform (vmap, grad, ...) is active; those need autograd.Function's own handling.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: True)


def _needs_graph(q, k, v) -> bool:
    """Whether the call must go through autograd: grad mode on and an input that requires grad, or functorch."""
    if torch.is_grad_enabled() and (
        getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False) or getattr(v, "requires_grad", False)
    ):
        return True
    return _functorch_active()


__all__ = ["DTYPES", "attention", "attention_bwd", "attention_fwd"]
