"""The public entry points: :func:`attention` and its gradient, :func:`attention_backward`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _launch
from . import backward as _bwd
from . import backward_tc as _bwd_tc
from . import backward_wgmma as _bwd_wg
from . import forward as _simt
from . import forward_tc as _tc
from . import forward_wgmma as _wg
from ._device import SIMULATOR, compute_capability, max_shared_per_block, stream_handle
from ._streams import array_device, current_stream
from ._validate import Problem, canonical, check_attention, check_device, check_like

#: Values of the ``backend=`` argument.
BACKENDS = ("auto", "simt", "tensor_core", "wgmma")


@dataclass(frozen=True)
class Plan:
    """Which forward kernel a call runs, with its configuration and the reason (see :func:`which_backend`)."""

    backend: str  # "simt", "tensor_core" (mma.sync) or "wgmma" (Hopper)
    config: Any  # nbflash.forward.TileConfig, nbflash.forward_tc.TCConfig or nbflash.forward_wgmma.WGConfig
    reason: str


def plan_forward(head_dim: int, input_kind: str, scale: float, q, k, v, backend: str = "auto",
                 causal: bool = False) -> Plan:
    """Choose the forward kernel for validated inputs: canonical ``(B, H, N, D)`` views or descriptors of q, k, v.

    ``causal`` matters to the Hopper kernel's launch only (persistent blocks or not:
    :func:`nbflash.forward_wgmma.config_for`).

    The rule of :func:`which_backend`; bridges that validate their own inputs
    (:mod:`nbflash.torch`) call this directly.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    simt = _simt.with_copies(_simt.choose_config(head_dim, input_kind), q, k, v)
    if backend == "simt":
        return Plan("simt", simt, "requested")
    why, cfg = "", None
    if input_kind not in ("float16", "bfloat16"):
        why = f"the tensor cores take float16 and bfloat16, not {input_kind}"
    elif head_dim % 8:
        why = f"head dim {head_dim} is not a multiple of 8 (rows must be whole 16-byte chunks)"
    elif not scale > 0:
        why = f"scale {scale} is not positive"
    if backend == "wgmma":
        if why:
            raise ValueError(f"backend='wgmma' cannot run this call: {why}")
        cfg = _wg.config_for(head_dim, input_kind, q, k, v, causal)
        ok, why = _wg.can_implement(cfg, q, k, v)
        if not ok:
            raise ValueError(f"backend='wgmma' cannot run this call: {why}")
        return Plan("wgmma", cfg, "requested")
    if not why and backend == "auto" and (compute_capability() or (0, 0))[0] == 9:
        wg = _wg.config_for(head_dim, input_kind, q, k, v, causal)
        if _wg.can_implement(wg, q, k, v)[0]:
            return Plan("wgmma", wg, "float16/bfloat16 on sm_90: Hopper's wgmma")
    if not why:
        cfg = _tc.choose_config(head_dim, input_kind, max_shared=max_shared_per_block())
        ok, why = _tc.can_implement(cfg, q, k, v)
    return _settle(backend, why, simt, cfg, "this call")


def _settle(backend: str, why: str, simt, tc, what: str) -> Plan:
    """The plan once the tensor-core constraints gave ``why`` ("" if they hold): on ``auto`` the GPU must also
    be sm_80+; a forced ``tensor_core`` that cannot run raises, naming the reason."""
    if not why and backend == "auto":
        cc = compute_capability()
        if cc is None or cc < (8, 0):
            why = "the simulator has no tensor cores" if cc is None else f"compute capability {cc} < 8.0"
    if why:
        if backend == "tensor_core":
            raise ValueError(f"backend='tensor_core' cannot run {what}: {why}")
        return Plan("simt", simt, why)
    return Plan("tensor_core", tc, "requested" if backend == "tensor_core" else "float16/bfloat16 on sm_80+")


def which_backend(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    backend: str = "auto",
    bf16_bits: bool = False,
) -> Plan:
    """The forward kernel that :func:`attention` would run on these inputs, and why.

    ``backend="auto"`` picks the tensor-core kernel for float16 and bfloat16
    on a GPU of compute capability 8.0 or newer when its constraints hold
    (head dim a multiple of 8, rows 16-byte aligned, scale > 0) — on Hopper
    (9.x) the wgmma kernel (:mod:`nbflash.forward_wgmma`, measured faster
    there), elsewhere the ``mma.sync`` one (:mod:`nbflash.forward_tc`) — and
    the SIMT kernel (:mod:`nbflash.forward`) otherwise;
    ``"simt"`` and ``"tensor_core"`` force one (the latter raises ValueError,
    with the reason, when it cannot run the call).  ``"wgmma"`` forces the
    Hopper kernel (:mod:`nbflash.forward_wgmma`, compute capability 9.x only;
    ValueError elsewhere).  In the simulator ``auto`` picks SIMT, and
    ``"tensor_core"`` and ``"wgmma"`` run the emulated instructions.
    """
    p = check_attention(q, k, v, causal=causal, scale=scale, layout=layout, bf16_bits=bf16_bits)
    return plan_forward(p.head_dim, p.input_kind, p.scale, *(canonical(a, layout) for a in (q, k, v)), backend,
                        p.causal)


# ----------------------------------------------------------------------------
# The GPU hot path: a recipe per call signature
# ----------------------------------------------------------------------------
#
# Validation, the kernel choice and the launch arguments depend only on the
# call's *signature*: the arrays' types, shapes, strides, dtypes and device,
# the flags, and which data pointers are 16-byte aligned (tensor cores and
# cp.async need it).  The first call of a signature is checked in full and its
# launches are recorded (nbflash._launch.Recipe); later calls of that
# signature look the recipe up, allocate the outputs and replay it with their
# own pointers.  A signature is cached only after its call passed every check,
# so a bad input never finds a recipe and always meets the full checks.

_FORWARD_RECIPES = _launch.SignatureCache()
_BACKWARD_RECIPES = _launch.SignatureCache()
_GPU = None  # (cupy.ndarray, cupy.empty, cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream), once imported


def _cupy_hooks():
    global _GPU
    if _GPU is None:
        try:
            import cupy
        except ImportError:  # no CuPy: nbflash.attention cannot have been given GPU arrays
            _GPU = ()
        else:
            _GPU = (cupy.ndarray, cupy.empty, cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream)
    return _GPU


def _signature(arrays, flags):
    """``(key, pointers, device)`` of a call on CuPy arrays of the current GPU; ``(None, None, None)`` if the
    fast path does not apply (other array types, another GPU, an unhashable flag)."""
    hooks = _GPU or _cupy_hooks()
    if not hooks:
        return None, None, None
    ndarray, _, get_device, _ = hooks
    device = get_device()
    meta, ptrs, aligned = [], [], []
    for a in arrays:
        if type(a) is not ndarray:
            return None, None, None
        mem = a.data
        if mem.device_id != device:
            return None, None, None
        ptr = mem.ptr
        meta.append((a.shape, a.strides, a.dtype.char))
        ptrs.append(ptr)
        aligned.append(not ptr & 15)
    key = _launch.signature_key(device, meta, aligned, flags)
    return (key, ptrs, device) if key is not None else (None, None, None)


def _flags(causal, scale, layout, backend, *more):
    """The non-array part of a signature: each flag with its type (validation looks at both)."""
    return (type(causal), causal, type(scale), scale, layout, backend, *more)


def _stream(stream) -> int:
    if stream is None:
        return _GPU[3]().ptr
    return stream_handle(stream)


def _forward(p: Problem, q, k, v, *, stream=None, backend: str = "auto", key=None):
    """Allocate ``o`` (in the caller's layout) and ``lse``, and run the forward kernel.

    ``stream``: a Numba stream or raw handle to launch on (default: CuPy's current stream).
    On the GPU the launch is recorded as the recipe of ``key`` (see above) and replayed.
    """
    xp = p.xp
    cq, ck, cv = (canonical(a, p.layout) for a in (q, k, v))
    plan = plan_forward(p.head_dim, p.input_kind, p.scale, cq, ck, cv, backend, p.causal)
    if p.layout == "bhsd":
        o = xp.empty((p.batch, p.heads, p.seqlen_q, p.head_dim), dtype=q.dtype)
    else:
        o = xp.empty((p.batch, p.seqlen_q, p.heads, p.head_dim), dtype=q.dtype)
    lse = xp.empty((p.batch, p.heads, p.seqlen_q), dtype=p.lse_dtype)
    co = canonical(o, p.layout)
    if SIMULATOR:
        _launch_forward(plan, p, cq, ck, cv, co, lse, stream=0)
        return o, lse
    with _launch.record() as launches:
        _launch_forward(plan, p, *_launch.placeholder_args((cq, ck, cv, co, lse)), stream=0)
    try:
        recipe = _launch.Recipe(launches)
    except NotImplementedError:  # arguments the fast launch cannot pass: Numba's launch, uncached
        _launch_forward(plan, p, cq, ck, cv, co, lse, stream=current_stream(xp) if stream is None else stream)
        return o, lse
    if key is not None:
        _FORWARD_RECIPES.put(key, (recipe, o.shape, o.dtype, lse.shape, lse.dtype))
    recipe((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr), _stream(stream), o.data.device_id)
    return o, lse


def _launch_forward(plan: Plan, p: Problem, cq, ck, cv, co, lse, *, stream) -> None:
    if plan.backend == "tensor_core":  # the plan checked q, k, v; o is ours, contiguous and aligned
        _tc.launch_forward_tc(plan.config, cq, ck, cv, co, lse, p.scale, p.causal, stream=stream, check=False)
    elif plan.backend == "wgmma":
        _wg.launch_forward_wgmma(plan.config, cq, ck, cv, co, lse, p.scale, p.causal, stream=stream, check=False)
    else:
        _simt.launch_forward(plan.config, cq, ck, cv, co, lse, p.scale, p.causal, stream=stream)


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    return_lse: bool = False,
    backend: str = "auto",
):
    """Exact scaled-dot-product attention, ``softmax(Q Kᵀ · scale) V``, by one fused kernel.

    Args:
        q: queries, ``(batch, heads, seqlen_q, headdim)`` for ``layout="bhsd"``
            (PyTorch's SDPA order) or ``(batch, seqlen_q, heads, headdim)`` for
            ``"bshd"`` (flash-attn's).  A CuPy array on the GPU; a NumPy array
            when the CUDA simulator is active.  float16, float32 or float64.
            Any view whose last axis is contiguous works without a copy.
        k, v: keys and values, ``seqlen_k`` rows, same batch, heads, head dim,
            dtype and array type as ``q``.  ``seqlen_k`` may differ from
            ``seqlen_q``.
        causal: mask aligned to the bottom-right corner (flash-attn ≥ 2.1):
            query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``::

                seqlen_q=3, seqlen_k=5     seqlen_q=4, seqlen_k=2
                   k: 0 1 2 3 4               k: 0 1
                q0    x x x . .            q0    . .   <- no key: o = 0,
                q1    x x x x .            q1    . .      lse = -inf
                q2    x x x x x            q2    x .
                                           q3    x x

            Costs nothing extra: tiles above the diagonal are skipped.
        scale: multiplies ``Q Kᵀ`` before the softmax; default ``1/sqrt(headdim)``.
        layout: ``"bhsd"`` or ``"bshd"``; the output uses the same layout.
        return_lse: also return ``lse = log sum_j exp(scale · q_i·k_j)``, shape
            ``(batch, heads, seqlen_q)``, float32 (float64 for float64 inputs).
            It is all the backward pass needs besides ``o``.
        backend: ``"auto"`` (tensor cores for float16 on an sm_80+ GPU, SIMT
            otherwise), ``"simt"``, ``"tensor_core"`` (``mma.sync``) or
            ``"wgmma"`` (Hopper's warpgroup instructions, compute capability
            9.x only); :func:`which_backend` says which one a call runs and why.

    Returns:
        ``o`` with the dtype, layout and array type of ``q``, or ``(o, lse)``.

    Raises:
        TypeError: wrong array type (or device kind), unsupported or mismatched dtype.
        ValueError: bad shapes, empty arrays, head dim > 256, a last axis that
            is not contiguous, arrays on different GPUs, an unknown layout.

    Head dims 1..256 and any sequence lengths ≥ 1 are supported; the inputs are
    never modified.
    """
    o, lse = forward_arrays(q, k, v, causal=causal, scale=scale, layout=layout, backend=backend)
    return (o, lse) if return_lse else o


def forward_arrays(q, k, v, *, causal=False, scale=None, layout="bhsd", bf16_bits=False, stream=None, backend="auto"):
    """``(o, lse)`` — :func:`attention` for bridges, with two more options.

    ``bf16_bits``: q, k, v (and then o) are uint16 arrays holding bfloat16
    bits; the kernel converts on load and rounds to nearest-even on store.
    ``stream``: the Numba stream to launch on (default: CuPy's current stream).
    """
    key = None
    if not SIMULATOR:
        key, ptrs, device = _signature((q, k, v), _flags(causal, scale, layout, backend, bf16_bits))
        entry = _FORWARD_RECIPES.get(key) if key is not None else None
        if entry is not None:  # a signature that passed every check before: allocate and replay
            recipe, o_shape, dtype, lse_shape, lse_dtype = entry
            empty = _GPU[1]
            o, lse = empty(o_shape, dtype), empty(lse_shape, lse_dtype)
            recipe((*ptrs, o.data.ptr, lse.data.ptr), _stream(stream), device)
            return o, lse
    p = check_attention(q, k, v, causal=causal, scale=scale, layout=layout, bf16_bits=bf16_bits)
    with array_device(p.xp, q):
        return _forward(p, q, k, v, stream=stream, backend=backend, key=key)


def attention_backward(
    do,
    q,
    k,
    v,
    o,
    lse,
    *,
    causal: bool = False,
    scale: float | None = None,
    layout: str = "bhsd",
    deterministic: bool | None = None,
    backend: str = "auto",
):
    """Gradients ``(dq, dk, dv)`` of :func:`attention` by recomputation (FlashAttention-2's backward).

    Args:
        do: gradient of the loss with respect to ``o``; shape, dtype and array
            type of ``q`` (any view with a contiguous last axis).
        q, k, v: the forward's inputs, as for :func:`attention`.
        o: the forward's output, shape and dtype of ``q``.
        lse: the forward's ``lse`` (``attention(..., return_lse=True)``), shape
            ``(batch, heads, seqlen_q)``, float32 (float64 for float64 inputs).
            A row with ``lse = -inf`` (it saw no key) gets zero gradients.
        causal, scale, layout: exactly as given to the forward.
        deterministic: ``True`` computes dq by its own query-parallel kernel
            (the same bits on every run, S and P recomputed once more);
            ``False`` adds dq with float32 (float64) atomics inside the dK/dV
            kernel (one pass less; the summation order, and so the last bits
            of dq, vary between runs).  ``None`` (the default) takes the one
            measured faster for the chosen kernels on an H200 (batch·N = 16k,
            heads·D = 2048; ``benchmarks/results/`` has the figures):
            *SIMT*: atomic — 23–26 TFLOP/s against 16–18 deterministic in fp32
            at D = 64 (N = 2k, 8k), for 128 MB more scratch;
            *tensor cores* (mma.sync): deterministic below a padded D of 64,
            atomic from 64 — bf16 on the H200 (N = 1k–16k,
            ``tc-backward-NVIDIA-H200-2026-12-02-grid.json``,
            ``…-d64-fa2tile.json``, ``…-bulk.json``): at D = 64 the atomic
            route with FlashAttention-2's 128 × 128 tiles and warp grid
            124–239 TFLOP/s (geomean 194) against 137–212 (185–187)
            deterministic (it loses only at causal N = 1k); at D = 128
            the atomic route, with FlashAttention-2's 8-warp 64 × 128 tiles
            and its warp grid, 189–270 against 183–222 non-causal and
            133–266 against 146–220 causal (it loses only at causal N = 1k);
            on sm_90, with dQ added by bulk reductions from shared memory
            issued between the dV and dK products, at D = 64 127–271
            (geomean 216, against 186 deterministic) and at D = 128 137–308
            (240 against 196), still behind the deterministic route at
            causal N = 1k only (``tc-backward-NVIDIA-H200-2026-12-03-dqorder*.json``);
            with steps 0 and 2' moving 16 bytes per load and store (about 295 µs less per call at
            batch·N = 16k, heads·D = 2048) the atomic default measured 159–314 TFLOP/s,
            0.96–1.10× SDPA's FlashAttention-2 backward at N = 512–16k, D = 64 and 128, bf16
            and fp16 (``bwd-kernels-NVIDIA-H200-2026-12-03-wide*.json``), 0.95–1.07× in
            ``bench.py``'s run of every pair (``NVIDIA-H200-2026-12-03-tc.json``); the deterministic
            route 145–225 (``bwd-kernels-NVIDIA-H200-2026-12-03-routes.json``, N = 1k–16k);
            at D = 256 97–167 against 79–118
            (``tc-backward-NVIDIA-H200-2026-12-02-wg256.json``);
            *wgmma* (Hopper): atomic where its warp-specialised dK/dV kernel
            adds dQ by bulk reductions (the defaults up to D = 128: dQ from
            each dK/dV block through a shared dSᵀ tile and one more wgmma,
            staged in shared memory by each warp and added by one
            ``cp.reduce.async.bulk`` per warp and tile; 5 products where the
            two kernels do 7) — 1.07–1.18× the previous defaults, 1.15–1.50×
            SDPA flash (``tc-backward-NVIDIA-H200-2026-12-04-bulk-final.json``);
            deterministic elsewhere (by ``red.global.add.v2.f32`` the atomic
            route measured 300 against 327 TFLOP/s at D = 128,
            ``…-12-04-ws2.json``; without warp specialisation 0.75–0.86× the
            deterministic route's speed at D = 64 and 0.87–1.03× at D = 128,
            2026-12-01).  ``False``
            takes it where the configuration has 64-query streamed tiles (every
            GPU default; not the simulator's 16-row ones).
        backend: ``"auto"`` (for float16/bfloat16: on a Hopper GPU (9.x)
            the wgmma backward of :mod:`nbflash.backward_wgmma` at head dims
            that are multiples of 8 up to 128 and from 200 to 256 — its warp-specialised defaults
            measured 1.17–1.34× SDPA's FlashAttention-2 backward on the H200 at
            D = 128 and 1.04–1.19× at D = 64, 0.61–0.74× cuDNN (N = 512–16k,
            bf16 and fp16; ``tc-backward-NVIDIA-H200-2026-12-04-ws-final*.json``),
            against 0.96–1.10× FlashAttention-2 for the ``mma.sync`` one's
            atomic default (2026-12-03); at D = 256 (two whole slices of 128
            gradient columns, dQ by its own kernel) 145–188 TFLOP/s against
            90–121 for the ``mma.sync`` backward's deterministic route and, non-causal,
            153–170 for its atomic one (H100, bf16, N = 1k–16k;
            ``tc-backward-NVIDIA-H100-80GB-HBM3-2026-12-07-s43-d256*.json``);
            else — and on Hopper at D = 136 … 192 — the tensor-core backward of
            :mod:`nbflash.backward_tc` at head dims that are multiples of 8 up
            to 256 on an sm_80+ GPU; the SIMT one otherwise), ``"simt"`` or
            ``"tensor_core"``, or ``"wgmma"`` (Hopper's warpgroup kernels,
            :mod:`nbflash.backward_wgmma`; compute capability 9.x, head dims
            that are multiples of 8 up to 256 — above 128 in slices of 128
            gradient columns; at a padded 192 the second slice is half a zero
            panel, not timed, so ``"auto"`` keeps the ``mma.sync`` backward
            there); independent of the forward's backend
            (both read and write the same ``o`` and ``lse``).

    Returns:
        ``(dq, dk, dv)``, new arrays with the dtype, layout and array type of
        ``q``, ``k`` and ``v``.

    Raises:
        TypeError: wrong array type, dtype or flag type (the error names the argument).
        ValueError: bad shapes, a non-contiguous last axis, anything :func:`attention` refuses.

    The inputs are never modified.
    """
    return backward_arrays(
        do, q, k, v, o, lse, causal=causal, scale=scale, layout=layout, deterministic=deterministic, backend=backend
    )


def backward_arrays(
    do,
    q,
    k,
    v,
    o,
    lse,
    *,
    causal=False,
    scale=None,
    layout="bhsd",
    deterministic=None,
    bf16_bits=False,
    stream=None,
    backend="auto",
):
    """``(dq, dk, dv)`` — :func:`attention_backward` for bridges, with ``bf16_bits`` and ``stream``.

    ``bf16_bits``: do, q, k, v, o (and then dq, dk, dv) are uint16 arrays
    holding bfloat16 bits; ``lse`` stays float32.
    ``stream``: the Numba stream to launch on (default: CuPy's current stream).
    """
    key = None
    if not SIMULATOR:
        flags = _flags(causal, scale, layout, backend, bf16_bits, type(deterministic), deterministic)
        key, ptrs, device = _signature((do, q, k, v, o, lse), flags)
        entry = _BACKWARD_RECIPES.get(key) if key is not None else None
        if entry is not None:  # a signature that passed every check before: allocate and replay
            recipe, shapes, dtype = entry
            empty = _GPU[1]
            grads = [empty(shape, dtype) for shape in shapes]
            ptrs += [g.data.ptr for g in grads]
            if recipe.scratch_bytes:
                arena = empty(recipe.scratch_bytes, np.uint8)  # freed after the launches, stream-ordered
                ptrs.append(arena.data.ptr)
            recipe(ptrs, _stream(stream), device)
            return tuple(grads)
    p = check_attention(q, k, v, causal=causal, scale=scale, layout=layout, bf16_bits=bf16_bits)
    if deterministic is not None and not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool or None, got {type(deterministic).__name__}")
    q_shape = (p.batch, p.heads, p.seqlen_q, p.head_dim)
    check_like("do", do, q_shape, q.dtype, p.xp, layout)
    check_like("o", o, q_shape, q.dtype, p.xp, layout)
    check_like("lse", lse, (p.batch, p.heads, p.seqlen_q), p.lse_dtype, p.xp, layout)
    check_device(("q", "do", "o", "lse"), (q, do, o, lse), p.xp)
    xp = p.xp
    with array_device(xp, q):
        return _backward(
            p, do, q, k, v, o, lse, deterministic=deterministic, stream=stream, backend=backend, key=key
        )


def plan_backward(head_dim: int, input_kind: str, scale: float, do, q, k, v, o, backend: str = "auto",
                  causal: bool = False) -> Plan:
    """Choose the backward kernels for validated inputs (canonical views or descriptors): the rule of
    :func:`plan_forward`, with the tensor-core backward's own constraints (head dim a multiple of 8 up to 256;
    the wgmma backward's, on Hopper, up to 128 and from 200 to 256,
    :func:`nbflash.backward_wgmma.auto_takes_head_dim`; its configuration depends on ``causal`` too,
    :func:`nbflash.backward_wgmma.config_for`).
    The SIMT kernels copy their tiles by cp.async where the rows allow it (:func:`nbflash.backward.with_copies`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    simt = _bwd.with_copies(_bwd.choose_config(head_dim, input_kind), q, k, v, o, do)
    if backend == "simt":
        return Plan("simt", simt, "requested")
    if backend == "wgmma":
        why = ""
        if input_kind not in ("float16", "bfloat16"):
            why = f"the tensor cores take float16 and bfloat16, not {input_kind}"
        else:
            try:
                cfg = _bwd_wg.config_for(head_dim, input_kind, do, q, k, v, o, causal)
                why = _bwd_wg.can_implement(cfg, do, q, k, v, o)[1]
            except ValueError as e:
                why = str(e)
        if why:
            raise ValueError(f"backend='wgmma' cannot run this backward: {why}")
        return Plan("wgmma", cfg, "requested")
    why, cfg = "", None
    if input_kind not in ("float16", "bfloat16"):
        why = f"the tensor cores take float16 and bfloat16, not {input_kind}"
    elif backend == "auto" and (compute_capability() or (0, 0))[0] == 9 and _bwd_wg.auto_takes_head_dim(head_dim):
        wg = _bwd_wg.config_for(head_dim, input_kind, do, q, k, v, o, causal)
        if _bwd_wg.can_implement(wg, do, q, k, v, o)[0]:
            return Plan("wgmma", wg, "float16/bfloat16 on sm_90: Hopper's wgmma")
    if not why:
        try:
            cfg = _bwd_tc.choose_config(head_dim, input_kind)
        except ValueError as e:
            why = str(e)
    if not why:
        ok, why = _bwd_tc.can_implement(cfg, do, q, k, v, o)
    return _settle(backend, why, simt, cfg, "this backward")


def run_backward(
    plan: Plan,
    do,
    q,
    k,
    v,
    o,
    lse,
    dq,
    dk,
    dv,
    scale: float,
    causal: bool,
    *,
    deterministic: bool | None,
    stream,
    empty=None,
) -> None:
    """Launch the backward kernels of ``plan`` on canonical views or descriptors, writing ``dq, dk, dv``.

    ``plan`` must come from :func:`plan_backward` on these same ``do, q, k, v, o`` (its checks are not
    repeated), and ``dq, dk, dv`` be fresh arrays of q's, k's, v's shape and dtype.

    ``deterministic=None``: the dQ route measured faster for the plan's kernels (see
    :func:`attention_backward`); ``empty(shape, dtype)`` allocates the scratch (default: q's array module).
    """
    if deterministic is None:  # atomic dQ for SIMT, for mma.sync from D = 64 where its tiles fit, and for wgmma where
        # its warp-specialised dK/dV kernel adds dQ by bulk reductions
        deterministic = (plan.backend == "wgmma" and not _bwd_wg.prefers_atomic(plan.config)) or (
            plan.backend == "tensor_core" and plan.config.d_pad <= 64
            and not _bwd_tc.choose_config(plan.config.head_dim, plan.config.input_kind, atomic=True).grid)
    flags = dict(deterministic=bool(deterministic), stream=stream, empty=empty)
    if plan.backend == "tensor_core":  # the plan checked do, q, k, v, o; dq, dk, dv are the caller's fresh arrays
        cfg = plan.config
        if not flags["deterministic"]:  # the atomic route's own tiles (the same array rules; shared memory checked)
            cfg = _bwd_tc.choose_config(cfg.head_dim, cfg.input_kind, atomic=True)
        _bwd_tc.launch_backward_tc(cfg, do, q, k, v, o, lse, dq, dk, dv, scale, bool(causal), check=False, **flags)
    elif plan.backend == "wgmma":  # atomic only where the configuration has it (64-query streamed tiles)
        cfg = plan.config
        det = flags["deterministic"] or not _bwd_wg.can_implement(cfg, do, q, k, v, o, atomic=True)[0]
        _bwd_wg.launch_backward_wgmma(
            cfg, do, q, k, v, o, lse, dq, dk, dv, scale, bool(causal), stream=stream, empty=empty, check=False,
            deterministic=det,
        )
    else:
        _bwd.launch_backward(plan.config, q, k, v, o, do, lse, dq, dk, dv, scale, bool(causal), **flags)


def _backward(
    p: Problem, do, q, k, v, o, lse, *, deterministic: bool | None, stream, backend: str = "auto", key=None
):
    """Allocate ``dq, dk, dv`` (in the caller's layout) and run the backward kernels (on the GPU: recorded as
    the recipe of ``key`` and replayed, as the forward)."""
    xp, layout = p.xp, p.layout
    cdo, cq, ck, cv, co = (canonical(a, layout) for a in (do, q, k, v, o))
    plan = plan_backward(p.head_dim, p.input_kind, p.scale, cdo, cq, ck, cv, co, backend, p.causal)
    dq, dk, dv = (xp.empty(a.shape, dtype=a.dtype) for a in (q, k, v))  # C-contiguous, in the caller's layout
    cdq, cdk, cdv = (canonical(a, layout) for a in (dq, dk, dv))
    arrays = (cdo, cq, ck, cv, co, lse, cdq, cdk, cdv)
    flags = dict(deterministic=deterministic)
    if SIMULATOR:
        run_backward(plan, *arrays, p.scale, p.causal, stream=0, **flags)
        return dq, dk, dv
    arena = _launch.Arena(len(arrays))
    with _launch.record() as launches:
        run_backward(plan, *_launch.placeholder_args(arrays), p.scale, p.causal, stream=0, empty=arena, **flags)
    try:
        recipe = _launch.Recipe(launches, arena.nbytes)
    except NotImplementedError:  # arguments the fast launch cannot pass: Numba's launch, uncached
        stream = current_stream(xp) if stream is None else stream
        run_backward(plan, *arrays, p.scale, p.causal, stream=stream, **flags)
        return dq, dk, dv
    if key is not None:
        _BACKWARD_RECIPES.put(key, (recipe, (q.shape, k.shape, v.shape), q.dtype))
    ptrs = [a.data.ptr for a in (do, q, k, v, o, lse, dq, dk, dv)]
    scratch = xp.empty(recipe.scratch_bytes, np.uint8) if recipe.scratch_bytes else None
    if scratch is not None:
        ptrs.append(scratch.data.ptr)
    recipe(ptrs, _stream(stream), dq.data.device_id)
    return dq, dk, dv


__all__ = [
    "BACKENDS",
    "Plan",
    "attention",
    "attention_backward",
    "backward_arrays",
    "forward_arrays",
    "plan_backward",
    "plan_forward",
    "which_backend",
]
