"""Input checks for the public API: every bad input is refused here, before any launch.

The checks read only shapes, strides, dtypes and the array's type and device —
no device synchronisation and no host copies — so they are cheap enough for
the hot path.  Each error names the argument and says what was expected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._device import SIMULATOR

LAYOUTS = ("bhsd", "bshd")
MAX_HEAD_DIM = 256

#: Public dtypes and the kernel input kind each maps to.
DTYPE_KINDS = {
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
}


@dataclass(frozen=True)
class Problem:
    """A validated attention call, in canonical ``(B, H, N, D)`` terms."""

    xp: Any  # the array module: numpy (simulator) or cupy (GPU)
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: np.dtype
    input_kind: str
    layout: str
    scale: float
    causal: bool

    @property
    def lse_dtype(self) -> np.dtype:
        return np.dtype(np.float64) if self.input_kind == "float64" else np.dtype(np.float32)


def array_module(x):
    """The array module of ``x`` (numpy or cupy), or None if it is neither."""
    mod = type(x).__module__.split(".")[0]
    if mod == "numpy" and isinstance(x, np.ndarray):
        return np
    if mod == "cupy":
        import cupy

        if isinstance(x, cupy.ndarray):
            return cupy
    return None


def data_address(a) -> int:
    """The address of ``a``'s first element: a kernel argument descriptor (``nbflash._launch.ArrayArg``),
    a CuPy array, or anything with the (CUDA) array interface (NumPy in the simulator)."""
    ptr = getattr(a, "ptr", None)  # a descriptor
    if ptr is None:
        ptr = getattr(getattr(a, "data", None), "ptr", None)  # CuPy
    if ptr is None:
        iface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
        ptr = iface["data"][0]
    return int(ptr)


def chunked_rows_problem(name: str, a, itemsize: int) -> str:
    """Why ``cp.async`` cannot copy the rows of ``a`` (a ``(B, H, N, D)`` view or descriptor) as 16-byte chunks,
    or "" if it can: contiguous along the head dim, the other strides and the data pointer multiples of 16
    bytes.  ``itemsize``: the bytes of one element as the kernel reads it."""
    strides = a.strides
    if strides[-1] != itemsize:
        return f"{name} must be contiguous along the head dim (cp.async copies 16-byte chunks of rows)"
    if (strides[0] | strides[1] | strides[2]) & 15:
        return f"{name}'s strides {tuple(strides)} are not multiples of 16 bytes"
    if data_address(a) & 15:
        return f"{name}'s data pointer is not 16-byte aligned"
    return ""


def tile_rows_problem(head_dim: int, names, arrays, copied: int, written=()) -> str:
    """Why a 16-bit tensor-core kernel cannot take ``arrays`` (``(B, H, N, D)`` views or descriptors named
    ``names``), or "": each of head dim ``head_dim`` with 16-bit elements, and the first ``copied`` of them
    (those the kernel copies by ``cp.async``) and those named in ``written`` (outputs it stores as 16-byte
    chunks) in whole, aligned 16-byte chunks (:func:`chunked_rows_problem`)."""
    for i, (name, a) in enumerate(zip(names, arrays, strict=False)):
        if a.shape[-1] != head_dim:
            return f"{name} has head dim {a.shape[-1]}, the configuration {head_dim}"
        if np.dtype(a.dtype).itemsize != 2:
            return f"{name} must hold 16-bit elements (float16, or bfloat16 as uint16), got {a.dtype}"
        why = chunked_rows_problem(name, a, 2) if i < copied else ""
        if why:
            return why
    # the written ones once every array has the right head dim and type
    return next(filter(None, (chunked_rows_problem(name, a, 2) for name, a in zip(names, arrays, strict=False)
                              if name in written)), "")


def _expected_array() -> str:
    return "a NumPy array (the CUDA simulator is active)" if SIMULATOR else "a CuPy array on a CUDA GPU"


def check_array(name: str, x, *, allow_uint16: bool = False):
    """``x`` must be an array of the kind this process runs on; returns its module."""
    xp = array_module(x)
    if xp is None:
        hint = ""
        if type(x).__module__.split(".")[0] == "torch":
            hint = " (for PyTorch tensors use nbflash.torch.attention)"
        raise TypeError(f"{name} must be {_expected_array()}, got {type(x).__module__}.{type(x).__name__}{hint}")
    if SIMULATOR and xp is not np:
        raise TypeError(f"{name} must be a NumPy array: the CUDA simulator is active and cannot read GPU memory")
    if not SIMULATOR and xp is np:
        raise TypeError(
            f"{name} must be a CuPy array on the GPU, got a NumPy array "
            "(move it with cupy.asarray, or set NUMBA_ENABLE_CUDASIM=1 to run in the simulator)"
        )
    return xp


def check_floating(name: str, x, expected=None, *, bf16_bits: bool = False) -> str:
    """The input kind of ``x``'s dtype; TypeError for an unsupported or mismatched dtype.

    With ``bf16_bits`` (the PyTorch bridge's bfloat16 route) the array must hold
    the raw bits of bfloat16 values as uint16.
    """
    dt = np.dtype(x.dtype)
    if expected is not None and dt != expected:
        raise TypeError(f"{name} must have dtype {expected} like q, got {dt}")
    if bf16_bits:
        if dt != np.uint16:
            raise TypeError(f"{name} must hold bfloat16 bits as uint16, got {dt}")
        return "bfloat16"
    kind = DTYPE_KINDS.get(dt)
    if kind is None:
        raise TypeError(f"{name} must be float16, float32 or float64, got {dt}")
    return kind


def check_last_axis(name: str, x) -> None:
    if x.ndim and x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        raise ValueError(
            f"{name} must be contiguous in its last (head-dim) axis: stride {x.strides[-1]} bytes, "
            f"expected {x.itemsize} (make it contiguous, e.g. with .copy())"
        )


def canonical(x, layout: str):
    """View ``x`` as ``(B, H, N, D)``: a transpose of ``bshd``, never a copy."""
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_device(names, arrays, xp) -> None:
    """All GPU arrays must live on one device."""
    if xp is np:
        return
    dev0 = arrays[0].device.id
    for name, a in zip(names, arrays, strict=False):
        if a.device.id != dev0:
            raise ValueError(f"{name} is on GPU {a.device.id} but q is on GPU {dev0}; all inputs must share a device")


def check_attention(q, k, v, *, causal, scale, layout, bf16_bits: bool = False) -> Problem:
    """Validate the inputs of :func:`nbflash.attention`; raise before anything runs."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhsd' (batch, heads, seqlen, headdim) or 'bshd', got {layout!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    names = ("q", "k", "v")
    arrays = (q, k, v)
    xps = [check_array(n, a) for n, a in zip(names, arrays, strict=False)]
    xp = xps[0]
    for n, a in zip(names, arrays, strict=False):
        if a.ndim != 4:
            dims = "(batch, heads, seqlen, headdim)" if layout == "bhsd" else "(batch, seqlen, heads, headdim)"
            raise ValueError(f"{n} must be 4-D {dims} for layout={layout!r}, got shape {tuple(a.shape)}")
    kind = check_floating("q", q, bf16_bits=bf16_bits)
    check_floating("k", k, q.dtype, bf16_bits=bf16_bits)
    check_floating("v", v, q.dtype, bf16_bits=bf16_bits)
    check_device(names, arrays, xp)
    cq, ck, cv = (canonical(a, layout) for a in arrays)
    B, H, Nq, D = cq.shape
    if ck.shape != cv.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if ck.shape[0] != B or ck.shape[1] != H:
        raise ValueError(
            f"k must have the batch size and number of heads of q ({B}, {H}), got shape {tuple(k.shape)} "
            f"with layout={layout!r}"
        )
    if ck.shape[3] != D:
        raise ValueError(f"k and v must have the head dim of q ({D}), got {ck.shape[3]}")
    for n, a in zip(names, arrays, strict=False):
        if a.size == 0:
            raise ValueError(f"{n} is empty (shape {tuple(a.shape)}); every dimension must be at least 1")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim must be at most {MAX_HEAD_DIM}, got {D}")
    for n, a in zip(names, arrays, strict=False):
        check_last_axis(n, a)
    return Problem(
        xp=xp,
        batch=B,
        heads=H,
        seqlen_q=Nq,
        seqlen_k=ck.shape[2],
        head_dim=D,
        dtype=np.dtype(q.dtype),
        input_kind=kind,
        layout=layout,
        scale=check_scale(scale, D),
        causal=bool(causal),
    )


def check_like(name: str, x, shape, dtype, xp, layout: str) -> None:
    """``x`` must be an array of ``xp`` with the given canonical shape and dtype (backward inputs)."""
    if check_array(name, x) is not xp:
        raise TypeError(f"{name} must be the same kind of array as q")
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise TypeError(f"{name} must have dtype {np.dtype(dtype)}, got {np.dtype(x.dtype)}")
    got = tuple(canonical(x, layout).shape) if x.ndim == 4 else tuple(x.shape)
    if got != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (canonical B, H, N, D), got {tuple(x.shape)}")
    if x.ndim == 4:
        check_last_axis(name, x)
