"""PyTorch bridge: :func:`attention` on ``torch.Tensor``, differentiable, ``torch.compile``-able.

    >>> import nbflash.torch
    >>> o = nbflash.torch.attention(q, k, v, causal=True)   # doctest: +SKIP
    >>> o.sum().backward()                                   # doctest: +SKIP

The file reads bottom-up in four layers, as flash-attn's interface does:

1. **Raw kernel call** (:func:`_flash_fwd`, :func:`_flash_bwd`): tensors in,
   tensors out, through the array-level entry points
   :func:`nbflash.api.forward_arrays` and :func:`nbflash.api.backward_arrays`.
   Nothing is copied on the way (see *Memory and streams* below).
2. **Custom ops** ``nbflash::attention_fwd`` → ``(o, lse)`` and
   ``nbflash::attention_bwd`` → ``(dq, dk, dv)``, registered with
   ``torch.library.custom_op``, each with a ``register_fake`` that gives the
   output shapes, dtypes and strides without running anything — what
   ``torch.compile`` traces with.
3. **Autograd**: ``register_autograd`` on the forward op saves
   ``q, k, v, o, lse`` (``lse`` is all the backward needs to recompute the
   softmax: nothing N×N is stored) and calls the backward op.
4. **Public function** :func:`attention`: checks the arguments, returns ``o``.

Tensors, by where nbflash runs:

* **GPU** (CUDA tensors).  Inputs are viewed in CuPy with ``cupy.from_dlpack``;
  every allocation the call makes — outputs and scratch — is a ``torch.empty``
  on the tensors' device, so PyTorch's caching allocator owns the memory and
  the outputs come back as ordinary PyTorch tensors (``record_stream``, CUDA
  graphs and memory statistics work on them).  Kernels run on PyTorch's
  current stream of that device, with no synchronisation: ordered after the
  work that produced the inputs, before the work that reads the outputs.
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
import weakref

import numpy as np
import torch

from . import api as _api
from ._device import SIMULATOR
from ._streams import numba_stream_from_ptr, on_device
from ._validate import LAYOUTS, check_scale

#: Tensor dtypes the kernels take; bfloat16 travels as its raw bits (uint16).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Output arrays' dtypes back to tensors' (uint16 only ever holds bfloat16 bits).
_TORCH_DTYPE = {
    np.dtype(np.float16): torch.float16,
    np.dtype(np.uint16): torch.bfloat16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
}


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
# 1. Raw kernel call: tensors -> arrays -> nbflash.api -> tensors, no copies
# ----------------------------------------------------------------------------


def _kernel_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels can read it: the tensor itself unless its last axis is strided (then a copy)."""
    t = t.detach()
    if t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy array sharing ``t``'s memory (bfloat16 as uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``a``'s memory (uint16 bits back to bfloat16)."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _cupy():
    """CuPy, which carries the arrays to the kernels on the GPU."""
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("nbflash.torch on the GPU needs CuPy: pip install 'nbflash[cu12]' (or [cu13])") from e
    return cupy


class _TorchMemory:
    """A CuPy allocator whose every allocation is a ``torch.empty`` on one device.

    CuPy then allocates nothing of its own: the memory comes from PyTorch's
    caching allocator, on PyTorch's current stream (which is the stream the
    kernels run on), and returns to it when the last user lets go.
    """

    def __init__(self, device: torch.device):
        self.cupy = _cupy()
        self.device = device
        self.buffers: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __call__(self, nbytes: int):
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.buffers[buf.data_ptr()] = buf
        # The CuPy memory keeps `buf` (and so the block) alive as long as it lives.
        mem = self.cupy.cuda.UnownedMemory(buf.data_ptr(), nbytes, buf, self.device.index)
        return self.cupy.cuda.MemoryPointer(mem, 0)

    def tensor(self, a) -> torch.Tensor:
        """The output array ``a`` as a tensor on the storage that :meth:`__call__` allocated for it."""
        dtype = _TORCH_DTYPE[np.dtype(a.dtype)]
        buf = self.buffers.get(a.data.mem.ptr)
        if buf is None:  # not allocated through us (never expected): share it through DLPack
            t = torch.from_dlpack(a)
            return t.view(dtype) if dtype == torch.bfloat16 else t
        itemsize = a.itemsize
        offset = (a.data.ptr - buf.data_ptr()) // itemsize
        strides = [s // itemsize for s in a.strides]
        return torch.empty(0, dtype=dtype, device=self.device).set_(buf.untyped_storage(), offset, a.shape, strides)


def _cupy_view(cupy, t: torch.Tensor):
    """A CuPy array sharing ``t``'s memory (bfloat16 as uint16 bits), through DLPack."""
    if t.dtype == torch.bfloat16:
        return cupy.from_dlpack(t.view(torch.int16)).view(cupy.uint16)
    return cupy.from_dlpack(t)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """Make PyTorch's current stream, device and memory CuPy's and Numba's for one call.

    Yields the Numba stream to launch on and the allocator that ``nbflash.api``
    (through CuPy) allocates outputs and scratch with.
    """
    cupy = _cupy()
    index = device.index
    ptr = torch.cuda.current_stream(device).cuda_stream
    cupy_stream = cupy.cuda.ExternalStream(ptr, index) if ptr else cupy.cuda.Stream.null
    memory = _TorchMemory(device)
    with (
        torch.cuda.device(index),
        cupy.cuda.Device(index),
        on_device(index),
        cupy_stream,
        cupy.cuda.using_allocator(memory),
    ):
        yield numba_stream_from_ptr(ptr), memory


def _run(entry, tensors, **kwargs):
    """Call the array-level ``entry`` (``forward_arrays`` or ``backward_arrays``) on ``tensors``.

    ``entry``'s arguments are the arrays viewing ``tensors``, in order, then
    ``kwargs``, ``bf16_bits`` and ``stream``.  Returns its outputs as tensors
    that share memory with the arrays the kernels wrote.
    """
    tensors = [_kernel_view(t) for t in tensors]
    bf16 = any(t.dtype == torch.bfloat16 for t in tensors)
    if SIMULATOR:
        outs = entry(*(_numpy_view(t) for t in tensors), bf16_bits=bf16, stream=0, **kwargs)
        return tuple(_from_numpy(a) for a in outs)
    cupy = _cupy()
    with _on_torch_stream(tensors[0].device) as (stream, memory):
        arrays = [_cupy_view(cupy, t) for t in tensors]
        outs = entry(*arrays, bf16_bits=bf16, stream=stream, **kwargs)
        return tuple(memory.tensor(a) for a in outs)


def _flash_fwd(q, k, v, causal: bool, scale: float | None, layout: str):
    """``(o, lse)`` from the forward kernel; ``o`` contiguous in ``layout``."""
    _check_tensors(("q", "k", "v"), (q, k, v), ("q", "k", "v"))
    return _run(_api.forward_arrays, (q, k, v), causal=causal, scale=scale, layout=layout)


def _flash_bwd(do, q, k, v, o, lse, causal: bool, scale: float | None, layout: str):
    """``(dq, dk, dv)`` from the backward kernels, each contiguous in ``layout``."""
    names = ("do", "q", "k", "v", "o", "lse")
    _check_tensors(names, (do, q, k, v, o, lse), ("q", "k", "v", "o", "do"))
    # dq by atomics (fastest) unless the caller asked PyTorch for deterministic algorithms.
    outs = _run(_api.backward_arrays, (do, q, k, v, o, lse), causal=causal, scale=scale, layout=layout,
                deterministic=torch.are_deterministic_algorithms_enabled())
    # The fake implementation promises contiguous outputs; torch.compile relies on it.
    return tuple(x if x.is_contiguous() else x.contiguous() for x in outs)


# ----------------------------------------------------------------------------
# 2. Custom ops, with fake implementations for tracing
# ----------------------------------------------------------------------------


@torch.library.custom_op("nbflash::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: ``o`` like ``q``, contiguous in ``layout``; ``lse`` ``(B, H, Nq)``, float32 or float64."""
    return _flash_fwd(q, k, v, causal, scale, layout)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, scale, layout):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` like ``q, k, v``, contiguous in ``layout``, from ``do = dL/do`` and the forward's ``o, lse``."""
    return _flash_bwd(do, q, k, v, o, lse, causal, scale, layout)


@attention_bwd.register_fake
def _attention_bwd_fake(do, q, k, v, o, lse, causal, scale, layout):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ----------------------------------------------------------------------------
# 3. Autograd: the forward op saves what the backward op recomputes from
# ----------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, layout = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.causal, ctx.scale, ctx.layout = causal, scale, layout
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.layout)
    return dq, dk, dv, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


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
    two; dq is added with float32 atomics, so its last bits may differ from run
    to run.  Under ``torch.use_deterministic_algorithms(True)`` dq gets its own
    kernel instead (two more matrix products, the same bits on every run).
    bfloat16 is read as raw bits: no conversion pass.  Any view whose last
    axis is contiguous is read in place; a strided last axis costs one copy
    (of that input, or of the incoming gradient).
    float64 runs at the GPU's float64 rate.  Gradients w.r.t. ``q, k, v`` only;
    no double backward.
    """
    _check_tensors(("q", "k", "v"), (q, k, v), ("q", "k", "v"))
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (batch, heads, seqlen, headdim) or 'bshd', got {layout!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if scale is not None:
        scale = check_scale(scale, q.shape[-1])
    o, _ = attention_fwd(q, k, v, causal, scale, layout)
    return o


__all__ = ["DTYPES", "attention", "attention_bwd", "attention_fwd"]
