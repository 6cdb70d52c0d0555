"""The FlashAttention-2 backward pass: gradients by recomputation, never storing the N×N matrices.

Shapes (inside the kernels every tensor is indexed ``[batch, head, row, d]``;
the ``bshd`` layout reaches them as a strided view, never a copy)::

    q, o, do, dq   (B, H, N_q, D)      k, v, dk, dv   (B, H, N_k, D)
    lse            (B, H, N_q)         lse_i = log sum_j exp(S_ij), from the forward
    delta, lse2    (B, H, N_q)         scratch written by step 0 (float32; float64 for float64 inputs)

The forward pass kept only ``O`` and ``lse``.  With them, ``P`` is recomputed
tile by tile exactly as the forward computed it, ``P_ij = exp(S_ij - lse_i)``
(no running max needed: ``lse_i`` is the final normaliser), and the gradients
follow from ``O = P V``::

    dV = Pᵀ dO        dP = dO Vᵀ        dS = P ∘ (dP − D)        dQ = dS K · scale      dK = dSᵀ Q · scale

where ``D_i = rowsum(dP_i ∘ P_i) = rowsum(dO_i ∘ O_i)`` (one number per query).
The buffer holding ``D_i`` is called ``delta`` in the code, so it cannot be
mistaken for the head dim.

0. **Preprocess** (grid: query tiles × heads × batch).  ``D_i = rowsum(dO_i ∘ O_i)``
   and ``lse2_i = lse_i · log2 e``, the log-sum-exp in base 2 so that step 1
   can use ``exp2``.  A row that saw no key has ``lse_i = -inf``; it gets
   ``lse2_i = +inf``, which makes every recomputed ``P_ij = exp2(… − inf) = 0``
   — zero gradients, never NaN.  The atomic variant's dQ accumulator is
   cleared here too, every row of it (same stream; a grid over the
   accumulator's rows where it has more than q).  Step 0 only moves memory,
   so for 16-bit inputs whose head dim is a multiple of 8 (every tensor-core
   backward's) it runs as :func:`preprocess_wide_kernel`, 16 bytes per load
   and store; other inputs take the tile kernel, element by element.

1. **dK, dV** (grid: key tiles × heads × batch — parallel over keys, so every
   block owns its ``dK_j, dV_j`` and nothing is shared between blocks).  Load
   ``K_j, V_j`` into shared memory; ``dK_j = dV_j = 0`` in registers.  For every
   query tile ``i`` that sees some key of the tile (causal tiles with no visible
   pair are skipped, see :func:`nbflash.masking.query_range`):

   a. load ``Q_i, dO_i`` into shared memory, and ``lse2_i, D_i`` into registers
      (with ``async_copy`` they stream in during the previous tile, see "Copies");
   b. ``Sᵀ = K_j Q_iᵀ`` and ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_i)``, with
      invisible pairs set to 0 (each thread a ``ROWS × COLS`` piece: keys are
      rows, queries columns);
   c. ``dPᵀ = V_j dO_iᵀ`` and ``dSᵀ = Pᵀ ∘ (dPᵀ − D_i)``;
   d. ``dK_j += dSᵀ Q_i`` and ``dV_j += Pᵀ dO_i`` (``Pᵀ`` and ``dSᵀ`` go
      through shared memory; a row of them stays within one warp);
   e. *atomic variant only:* ``dQ_i += dS K_j`` into a float32 (float64)
      accumulator in global memory with atomic additions — many key blocks add
      into the same ``dQ_i``, in an order that changes from run to run.  Where
      a thread's dQ columns come in runs of four floats, one
      ``red.global.add.v4.f32`` adds 16 bytes (sm_90; the accumulator's rows
      are padded to ``D_PAD`` so that every run is aligned).

   With ``groups = 2`` (see :func:`dkdv_kernel`) two thread groups split this
   work: one computes ``Pᵀ`` and ``dV_j``, the other ``dPᵀ``, ``dSᵀ`` and ``dK_j``.

   Finally ``dK_j · scale`` and ``dV_j`` are written once.

2. **dQ**, deterministic variant (grid: query tiles × heads × batch).  Load
   ``Q_i, dO_i`` and keep them; ``dQ_i = 0`` in registers.  For every key tile
   ``j`` that some query of the tile sees (:func:`nbflash.masking.key_range`):
   load ``K_j, V_j``; recompute ``S`` and ``P`` as in 1b (now queries are rows);
   ``dP = dO_i V_jᵀ`` (first, with ``async_copy``); ``dS = P ∘ (dP − D_i)``;
   ``dQ_i += dS K_j``.  Write
   ``dQ_i · scale``.  ``S``, ``P`` and ``dP`` are computed twice in total
   (once per kernel): the price of needing no atomics and no N×N storage.

2'. **Convert**, atomic variant: ``dq = accumulator · scale`` in the caller's
   dtype and layout (16-bit outputs whose head dim is a multiple of 8:
   :func:`dq_convert_wide_kernel`, 16 bytes per load and store).

Copies.  By default each tile is loaded by plain loads (converted to the
accumulator type on the way) before a barrier, and the block waits for them.
For float32 inputs whose rows are whole, aligned 16-byte chunks the API sets
``async_copy`` (:func:`with_copies`): ``cp.async`` moves 16-byte chunks
straight to shared memory while the block computes.  Each schedule below
orders a tile's products so that the reads of a buffer end before the next
tile's copy into it must start; "wait" is this thread's copies landing, and
the barrier after it shows everyone's and frees the buffers read before it::

    dK/dV, one group: Q_i is read first and last (Sᵀ, dK_j), dO_i in between (dPᵀ, dV_j); 3 barriers a tile
    prologue  copy K_j, V_j, Q_i, dO_i ─ wait ─ barrier
    tile i    Sᵀ, Pᵀ ─ wait ─ barrier ─ dPᵀ, dSᵀ, dK_j += dSᵀ Q_i ─ barrier ─ copy Q_{i+1} ┐
              dV_j += Pᵀ dO_i, step 1e ─ wait ─ barrier ─ copy dO_{i+1} ┐ (the next Sᵀ, Pᵀ)

    dK/dV, two groups: both read Q_i and dO_i in both halves of a tile, so they run half a tile
    apart over a second Q buffer (at D = 128: 199 KB of shared memory instead of 166); 2 barriers a step
    step t    group 0: Sᵀ = K_j Q_tᵀ, Pᵀ     group 1: dK_j += dSᵀ Q_{t−1}     both: step 1e of tile t − 1
              ─ wait ─ barrier ─ copy Q_{t+1} into Q_{t−1}'s buffer ┐
              group 0: dV_j += Pᵀ dO_t     group 1: dPᵀ = V_j dO_tᵀ, dSᵀ
              ─ wait ─ barrier ─ copy dO_{t+1} ┐ (the next step's first half)
              (one step more, t = last + 1, finishes the last tile's dK_j)

    dQ: dP first, so V_j is read only at the start of a tile and K_j after it; 2 barriers a tile
    prologue  copy Q_i, dO_i, V_0 ─ wait ─ barrier ─ copy K_0 ┐
    tile j    dP = dO_i V_jᵀ ─ wait ─ barrier ─ copy V_{j+1} ┐
              S, P, dS, dQ_i += dS K_j ─ wait ─ barrier ─ copy K_{j+1} ┐ (the next dP)

(With plain loads: 2 barriers a tile, 3 with the atomic dQ; two groups 3, 4 with it.)
The API picks cp.async for one-group dK/dV tiles only: on the H200 the
two-group schedule measured slower than plain loads (:func:`with_copies`).

Exponentials are base 2 with the scale folded in, as in the forward.  Inputs
float16/bfloat16/float32 accumulate in float32; float64 in float64.
Constraints: any ``N_q, N_k ≥ 1`` (they may differ; causal is bottom-right
aligned); ``D ≤ 256``, padded inside to a multiple of ``THREADS_X``.  Shared
memory per block: :func:`dkdv_shared_bytes` and :func:`dq_shared_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from . import intrinsics as I
from ._device import (
    SIMULATOR,
    cuda,
    device_function,
    kernel,
    launch,
    max_shared_per_block,
    numba,
    syncwarp,
)
from ._tiles import (
    INPUT_KINDS,
    LOG2E,
    TileConfig,
    async_copy_ok,
    d_chunk,
    grid_shape,
    make_async_tile_loader,
    make_block_tile,
    make_d_column,
    make_loader,
    make_mm_nn,
    make_mm_nt,
    make_row_reducers,
    make_storer,
    make_tile_loader,
    numba_type,
    pad_head_dim,
    vector_width,
)
from ._validate import MAX_HEAD_DIM, array_module
from .intrinsics import red_add_f32x4
from .masking import d_key_range, d_query_range, d_row_key_end, d_tile_needs_mask

#: The arrays held to cp.async's alignment rule: q, k, v, do (whose tiles it copies) and o (see :func:`with_copies`).
COPIED = ("q", "k", "v", "o", "do")

# ----------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BackwardConfig:
    """Tile configurations of the backward kernels.

    ``dkdv`` is for step 1, where ``block_n`` keys stay in shared memory while
    tiles of ``block_m`` queries stream past; there the *rows* of a thread's
    piece are keys (``block_n`` must divide by ``threads_y``) and the columns
    queries (``block_m`` by ``threads_x``).  ``dq`` is for steps 0, 2 and 2',
    where queries are rows, as in the forward.
    """

    dkdv: TileConfig
    dq: TileConfig


def _steps_0_and_2p(dq: TileConfig) -> TileConfig:
    """The tile of the preprocess and convert kernels: ``dq`` without what they do not use (cp.async copies,
    launch bounds), so that every variant of ``dq`` shares their compiled code."""
    return dataclasses.replace(dq, async_copy=False, min_blocks=0)


def _pipelined(cfg: TileConfig) -> bool:
    """Does the dK/dV kernel run the two groups half a query tile apart (cp.async, two Q_i buffers)?"""
    return cfg.async_copy and cfg.groups == 2


def dkdv_shared_offsets(cfg: TileConfig) -> tuple[int, int, int, int, int, int, int]:
    """Offsets (elements) of K_j, V_j, Q_i, dO_i, Pᵀ and dSᵀ in the dK/dV kernel's shared buffer, and its end.

    Pitches: every tile is read 16 bytes at a time along rows that belong to
    different threads (K_j, V_j, Q_i, dO_i in steps 1b/1c, Pᵀ and dSᵀ in
    1d), so each row gets one spare vector: neighbouring rows then start in
    different banks, and every row stays 16-byte aligned.  With ``async_copy``
    and two groups Q_i has two buffers, the second right after the first (see
    "Copies" in the module docstring): at D = 128, 199 KB instead of 166 KB.
    """
    vec = vector_width(cfg)
    d_pitch = cfg.head_dim_pad + vec
    p_pitch = cfg.block_m + vec
    q_buffers = 2 if _pipelined(cfg) else 1
    k_off = 0
    v_off = k_off + cfg.block_n * d_pitch  # K_j: BLOCK_N keys
    q_off = v_off + cfg.block_n * d_pitch  # V_j: BLOCK_N keys
    do_off = q_off + q_buffers * cfg.block_m * d_pitch  # Q_i: BLOCK_M queries (one or two buffers)
    p_off = do_off + cfg.block_m * d_pitch  # dO_i: BLOCK_M queries
    ds_off = p_off + cfg.block_n * p_pitch  # Pᵀ: BLOCK_N keys × BLOCK_M queries
    end = ds_off + cfg.block_n * p_pitch  # dSᵀ: the same shape
    return k_off, v_off, q_off, do_off, p_off, ds_off, end


def dkdv_shared_bytes(cfg: TileConfig) -> int:
    """Dynamic shared memory of one block of the dK/dV kernel."""
    return dkdv_shared_offsets(cfg)[-1] * cfg.acc_itemsize


def dq_shared_offsets(cfg: TileConfig) -> tuple[int, int, int, int, int, int]:
    """Offsets (elements) of Q_i, dO_i, K_j, V_j and dS in the dQ kernel's shared buffer, and its end.

    Padded as in :func:`dkdv_shared_offsets`: all five are read 16 bytes at a
    time along rows owned by different threads.
    """
    vec = vector_width(cfg)
    d_pitch = cfg.head_dim_pad + vec
    q_off = 0
    do_off = q_off + cfg.block_m * d_pitch  # Q_i: BLOCK_M queries
    k_off = do_off + cfg.block_m * d_pitch  # dO_i: BLOCK_M queries
    v_off = k_off + cfg.block_n * d_pitch  # K_j: BLOCK_N keys
    ds_off = v_off + cfg.block_n * d_pitch  # V_j: BLOCK_N keys
    end = ds_off + cfg.block_m * (cfg.block_n + vec)  # dS: BLOCK_M queries × BLOCK_N keys
    return q_off, do_off, k_off, v_off, ds_off, end


def dq_shared_bytes(cfg: TileConfig) -> int:
    """Dynamic shared memory of one block of the dQ kernel."""
    return dq_shared_offsets(cfg)[-1] * cfg.acc_itemsize


def _tile(block_m, block_n, d_pad, tx, ty, input_kind, acc_kind) -> TileConfig:
    return TileConfig(
        block_m=block_m,
        block_n=block_n,
        head_dim_pad=d_pad,
        threads_x=tx,
        threads_y=ty,
        input_kind=input_kind,
        acc_kind=acc_kind,
    )


@functools.cache
def choose_config(head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR) -> BackwardConfig:
    """The tile configurations the API uses for this head dim and input type (cached).

    On the GPU every kernel has 128 threads (8 rows × 16 lanes).  The tile that
    stays in shared memory is the larger one (keys for dK/dV, queries for dQ,
    as in FlashAttention-2), and both shrink with the head dim and for float64
    so that the register accumulators (``ROWS × D_PAD/16`` values per thread,
    twice for dK and dV) stay in registers and the shared tiles fit.  Tiles,
    as (stationary × streamed) rows:

    ==================  ============================  ============================
    padded head dim     dK/dV: keys × queries         dQ: queries × keys
    ==================  ============================  ============================
    ≤ 64                64 × 32  (float64: 32 × 16)   64 × 32  (float64: 32 × 16)
    ≤ 128               64 × 64, two thread groups    64 × 32  (float64: 32 × 16)
                        (float64: 16 × 16)
    ≤ 256               16 × 16  (float64: 16 × 16)   32 × 16  (float64: 16 × 16)
    ==================  ============================  ============================

    These sizes compile for sm_90 without register spills (checked by
    ``tests/test_backward.py``).  The float32 tiles up to D = 128 were timed
    on the H200 (``benchmarks/fp32_candidates.py``, with plain loads); the
    others were not tuned.  On aligned float32 inputs the API runs them with
    cp.async copies (:func:`with_copies`, :func:`async_variant`).
    In the simulator, where each CUDA thread is a Python thread, tiles are
    8 × 8 with 4 × 2 threads.
    """
    acc_kind = "float64" if input_kind == "float64" else "float32"
    if simulator:
        tx, ty = 4, 2
        d_pad = pad_head_dim(head_dim, tx)
        tile = _tile(8, 8, d_pad, tx, ty, input_kind, acc_kind)
        return BackwardConfig(dkdv=tile, dq=tile)
    tx, ty = 16, 8
    d_pad = pad_head_dim(head_dim, tx)
    if acc_kind == "float32":
        if d_pad <= 64:
            keys, kv_queries, queries, q_keys = 64, 32, 64, 32
        elif d_pad <= 128:
            keys, kv_queries, queries, q_keys = 32, 32, 64, 32
        else:
            keys, kv_queries, queries, q_keys = 16, 16, 32, 16
    else:  # a double takes two registers
        if d_pad <= 64:
            keys, kv_queries, queries, q_keys = 32, 16, 32, 16
        elif d_pad <= 128:
            keys, kv_queries, queries, q_keys = 16, 16, 32, 16
        else:
            keys, kv_queries, queries, q_keys = 16, 16, 16, 16
    if input_kind == "float32" and 64 < d_pad <= 128:
        # Two thread groups over 64 × 64 dK/dV tiles (one computes Pᵀ and dV, the other dPᵀ, dSᵀ and dK), in
        # 16-byte column runs at D = 128: 24.1–26.6 TFLOP/s on the H200 against 20.5–21.8 for 32 × 32
        # (benchmarks/results/fp32-candidates-NVIDIA-H200-2026-11-30-session4.json).  The head dim pads to a
        # multiple of 32 (threads_x · groups), of 128 for the 16-byte runs.  float32 inputs only: with 16-bit
        # inputs the same tiles put 256 bytes on the stack at D = 128 (their conversion needs registers).
        # It needs 166 KB of shared memory per block: a GPU that allows less (A100: 163 KB) keeps 32 × 32.
        wide = pad_head_dim(head_dim, 2 * tx)
        dkdv = TileConfig(64, 64, wide, tx, ty, input_kind, acc_kind, groups=2, interleave=wide == 128)
        if dkdv_shared_bytes(dkdv) <= _shared_limit():
            return BackwardConfig(dkdv=dkdv, dq=_tile(queries, q_keys, wide, tx, ty, input_kind, acc_kind))
    return BackwardConfig(
        dkdv=_tile(kv_queries, keys, d_pad, tx, ty, input_kind, acc_kind),
        dq=_tile(queries, q_keys, d_pad, tx, ty, input_kind, acc_kind),
    )


def _shared_limit() -> int:
    """The current device's shared memory per block; Hopper's 227 KB where there is no device to ask
    (offline compilation)."""
    try:
        return max_shared_per_block()
    except Exception:  # no GPU and no simulator
        return 227 * 1024


def can_implement(cfg: BackwardConfig) -> tuple[bool, str]:
    """Will these configurations launch on the current device?  ``(ok, reason)``."""
    kv = cfg.dkdv
    if kv.block_n % kv.threads_y or kv.block_m % kv.threads_x:
        return False, (
            f"dK/dV tiles {kv.block_n} keys × {kv.block_m} queries must divide by the "
            f"{kv.threads_y} × {kv.threads_x} thread layout (keys are rows there)"
        )
    if kv.head_dim_pad != cfg.dq.head_dim_pad or kv.input_kind != cfg.dq.input_kind or kv.acc_kind != cfg.dq.acc_kind:
        return False, "the dK/dV and dQ configurations must agree on head dim and types"
    limit = max_shared_per_block()
    for name, need in (("dK/dV", dkdv_shared_bytes(kv)), ("dQ", dq_shared_bytes(cfg.dq))):
        if need > limit:
            return False, f"the {name} kernel needs {need} bytes of shared memory per block, the device allows {limit}"
    for tile in (kv, cfg.dq):
        if tile.threads > 1024:
            return False, f"{tile.threads} threads per block exceed 1024"
    if cfg.dq.groups != 1:
        return False, f"the dQ kernels take one thread group, got groups={cfg.dq.groups}"
    for name, tile in (("dK/dV", kv), ("dQ", cfg.dq)):
        if tile.async_copy and vector_width(tile) * tile.acc_itemsize != 16:
            return False, (
                f"the {name} tiles' rows are not 16-byte aligned in shared memory (cp.async needs it): "
                f"block_n={tile.block_n} and head_dim_pad={tile.head_dim_pad} must be multiples of 4"
            )
    return True, ""


def async_variant(cfg: BackwardConfig) -> BackwardConfig:
    """``cfg`` with ``async_copy`` on both kernels' tiles (float32 only): what :func:`with_copies` picks for
    aligned inputs when it fits.

    The copies' addresses cost registers.  At ``D_PAD ≤ 64`` the 128-thread
    kernels with plain loads take 128–142 registers, so three blocks share an
    SM (their shared memory allows three); with cp.async ptxas goes to 214–254
    and two.  Launch bounds for three blocks per SM (``min_blocks = 3``) keep
    them at ≤ 168 registers, with no spills (sm_90, ``tests/test_backward.py``).
    The larger tiles keep their occupancy without them: one block of the
    two-group dK/dV kernel (shared memory), two of the D = 128 dQ kernel.
    """

    def copies(tile: TileConfig) -> TileConfig:
        three = tile.threads == 128 and tile.head_dim_pad <= 64 and not tile.min_blocks
        return dataclasses.replace(tile, async_copy=True, min_blocks=3 if three else tile.min_blocks)

    return BackwardConfig(dkdv=copies(cfg.dkdv), dq=copies(cfg.dq))


def with_copies(cfg: BackwardConfig, q, k, v, o, do) -> BackwardConfig:
    """``cfg`` with ``async_copy`` where cp.async can copy the tiles and the kernels fit (the API's choice), else
    ``cfg``.

    float32 inputs whose rows are whole, aligned 16-byte chunks
    (:func:`nbflash._tiles.async_copy_ok` on q, k, v, o, do) take
    :func:`async_variant`, provided it can run here (:func:`can_implement`:
    with two groups the dK/dV kernel's second Q_i buffer must fit).  ``o``
    is read only by step 0, with plain loads, but is held to the rule too (the
    tensor-core backward checks the same five arrays).

    Only one-group dK/dV tiles take it.  Measured on the H200 (fp32, batch·N =
    16k, heads·D = 2048, N = 2k / 8k, non-causal then causal;
    ``fp32-candidates-NVIDIA-H200-2026-11-30-bwd-async.json``): D = 64 (one
    group) 31.4 / 29.0 / 32.0 / 30.8 TFLOP/s against 23.7 / 22.3 / 24.3 / 23.9
    with plain loads; D = 128 with two groups 24.4 / 22.8 / 24.9 / 24.9
    against 25.7 / 24.1 / 24.8 / 26.6 — the half-tile skew between the groups
    costs more than the copies save there, so that configuration keeps plain
    loads (``async_variant`` still builds it, for tests and sweeps).
    """
    if cfg.dkdv.async_copy or cfg.dkdv.input_kind != "float32" or cfg.dkdv.groups != 1:
        return cfg
    if not async_copy_ok(cfg.dkdv, q, k, v, o, do, names=COPIED)[0]:
        return cfg
    copies = async_variant(cfg)
    return copies if can_implement(copies)[0] else cfg


# ----------------------------------------------------------------------------
# Step 0: D_i = rowsum(dO_i ∘ O_i), lse in base 2
# ----------------------------------------------------------------------------


@functools.cache
def preprocess_kernel(cfg: TileConfig):
    """The compiled preprocess kernel (step 0) for one configuration (cached)."""
    BLOCK_M = cfg.block_m
    THREADS_X, THREADS_Y = cfg.threads_x, cfg.threads_y
    ROWS = BLOCK_M // THREADS_Y
    acc_t = numba_type(cfg.acc_kind)
    to_acc = make_loader(cfg.input_kind, cfg.acc_kind)
    _, row_sum = make_row_reducers(THREADS_X)

    @kernel(fastmath=cfg.acc_kind == "float32")
    def flash_backward_preprocess(o, do, lse, delta, lse2, dq_accum, clear_dq):
        """One block: D_i and lse2_i for BLOCK_M queries of one (batch, head)."""
        seqlen_q = o.shape[2]
        head_dim = o.shape[3]
        q_start = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        zero = acc_t(0)
        inf = acc_t(math.inf)
        for r in range(ROWS):
            row = q_start + ty + THREADS_Y * r
            part = zero  # this lane's share of the row: columns tx, tx + THREADS_X, ...
            if row < seqlen_q:
                for d in range(tx, head_dim, THREADS_X):
                    part += to_acc(do[b, h, row, d]) * to_acc(o[b, h, row, d])
            if clear_dq and row < dq_accum.shape[2]:  # every row and column of the accumulator, padding included
                for d in range(tx, dq_accum.shape[3], THREADS_X):
                    dq_accum[b, h, row, d] = zero
            D_i = row_sum(part)  # every lane of the row takes part in the shuffles
            if tx == 0 and row < seqlen_q:
                delta[b, h, row] = D_i
                lse_i = acc_t(lse[b, h, row])
                # +inf for a row that saw no key: then exp2(S − lse2) = 0, not NaN.
                lse2[b, h, row] = lse_i * acc_t(LOG2E) if lse_i != -inf else inf

    return flash_backward_preprocess


#: Steps 0 and 2' with 16-byte accesses (16-bit inputs, head dims that are multiples of 8): threads and rows
#: per block, and the lanes that share a row in step 0 (the simulator's blocks are small: a Python thread each).
WIDE_THREADS, WIDE_ROWS = (16, 4) if SIMULATOR else (128, 64)
WIDE_LANES = 8


def takes_wide_rows(input_kind: str, head_dim: int) -> bool:
    """Do steps 0 and 2' move this problem's rows 16 bytes at a time?  16-bit inputs whose head dim is a
    multiple of 8: a row is then whole 16-byte chunks (the tensor-core backwards' inputs always are)."""
    return input_kind in ("float16", "bfloat16") and head_dim % 8 == 0


@functools.cache
def preprocess_wide_kernel(input_kind: str):
    """Step 0 for 16-bit inputs with a head dim that is a multiple of 8, by 16-byte loads and stores (cached).

    Step 0 is pure memory traffic — it reads O and dO and, for the atomic dQ route, clears the float32
    accumulator (twice their bytes) — so its speed is the bytes each instruction moves: the tile kernel's
    2-byte loads and 4-byte stores ran at about a third of the H200's bandwidth (218 µs at 16k tokens ×
    2048 columns, against FlashAttention-2's 68 µs for the same work).  Here ``WIDE_LANES`` lanes share a row:
    lane ``x`` takes its 16-byte chunks ``x, x + WIDE_LANES, …`` of O and dO (eight values each, one
    ``ld.global.v4`` apiece), multiplies and adds them in float32, the row's lanes add their parts by
    shuffles, and the clear is one ``st.global.v4`` of zeros per four accumulator columns.  A row of O or
    dO that is not contiguous along D or not 16-byte aligned (O comes from the caller, and only the
    tensor-core kernels' cp.async inputs are held to that rule) is read element by element instead.
    """
    LANES, THREADS, BLOCK_M = WIDE_LANES, WIDE_THREADS, WIDE_ROWS
    ROWS_PER_PASS = THREADS // LANES
    unpack = I.unpack_bf16x2 if input_kind == "bfloat16" else I.unpack_f16x2
    to_acc = make_loader(input_kind, "float32")
    _, row_sum = make_row_reducers(LANES)

    @device_function
    def chunk_dot(ow, dw):
        """Σ o·do over the eight 16-bit values of one 16-byte chunk of each (four packed words)."""
        o0, o1 = unpack(ow[0])
        d0, d1 = unpack(dw[0])
        o2, o3 = unpack(ow[1])
        d2, d3 = unpack(dw[1])
        o4, o5 = unpack(ow[2])
        d4, d5 = unpack(dw[2])
        o6, o7 = unpack(ow[3])
        d6, d7 = unpack(dw[3])
        return o0 * d0 + o1 * d1 + o2 * d2 + o3 * d3 + o4 * d4 + o5 * d5 + o6 * d6 + o7 * d7

    @kernel(fastmath=True)
    def flash_backward_preprocess_wide(o, do, lse, delta, lse2, dq_accum, clear_dq):
        """One block: D_i and lse2_i for BLOCK_M queries of one (batch, head), 16 bytes per load."""
        seqlen_q = o.shape[2]
        head_dim = o.shape[3]
        chunks = head_dim // 8
        q_start = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        x = cuda.threadIdx.x % LANES  # this lane's chunks of its row: x, x + LANES, ...
        y = cuda.threadIdx.x // LANES
        unit = o.strides[3] == 2 and do.strides[3] == 2  # contiguous along D (then rows are whole chunks)
        zero = numba.float32(0)
        for r in range(BLOCK_M // ROWS_PER_PASS):
            row = q_start + y + ROWS_PER_PASS * r
            part = zero
            if row < seqlen_q:
                o_row = I.global_address(o, (b, h, row, 0))
                do_row = I.global_address(do, (b, h, row, 0))
                if unit and (o_row & 15) == 0 and (do_row & 15) == 0:
                    for c in range(x, chunks, LANES):
                        part += chunk_dot(I.ld_global_v4_b32(o_row + 16 * c), I.ld_global_v4_b32(do_row + 16 * c))
                else:  # a row that is not whole aligned chunks: its elements one by one
                    for c in range(x, chunks, LANES):
                        for e in range(8 * c, 8 * c + 8):
                            part += to_acc(do[b, h, row, e]) * to_acc(o[b, h, row, e])
            if clear_dq and row < dq_accum.shape[2]:  # every row and column of the accumulator, padding included
                acc_row = I.global_address(dq_accum, (b, h, row, 0))  # nbflash's scratch: whole 16-byte chunks
                for c in range(x, dq_accum.shape[3] // 4, LANES):
                    I.st_global_v4_b32(acc_row + 16 * c, 0, 0, 0, 0)
            D_i = row_sum(part)  # every lane of the row takes part in the shuffles
            if x == 0 and row < seqlen_q:
                delta[b, h, row] = D_i
                lse_i = numba.float32(lse[b, h, row])
                # +inf for a row that saw no key: then exp2(S − lse2) = 0, not NaN.
                lse2[b, h, row] = lse_i * numba.float32(LOG2E) if lse_i != -math.inf else numba.float32(math.inf)

    return flash_backward_preprocess_wide


# ----------------------------------------------------------------------------
# Step 1: dK_j and dV_j, parallel over key tiles (and, atomically, dQ)
# ----------------------------------------------------------------------------


@functools.cache
def dkdv_kernel(cfg: TileConfig, atomic_dq: bool = False):
    """The compiled dK/dV kernel (step 1) for one configuration (cached).

    With ``atomic_dq`` it also adds each tile's ``dS K_j`` into the dQ
    accumulator with atomic additions (step 1e).

    With ``cfg.groups == 2`` the block is two copies of the thread layout
    (``threadIdx.z``) that split the work of every query tile, so each thread
    keeps one ``ROWS × COLS`` score tile and one ``ROWS × DCOLS`` accumulator
    instead of two of each — room for twice the tile in the same registers::

        group 0:  Sᵀ = K_j Q_iᵀ, Pᵀ → shared   |  dV_j += Pᵀ dO_i
        group 1:  dPᵀ = V_j dO_iᵀ               |  dSᵀ = Pᵀ ∘ (dPᵀ − D_i) → shared,  dK_j += dSᵀ Q_i
                            (barrier: Pᵀ is complete)

    In step 1e each group adds its half of the head dim of ``dQ_i``.

    With ``cfg.async_copy`` the tiles arrive by ``cp.async`` while the block
    computes, on the schedules of "Copies" in the module docstring: one group
    streams ``dO_i`` under ``Sᵀ`` and ``Q_{i+1}`` under ``dV_j``; two groups
    work half a query tile apart (group 1's ``dK_j`` for tile ``i − 1`` beside
    group 0's ``Sᵀ`` for tile ``i``), over two ``Q_i`` buffers.
    """
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    THREADS_X, THREADS_Y, GROUPS = cfg.threads_x, cfg.threads_y, cfg.groups
    D_PAD = cfg.head_dim_pad
    ROWS = BLOCK_N // THREADS_Y  # keys per thread: the rows of Sᵀ
    COLS = BLOCK_M // THREADS_X  # queries per thread: the columns of Sᵀ
    DCOLS = D_PAD // THREADS_X  # dK/dV columns per thread: d_column(tx, e)
    QROWS = BLOCK_M // THREADS_Y  # dQ rows per thread (step 1e): ty·QROWS + r
    DQ_SHARE = D_PAD // GROUPS  # step 1e: group g adds the dQ columns [g·DQ_SHARE, (g + 1)·DQ_SHARE)
    DQCOLS = DQ_SHARE // THREADS_X  # ... this thread the columns g·DQ_SHARE + dq_column(tx, e)
    ATOMIC_DQ = atomic_dq
    ASYNC = cfg.async_copy  # tiles by cp.async (see "Copies" in the module docstring)
    PIPELINED = _pipelined(cfg)  # ... and two groups half a query tile apart, over two Q_i buffers
    # Step 1e adds 16 bytes at once where a thread's dQ columns come in runs of 4 floats.
    RED4 = cfg.acc_kind == "float32" and d_chunk(cfg, DQCOLS) % 4 == 0
    acc_t = numba_type(cfg.acc_kind)
    u64 = numba.uint64
    K_OFF, V_OFF, Q_OFF, DO_OFF, P_OFF, DS_OFF, _ = (u64(x) for x in dkdv_shared_offsets(cfg))
    VEC = vector_width(cfg)
    D_PITCH, P_PITCH = u64(D_PAD + VEC), u64(BLOCK_M + VEC)
    Q_TILE = u64(BLOCK_M) * D_PITCH  # one Q_i buffer; query tile i uses buffer i & Q_PARITY
    Q_PARITY = u64(1 if PIPELINED else 0)
    BLOCK_N_U = u64(BLOCK_N)
    SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte vector loads need 16-byte alignment

    load_tile = make_tile_loader(cfg)
    copy_tile = make_async_tile_loader(cfg) if ASYNC else None
    fill_tile = copy_tile if ASYNC else load_tile  # the first tiles: started (cp.async) or loaded
    to_out = make_storer(cfg.input_kind)
    block_tile = make_block_tile(cfg)  # the first key tiles have the most (causal) queries: they start first
    d_column = make_d_column(cfg)
    dq_column = make_d_column(cfg, DQCOLS)
    # One thread's piece of each product: Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ (rows · rows over D),
    # dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i (rows of Pᵀ, dSᵀ times columns of dO_i, Q_i).
    mm_rows = make_mm_nt(ROWS, COLS, D_PAD, int(D_PITCH), VEC, cfg.acc_kind)
    mm_cols = make_mm_nn(ROWS, DCOLS, BLOCK_M, int(P_PITCH), int(D_PITCH), VEC, cfg.acc_kind)

    # The pieces of a query tile that every schedule shares, written once.
    @device_function
    def query_vectors(lse2_i, D_i, key_end, lse2, delta, b, h, q_start, seqlen_q, seqlen_k, causal, tx):
        """Step 1a's registers: lse2_i, D_i and the visible keys [0, key_end) of this thread's query columns."""
        for c in range(COLS):
            col = q_start + tx + THREADS_X * c
            key_end[c] = d_row_key_end(col, seqlen_q, seqlen_k, causal)
            lse2_i[c] = lse2[b, h, col] if col < seqlen_q else acc_t(math.inf)
            D_i[c] = delta[b, h, col] if col < seqlen_q else acc_t(0)

    @device_function
    def store_p(S, smem, lse2_i, key_end, key_row, query_row, q_start, k_start, seqlen_q, seqlen_k, causal, ty,
                scale_log2):
        """Step 1b after Sᵀ: Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_i) in ``S``, 0 where the pair is invisible,
        and this thread's piece of Pᵀ to shared memory."""
        for r in range(ROWS):
            for c in range(COLS):
                S[r, c] = math.exp2(S[r, c] * scale_log2 - lse2_i[c])
        # Only tiles on the diagonal or a ragged end pay for the mask.
        if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
            for r in range(ROWS):
                key = k_start + ty + THREADS_Y * r
                for c in range(COLS):
                    if key >= key_end[c]:
                        S[r, c] = acc_t(0)  # past a ragged end, or above the causal diagonal
        for r in range(ROWS):
            for c in range(COLS):
                smem[P_OFF + key_row[r] * P_PITCH + query_row[c]] = S[r, c]

    @device_function
    def store_ds(smem, S, dP, D_i, key_row, query_row):
        """Step 1c after dPᵀ: this thread's piece of dSᵀ = Pᵀ ∘ (dPᵀ − D_i) to shared memory (Pᵀ from the
        registers with one group, from shared memory with two)."""
        for r in range(ROWS):
            for c in range(COLS):
                p = S[r, c] if GROUPS == 1 else smem[P_OFF + key_row[r] * P_PITCH + query_row[c]]
                smem[DS_OFF + key_row[r] * P_PITCH + query_row[c]] = p * (dP[r, c] - D_i[c])

    @device_function
    def add_dq(dq_accum, smem, b, h, q_start, seqlen_q, dq_row, dq_col, ty):
        """Step 1e: dQ_i += dS K_j from dSᵀ in shared memory; here a thread owns query rows ty·QROWS + r and
        (with two groups) columns in its group's half of the head dim."""
        dQ_part = cuda.local.array((QROWS, DQCOLS), acc_t)
        ds_m = cuda.local.array(QROWS, acc_t)  # a column of dSᵀ
        k_e = cuda.local.array(DQCOLS, acc_t)  # a row of K_j
        for r in range(QROWS):
            for e in range(DQCOLS):
                dQ_part[r, e] = acc_t(0)
        for n in range(BLOCK_N_U):
            for r in range(QROWS):
                ds_m[r] = smem[DS_OFF + n * P_PITCH + dq_row[r]]
            for e in range(DQCOLS):
                k_e[e] = smem[K_OFF + n * D_PITCH + dq_col[e]]
            for r in range(QROWS):
                for e in range(DQCOLS):
                    dQ_part[r, e] += ds_m[r] * k_e[e]
        # The accumulator has D_PAD columns: padded ones only ever receive zeros.
        for r in range(QROWS):
            row = q_start + ty * QROWS + r
            if row < seqlen_q:
                if RED4:
                    for e in range(0, DQCOLS, 4):
                        red_add_f32x4(dq_accum, (b, h, row, dq_col[e]), dQ_part[r, e], dQ_part[r, e + 1],
                                      dQ_part[r, e + 2], dQ_part[r, e + 3])
                else:
                    for e in range(DQCOLS):
                        cuda.atomic.add(dq_accum, (b, h, row, dq_col[e]), dQ_part[r, e])

    @kernel(fastmath=cfg.acc_kind == "float32", launch_bounds=(cfg.threads, cfg.min_blocks) if cfg.min_blocks else None)
    def flash_backward_dkdv(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, scale, causal):
        """One block: dK_j and dV_j for BLOCK_N keys of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        tile, h, b = block_tile()
        k_start = tile * BLOCK_N
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        g = cuda.threadIdx.z  # the group (always 0 with one group)
        tid = (g * THREADS_Y + ty) * THREADS_X + tx
        p_role = GROUPS == 1 or g == 0  # computes Pᵀ and dV_j
        ds_role = GROUPS == 1 or g == 1  # computes dPᵀ, dSᵀ and dK_j
        # Operands of this thread's first product (Sᵀ = K_j Q_iᵀ, or group 1's dPᵀ = V_j dO_iᵀ)
        # and of its first update (dV_j += Pᵀ dO_i, or group 1's dK_j += dSᵀ Q_i).
        sk_off, sq_off = (K_OFF, Q_OFF) if p_role else (V_OFF, DO_OFF)
        pd_off, dq_off = (P_OFF, DO_OFF) if p_role else (DS_OFF, Q_OFF)

        # One flat buffer holds K_j, V_j, Q_i, dO_i, Pᵀ and dSᵀ at K_OFF, V_OFF, ...
        # (indexed directly, not through slices, so that the compiler can
        # prove the alignment of 16-byte loads).
        smem = cuda.shared.array(0, acc_t, alignment=SMEM_ALIGN)

        # K_j and V_j stay in shared memory; dK_j and dV_j in registers.
        fill_tile(smem, K_OFF, D_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
        fill_tile(smem, V_OFF, D_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
        # With two groups a thread holds one accumulator and one score tile: the
        # names below then share their registers (dV_j is dK_j, S is dP).
        dV_j = cuda.local.array((ROWS, DCOLS), acc_t)
        dK_j = cuda.local.array((ROWS, DCOLS), acc_t) if GROUPS == 1 else dV_j
        S = cuda.local.array((ROWS, COLS), acc_t)  # Sᵀ, then Pᵀ
        dP = cuda.local.array((ROWS, COLS), acc_t) if GROUPS == 1 else S  # dPᵀ
        lse2_i = cuda.local.array(COLS, acc_t)  # of this thread's query columns
        D_i = cuda.local.array(COLS, acc_t)
        key_end = cuda.local.array(COLS, numba.int64)  # column c sees keys [0, key_end[c])
        # This thread's rows and columns as unsigned shared-memory indices:
        # Numba adds a negative-index wraparound to every signed index.
        key_row = cuda.local.array(ROWS, u64)  # key ty + THREADS_Y·r: a row of K_j, V_j, Pᵀ, dSᵀ
        query_row = cuda.local.array(COLS, u64)  # query tx + THREADS_X·c: a row of Q_i, dO_i
        d_col = cuda.local.array(DCOLS, u64)  # column d_column(tx, e) of Q_i, dO_i, dK_j, dV_j
        dq_row = cuda.local.array(QROWS, u64)  # step 1e: query ty·QROWS + r
        dq_col = cuda.local.array(DQCOLS, u64)  # step 1e: column g·DQ_SHARE + dq_column(tx, e) of K_j, dQ_i
        for r in range(ROWS):
            key_row[r] = u64(ty + THREADS_Y * r)
        for c in range(COLS):
            query_row[c] = u64(tx + THREADS_X * c)
        for e in range(DCOLS):
            d_col[e] = u64(d_column(tx, e))
        for r in range(QROWS):
            dq_row[r] = u64(ty * QROWS + r)
        for e in range(DQCOLS):
            dq_col[e] = u64(g * DQ_SHARE + dq_column(tx, e))
        zero = acc_t(0)
        scale_log2 = acc_t(qk_scale_log2)
        for r in range(ROWS):
            for e in range(DCOLS):
                dK_j[r, e] = zero
                dV_j[r, e] = zero

        q_begin, q_end = d_query_range(k_start, BLOCK_N, seqlen_q, seqlen_k, causal)
        i_first, i_last = q_begin // BLOCK_M, (q_end + BLOCK_M - 1) // BLOCK_M
        if ASYNC:  # the first query tile's Q_i and dO_i stream in with K_j and V_j
            if i_first < i_last:
                q_first = i_first * BLOCK_M
                q_buf = Q_OFF + (u64(i_first) & Q_PARITY) * Q_TILE
                copy_tile(smem, q_buf, D_PITCH, q, b, h, q_first, BLOCK_M, seqlen_q, head_dim, tid)
                copy_tile(smem, DO_OFF, D_PITCH, do, b, h, q_first, BLOCK_M, seqlen_q, head_dim, tid)
            I.cp_async_wait_all()  # this thread's chunks of K_j, V_j, Q_i and dO_i have landed ...
            cuda.syncthreads()  # ... and everyone's, before anyone reads them

        if not PIPELINED:
            for i in range(i_first, i_last):
                q_start = i * BLOCK_M
                # Step 1a: stream Q_i and dO_i through shared memory; lse2_i, D_i to registers.  (With cp.async
                # Q_i is already here, and dO_i in flight.)
                if not ASYNC:
                    load_tile(smem, Q_OFF, D_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
                    load_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
                query_vectors(lse2_i, D_i, key_end, lse2, delta, b, h, q_start, seqlen_q, seqlen_k, causal, tx)
                if not ASYNC:
                    cuda.syncthreads()  # Q_i, dO_i (and, the first time, K_j, V_j) are complete before anyone reads

                # Step 1b: Sᵀ = K_j Q_iᵀ, this thread's ROWS × COLS piece (step 1c's dPᵀ = V_j dO_iᵀ with two
                # groups: group 1 computes it here, into the same registers, in the same instructions), then Pᵀ.
                for r in range(ROWS):
                    for c in range(COLS):
                        S[r, c] = zero
                mm_rows(S, smem, sk_off, key_row, sq_off, query_row)
                if p_role:
                    store_p(S, smem, lse2_i, key_end, key_row, query_row, q_start, k_start, seqlen_q, seqlen_k, causal,
                            ty, scale_log2)

                # Step 1c: dPᵀ = V_j dO_iᵀ (one group), and dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
                if GROUPS == 1:
                    if ASYNC:
                        I.cp_async_wait_all()  # this thread's chunks of dO_i have landed ...
                        cuda.syncthreads()  # ... and everyone's, before anyone reads them
                    for r in range(ROWS):
                        for c in range(COLS):
                            dP[r, c] = zero
                    mm_rows(dP, smem, V_OFF, key_row, DO_OFF, query_row)
                else:
                    cuda.syncthreads()  # Pᵀ, written by group 0, is complete
                if ds_role:
                    store_ds(smem, S, dP, D_i, key_row, query_row)
                if ATOMIC_DQ and not ASYNC:
                    cuda.syncthreads()  # step 1e reads whole columns of dSᵀ, written by every warp
                else:
                    syncwarp()  # a row of Pᵀ and of dSᵀ is written and read by the lanes of one warp

                # Step 1d: dK_j += dSᵀ Q_i and dV_j += Pᵀ dO_i (with two groups: group 1 the first, group 0 the
                # second, in the same instructions).
                if GROUPS == 1:
                    mm_cols(dK_j, smem, DS_OFF, key_row, Q_OFF, d_col)  # the last read of Q_i
                    if ASYNC:
                        cuda.syncthreads()  # everyone is done with Q_i (and dSᵀ is complete for step 1e) ...
                        if i + 1 < i_last:  # ... so Q_{i+1} streams in under dV_j += Pᵀ dO_i and step 1e
                            copy_tile(smem, Q_OFF, D_PITCH, q, b, h, q_start + BLOCK_M, BLOCK_M, seqlen_q, head_dim,
                                      tid)
                mm_cols(dV_j, smem, pd_off, key_row, dq_off, d_col)
                if ATOMIC_DQ:
                    add_dq(dq_accum, smem, b, h, q_start, seqlen_q, dq_row, dq_col, ty)
                if ASYNC:
                    I.cp_async_wait_all()  # this thread's chunks of Q_{i+1} have landed (the barrier shows everyone's)
                cuda.syncthreads()  # everyone is done with Q_i, dO_i, Pᵀ and dSᵀ before the next load
                if ASYNC and i + 1 < i_last:  # dO_{i+1} streams in under the next Sᵀ
                    copy_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start + BLOCK_M, BLOCK_M, seqlen_q, head_dim, tid)
        else:
            # Two groups half a query tile apart; step t ends tile t's Pᵀ, dV_j, dPᵀ, dSᵀ and tile t − 1's
            # dK_j (and step 1e), so one last step, t = i_last, finishes tile i_last − 1.
            for t in range(i_first, i_last + 1):
                q_start = t * BLOCK_M
                fresh = t < i_last  # tile t exists (not the last step)
                q_cur = Q_OFF + (u64(t) & Q_PARITY) * Q_TILE  # Q_t's buffer
                q_other = Q_OFF + (u64(t + 1) & Q_PARITY) * Q_TILE  # Q_{t−1}'s, then Q_{t+1}'s
                if fresh:
                    query_vectors(lse2_i, D_i, key_end, lse2, delta, b, h, q_start, seqlen_q, seqlen_k, causal, tx)
                # Phase A (dO_t in flight): group 0 Sᵀ = K_j Q_tᵀ and Pᵀ; group 1 dK_j += dSᵀ Q_{t−1}.
                if p_role:
                    if fresh:
                        for r in range(ROWS):
                            for c in range(COLS):
                                S[r, c] = zero
                        mm_rows(S, smem, K_OFF, key_row, q_cur, query_row)
                        store_p(S, smem, lse2_i, key_end, key_row, query_row, q_start, k_start, seqlen_q,
                                seqlen_k, causal, ty, scale_log2)
                elif t > i_first:
                    mm_cols(dK_j, smem, DS_OFF, key_row, q_other, d_col)
                if ATOMIC_DQ and t > i_first:  # step 1e for tile t − 1 (its dSᵀ is complete)
                    add_dq(dq_accum, smem, b, h, q_start - BLOCK_M, seqlen_q, dq_row, dq_col, ty)
                I.cp_async_wait_all()  # this thread's chunks of dO_t have landed
                cuda.syncthreads()  # Pᵀ and dO_t are complete; everyone is done with Q_{t−1} and dSᵀ
                if t + 1 < i_last:  # Q_{t+1} streams into Q_{t−1}'s buffer during phase B
                    copy_tile(smem, q_other, D_PITCH, q, b, h, q_start + BLOCK_M, BLOCK_M, seqlen_q, head_dim, tid)
                # Phase B (Q_{t+1} in flight): group 0 dV_j += Pᵀ dO_t; group 1 dPᵀ = V_j dO_tᵀ and dSᵀ.
                if fresh:
                    if p_role:
                        mm_cols(dV_j, smem, P_OFF, key_row, DO_OFF, d_col)
                    else:
                        for r in range(ROWS):
                            for c in range(COLS):
                                dP[r, c] = zero
                        mm_rows(dP, smem, V_OFF, key_row, DO_OFF, query_row)
                        store_ds(smem, S, dP, D_i, key_row, query_row)
                I.cp_async_wait_all()  # this thread's chunks of Q_{t+1} have landed
                cuda.syncthreads()  # Q_{t+1} and dSᵀ are complete; everyone is done with dO_t and Pᵀ
                if t + 1 < i_last:  # dO_{t+1} streams in during the next phase A
                    copy_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start + BLOCK_M, BLOCK_M, seqlen_q, head_dim, tid)

        # dK_j · scale and dV_j, written once.
        sc = acc_t(scale)
        for r in range(ROWS):
            key = k_start + ty + THREADS_Y * r
            if key < seqlen_k:
                for e in range(DCOLS):
                    d = d_column(tx, e)
                    if d < head_dim:
                        if ds_role:
                            dk[b, h, key, d] = to_out(dK_j[r, e] * sc)
                        if p_role:
                            dv[b, h, key, d] = to_out(dV_j[r, e])

    return flash_backward_dkdv


# ----------------------------------------------------------------------------
# Step 2: dQ_i, parallel over query tiles (deterministic: no atomics)
# ----------------------------------------------------------------------------


@functools.cache
def dq_kernel(cfg: TileConfig):
    """The compiled dQ kernel (step 2) for one configuration (cached).

    With ``cfg.async_copy`` the key tiles arrive by ``cp.async`` while the
    block computes, and ``dP = dO_i V_jᵀ`` comes before ``S = Q_i K_jᵀ``: then
    V_j is read only at the start of a tile and K_j only after it, so ``K_j``
    streams in under ``dP`` and ``V_{j+1}`` under the rest of the tile (see
    "Copies" in the module docstring).
    """
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    THREADS_X, THREADS_Y = cfg.threads_x, cfg.threads_y
    D_PAD = cfg.head_dim_pad
    ROWS = BLOCK_M // THREADS_Y  # query rows per thread
    COLS = BLOCK_N // THREADS_X  # keys per thread in S
    DCOLS = D_PAD // THREADS_X  # dQ columns per thread: d_column(tx, e)
    acc_t = numba_type(cfg.acc_kind)
    u64 = numba.uint64
    Q_OFF, DO_OFF, K_OFF, V_OFF, DS_OFF, _ = (u64(x) for x in dq_shared_offsets(cfg))
    VEC = vector_width(cfg)
    D_PITCH, DS_PITCH = u64(D_PAD + VEC), u64(BLOCK_N + VEC)
    SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte vector loads need 16-byte alignment
    ASYNC = cfg.async_copy  # tiles by cp.async (see "Copies" in the module docstring)

    load_tile = make_tile_loader(cfg)
    copy_tile = make_async_tile_loader(cfg) if ASYNC else None
    fill_tile = copy_tile if ASYNC else load_tile  # the first tiles: started (cp.async) or loaded
    to_out = make_storer(cfg.input_kind)
    block_tile = make_block_tile(cfg, reverse=True)  # the last query tiles have the most (causal) keys
    d_column = make_d_column(cfg)
    # One thread's piece of each product: S = Q_i K_jᵀ and dP = dO_i V_jᵀ, then dQ_i += dS K_j.
    mm_rows = make_mm_nt(ROWS, COLS, D_PAD, int(D_PITCH), VEC, cfg.acc_kind)
    mm_cols = make_mm_nn(ROWS, DCOLS, BLOCK_N, int(DS_PITCH), int(D_PITCH), VEC, cfg.acc_kind)

    @kernel(fastmath=cfg.acc_kind == "float32", launch_bounds=(cfg.threads, cfg.min_blocks) if cfg.min_blocks else None)
    def flash_backward_dq(q, k, v, do, lse2, delta, dq, qk_scale_log2, scale, causal):
        """One block: dQ_i for BLOCK_M queries of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        tile, h, b = block_tile()
        q_start = tile * BLOCK_M
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * THREADS_X + tx

        # One flat buffer holds Q_i, dO_i, K_j, V_j and dS at Q_OFF, DO_OFF, ...
        smem = cuda.shared.array(0, acc_t, alignment=SMEM_ALIGN)

        # Q_i and dO_i stay in shared memory; dQ_i, lse2_i and D_i in registers.
        fill_tile(smem, Q_OFF, D_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
        fill_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
        dQ_i = cuda.local.array((ROWS, DCOLS), acc_t)
        S = cuda.local.array((ROWS, COLS), acc_t)  # S, then P
        dP = cuda.local.array((ROWS, COLS), acc_t)
        lse2_i = cuda.local.array(ROWS, acc_t)
        D_i = cuda.local.array(ROWS, acc_t)
        key_end = cuda.local.array(ROWS, numba.int64)  # row r sees keys [0, key_end[r])
        query_row = cuda.local.array(ROWS, u64)  # query ty + THREADS_Y·r: a row of Q_i, dO_i, dS
        key_row = cuda.local.array(COLS, u64)  # key tx + THREADS_X·c: a row of K_j, V_j
        d_col = cuda.local.array(DCOLS, u64)  # column d_column(tx, e) of K_j and dQ_i
        for c in range(COLS):
            key_row[c] = u64(tx + THREADS_X * c)
        for e in range(DCOLS):
            d_col[e] = u64(d_column(tx, e))
        zero = acc_t(0)
        inf = acc_t(math.inf)
        scale_log2 = acc_t(qk_scale_log2)
        for r in range(ROWS):
            row = q_start + ty + THREADS_Y * r
            query_row[r] = u64(ty + THREADS_Y * r)
            key_end[r] = d_row_key_end(row, seqlen_q, seqlen_k, causal)
            lse2_i[r] = lse2[b, h, row] if row < seqlen_q else inf
            D_i[r] = delta[b, h, row] if row < seqlen_q else zero
            for e in range(DCOLS):
                dQ_i[r, e] = zero

        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        if ASYNC:
            if n_tiles > 0:
                copy_tile(smem, V_OFF, D_PITCH, v, b, h, 0, BLOCK_N, seqlen_k, head_dim, tid)
            I.cp_async_wait_all()  # this thread's chunks of Q_i, dO_i and V_0 have landed ...
            cuda.syncthreads()  # ... and everyone's, before anyone reads them
            if n_tiles > 0:  # K_0 streams in under the first dP
                copy_tile(smem, K_OFF, D_PITCH, k, b, h, 0, BLOCK_N, seqlen_k, head_dim, tid)
        for j in range(n_tiles):
            k_start = j * BLOCK_N
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = zero
                    dP[r, c] = zero
            if ASYNC:
                # dP = dO_i V_jᵀ first: V_j is here, K_j still streaming in.
                mm_rows(dP, smem, DO_OFF, query_row, V_OFF, key_row)
                I.cp_async_wait_all()  # this thread's chunks of K_j have landed
                cuda.syncthreads()  # K_j is complete, and everyone is done with V_j before V_{j+1} replaces it
                if j + 1 < n_tiles:  # V_{j+1} streams in under the rest of the tile
                    copy_tile(smem, V_OFF, D_PITCH, v, b, h, k_start + BLOCK_N, BLOCK_N, seqlen_k, head_dim, tid)
            else:
                # Load K_j and V_j.
                load_tile(smem, K_OFF, D_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
                load_tile(smem, V_OFF, D_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
                cuda.syncthreads()  # Q_i, dO_i, K_j and V_j are complete before anyone reads them

            # S = Q_i K_jᵀ ...
            mm_rows(S, smem, Q_OFF, query_row, K_OFF, key_row)
            # ... P = exp2(S · scale · log2 e − lse2_i) ...
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = math.exp2(S[r, c] * scale_log2 - lse2_i[r])
            # ... 0 where the pair is invisible (only tiles on the diagonal or a ragged end pay for this).
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                for r in range(ROWS):
                    for c in range(COLS):
                        if k_start + tx + THREADS_X * c >= key_end[r]:
                            S[r, c] = zero  # past a ragged end, or above the causal diagonal

            # dP = dO_i V_jᵀ (already done with cp.async), and dS = P ∘ (dP − D_i).
            if not ASYNC:
                mm_rows(dP, smem, DO_OFF, query_row, V_OFF, key_row)
            for r in range(ROWS):
                for c in range(COLS):
                    smem[DS_OFF + query_row[r] * DS_PITCH + key_row[c]] = S[r, c] * (dP[r, c] - D_i[r])
            syncwarp()  # a row of dS is written and read by the lanes of one warp

            # dQ_i += dS K_j.
            mm_cols(dQ_i, smem, DS_OFF, query_row, K_OFF, d_col)
            if ASYNC:
                I.cp_async_wait_all()  # this thread's chunks of V_{j+1} have landed (the barrier shows everyone's)
            cuda.syncthreads()  # everyone is done with K_j, V_j and dS before the next load (and V_{j+1} is here)
            if ASYNC and j + 1 < n_tiles:  # K_{j+1} streams in under the next dP
                copy_tile(smem, K_OFF, D_PITCH, k, b, h, k_start + BLOCK_N, BLOCK_N, seqlen_k, head_dim, tid)

        # dQ_i · scale, written once.  A row that sees no key keeps dQ_i = 0.
        sc = acc_t(scale)
        for r in range(ROWS):
            row = q_start + ty + THREADS_Y * r
            if row < seqlen_q:
                for e in range(DCOLS):
                    d = d_column(tx, e)
                    if d < head_dim:
                        dq[b, h, row, d] = to_out(dQ_i[r, e] * sc)

    return flash_backward_dq


@functools.cache
def dq_convert_kernel(cfg: TileConfig):
    """The compiled step 2' kernel: ``dq = accumulator · scale`` in the output type (cached)."""
    BLOCK_M = cfg.block_m
    THREADS_X, THREADS_Y = cfg.threads_x, cfg.threads_y
    ROWS = BLOCK_M // THREADS_Y
    acc_t = numba_type(cfg.acc_kind)
    to_out = make_storer(cfg.input_kind)

    @kernel(fastmath=cfg.acc_kind == "float32")
    def flash_backward_dq_convert(dq_accum, dq, scale):
        """One block: BLOCK_M rows of dq for one (batch, head)."""
        seqlen_q = dq.shape[2]
        head_dim = dq.shape[3]
        q_start = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        sc = acc_t(scale)
        for r in range(ROWS):
            row = q_start + cuda.threadIdx.y + THREADS_Y * r
            if row < seqlen_q:
                for d in range(cuda.threadIdx.x, head_dim, THREADS_X):
                    dq[b, h, row, d] = to_out(dq_accum[b, h, row, d] * sc)

    return flash_backward_dq_convert


@functools.cache
def dq_convert_wide_kernel(input_kind: str):
    """Step 2' for 16-bit outputs with a head dim that is a multiple of 8, by 16-byte loads and stores (cached).

    One thread per 8-column chunk of a row, chunks of a row on consecutive threads: two ``ld.global.v4.f32``
    of the float32 accumulator (whose rows are nbflash's scratch, whole 16-byte chunks), eight products with
    the scale, four packs to 16-bit pairs (:func:`~nbflash.intrinsics.pack_f16x2` / ``pack_bf16x2``: round to
    nearest even) and one ``st.global.v4`` — or, where a row of ``dq`` is not contiguous and 16-byte aligned,
    eight element stores.
    """
    THREADS, BLOCK_M = WIDE_THREADS, WIDE_ROWS
    pack = I.pack_bf16x2 if input_kind == "bfloat16" else I.pack_f16x2
    to_out = make_storer(input_kind)

    @kernel(fastmath=True)
    def flash_backward_dq_convert_wide(dq_accum, dq, scale):
        """One block: BLOCK_M rows of dq for one (batch, head)."""
        seqlen_q = dq.shape[2]
        chunks = dq.shape[3] // 8
        q_start = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        sc = numba.float32(scale)
        unit = dq.strides[3] == 2
        for j in range(cuda.threadIdx.x, BLOCK_M * chunks, THREADS):
            row = q_start + j // chunks
            col = 8 * (j % chunks)
            if row < seqlen_q:
                acc = I.global_address(dq_accum, (b, h, row, col))
                x0, x1, x2, x3 = I.ld_global_v4_f32(acc)
                x4, x5, x6, x7 = I.ld_global_v4_f32(acc + 16)
                out = I.global_address(dq, (b, h, row, col))
                if unit and (out & 15) == 0:
                    I.st_global_v4_b32(out, pack(x0 * sc, x1 * sc), pack(x2 * sc, x3 * sc), pack(x4 * sc, x5 * sc),
                                       pack(x6 * sc, x7 * sc))
                else:
                    dq[b, h, row, col] = to_out(x0 * sc)
                    dq[b, h, row, col + 1] = to_out(x1 * sc)
                    dq[b, h, row, col + 2] = to_out(x2 * sc)
                    dq[b, h, row, col + 3] = to_out(x3 * sc)
                    dq[b, h, row, col + 4] = to_out(x4 * sc)
                    dq[b, h, row, col + 5] = to_out(x5 * sc)
                    dq[b, h, row, col + 6] = to_out(x6 * sc)
                    dq[b, h, row, col + 7] = to_out(x7 * sc)

    return flash_backward_dq_convert_wide


# ----------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------


def _rows_kernel(tile: TileConfig, head_dim: int, wide, tiled):
    """``(kernel, rows per block, block)`` of step 0 or 2': ``wide(input_kind)`` where :func:`takes_wide_rows`,
    else ``tiled(tile)``."""
    if takes_wide_rows(tile.input_kind, head_dim):
        return wide(tile.input_kind), WIDE_ROWS, (WIDE_THREADS, 1, 1)
    return tiled(tile), tile.block_m, (tile.threads_x, tile.threads_y, 1)


def launch_preprocess(tile: TileConfig, o, do, lse, delta, lse2, dq_accum, clear_dq: bool, stream, rows=None):
    """Step 0 for every backward: :func:`preprocess_wide_kernel` where :func:`takes_wide_rows`, else the tile
    kernel of ``tile`` (the :func:`_steps_0_and_2p` tile of the backward's dQ configuration).  ``rows``: the
    rows to cover (default: the queries; an accumulator with padding rows passes its own count)."""
    batch, heads, seqlen_q, head_dim = o.shape
    rows = seqlen_q if rows is None else rows
    kern, block_m, block = _rows_kernel(tile, head_dim, preprocess_wide_kernel, preprocess_kernel)
    launch(kern, (-(-rows // block_m), heads, batch), block, stream, 0, o, do, lse, delta, lse2, dq_accum,
           bool(clear_dq))


def launch_dq_convert(tile: TileConfig, dq_accum, dq, scale: float, stream):
    """Step 2' of a row-major accumulator (``dq_accum[b, h, row, col]``): :func:`dq_convert_wide_kernel` where
    :func:`takes_wide_rows`, else the tile kernel of ``tile``."""
    batch, heads, seqlen_q, head_dim = dq.shape
    kern, block_m, block = _rows_kernel(tile, head_dim, dq_convert_wide_kernel, dq_convert_kernel)
    launch(kern, (-(-seqlen_q // block_m), heads, batch), block, stream, 0, dq_accum, dq, float(scale))


def launch_backward(
    cfg: BackwardConfig,
    q,
    k,
    v,
    o,
    do,
    lse,
    dq,
    dk,
    dv,
    scale: float,
    causal: bool,
    deterministic: bool = True,
    stream=0,
    empty=None,
):
    """Run steps 0–2 on canonical ``(B, H, N, D)`` views, writing ``dq, dk, dv`` (no checks here).

    ``deterministic=True``: dQ by its own query-parallel kernel (step 2), the
    same bits on every run.  ``False``: dQ by atomics inside the dK/dV kernel
    (step 1e) and a convert kernel (step 2').  ``empty(shape, dtype)``
    allocates the scratch (default: the array module of ``q``); bridges that
    pass kernel argument descriptors give their own.
    """
    ok, why = can_implement(cfg)
    if ok and (cfg.dkdv.async_copy or cfg.dq.async_copy):
        ok, why = async_copy_ok(cfg.dkdv, q, k, v, o, do, names=COPIED)
    if not ok:
        raise ValueError(f"backward configuration {cfg} cannot run: {why}")
    if empty is None:  # scratch from the inputs' array module
        empty = array_module(q).empty
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    acc_dtype = np.float64 if cfg.dq.acc_kind == "float64" else np.float32
    delta = empty((batch, heads, seqlen_q), acc_dtype)
    lse2 = empty((batch, heads, seqlen_q), acc_dtype)
    if deterministic:
        dq_accum = empty((1, 1, 1, 1), acc_dtype)  # unused
    else:  # rows of head_dim_pad columns, so that step 1e may add 16-byte runs (cleared by step 0)
        dq_accum = empty((batch, heads, seqlen_q, cfg.dkdv.head_dim_pad), acc_dtype)
    qk_scale_log2 = float(scale * LOG2E)
    kv, dq_cfg = cfg.dkdv, cfg.dq
    plain = _steps_0_and_2p(dq_cfg)
    q_tiles = -(-seqlen_q // dq_cfg.block_m)
    dq_grid = grid_shape(dq_cfg, q_tiles, heads, batch)  # step 2
    k_grid = grid_shape(kv, -(-seqlen_k // kv.block_n), heads, batch)
    kv_block, q_block = (kv.threads_x, kv.threads_y, kv.groups), (dq_cfg.threads_x, dq_cfg.threads_y, 1)
    sc = float(scale)
    launch_preprocess(plain, o, do, lse, delta, lse2, dq_accum, not deterministic, stream)
    launch(
        dkdv_kernel(kv, not deterministic),
        k_grid,
        kv_block,
        stream,
        dkdv_shared_bytes(kv),
        *(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, sc, bool(causal)),
    )
    if deterministic:
        launch(
            dq_kernel(dq_cfg),
            dq_grid,
            q_block,
            stream,
            dq_shared_bytes(dq_cfg),
            *(q, k, v, do, lse2, delta, dq, qk_scale_log2, sc, bool(causal)),
        )
    else:
        launch_dq_convert(plain, dq_accum, dq, sc, stream)


# ----------------------------------------------------------------------------
# Every configuration, for the offline compile checks
# ----------------------------------------------------------------------------


def api_configs() -> list[BackwardConfig]:
    """Every configuration the API can pick on a GPU (head dims 1..256, every input kind): those of
    :func:`choose_config` and, for float32 at head dims that are multiples of 4, :func:`with_copies`'s."""
    seen = {}
    for kind in INPUT_KINDS:
        for head_dim in range(1, MAX_HEAD_DIM + 1):
            cfg = choose_config(head_dim, kind, simulator=False)
            seen[cfg] = None
            if kind == "float32" and head_dim % 4 == 0:
                copies = async_variant(cfg)
                if dkdv_shared_bytes(copies.dkdv) <= _shared_limit():
                    seen[copies] = None
    return list(seen)


def kernel_signature(name: str, cfg: TileConfig) -> tuple:
    """Numba argument types of backward kernel ``name`` for ``cfg`` (any strides: layout 'A')."""
    types = numba.types
    elem = {"float16": types.float16, "bfloat16": types.uint16, "float32": types.float32, "float64": types.float64}
    x4 = types.Array(elem[cfg.input_kind], 4, "A")  # q, k, v, o, do, dq, dk, dv
    acc = numba_type(cfg.acc_kind)
    a3, a4 = types.Array(acc, 3, "A"), types.Array(acc, 4, "A")  # lse, delta, lse2; the dQ accumulator
    f64, flag = types.float64, types.boolean
    return {
        "preprocess": (x4, x4, a3, a3, a3, a4, flag),
        "dkdv": (x4, x4, x4, x4, a3, a3, x4, x4, a4, f64, f64, flag),
        "dkdv_atomic": (x4, x4, x4, x4, a3, a3, x4, x4, a4, f64, f64, flag),
        "dq": (x4, x4, x4, x4, a3, a3, x4, f64, f64, flag),
        "dq_convert": (a4, x4, f64),
        "preprocess_wide": (x4, x4, a3, a3, a3, a4, flag),
        "dq_convert_wide": (a4, x4, f64),
    }[name]


def _kernel(name: str, tile: TileConfig):
    """Backward kernel ``name`` (as in :func:`kernel_signature`) for ``tile``."""
    if name.startswith("dkdv"):
        return dkdv_kernel(tile, name == "dkdv_atomic")
    if name.endswith("_wide"):  # steps 0 and 2' by 16-byte accesses: one kernel per input kind
        return {"preprocess_wide": preprocess_wide_kernel, "dq_convert_wide": dq_convert_wide_kernel}[name](
            tile.input_kind)
    return {"preprocess": preprocess_kernel, "dq": dq_kernel, "dq_convert": dq_convert_kernel}[name](tile)


def compile_targets(configs=None) -> list[tuple]:
    """``(name, tile, kernel, signature, fastmath)`` for every backward kernel the API can launch.

    ``configs``: the :class:`BackwardConfig` objects to cover (default: :func:`api_configs`).
    Used by the offline PTX checks.
    """
    targets = {}
    for cfg in api_configs() if configs is None else configs:
        plain = _steps_0_and_2p(cfg.dq)  # as launch_backward runs them
        for name, tile in (
            ("preprocess", plain),
            ("dkdv", cfg.dkdv),
            ("dkdv_atomic", cfg.dkdv),
            ("dq", cfg.dq),
            ("dq_convert", plain),
        ):
            targets[name, tile] = None
        if plain.input_kind in ("float16", "bfloat16"):  # head dims that are multiples of 8 take these instead
            for name in ("preprocess_wide", "dq_convert_wide"):
                if not any(n == name and t.input_kind == plain.input_kind for n, t in targets):
                    targets[name, plain] = None
    return [
        (f"flash_backward_{name}", tile, _kernel(name, tile), kernel_signature(name, tile), tile.acc_kind == "float32")
        for name, tile in targets
    ]


__all__ = [
    "COPIED",
    "BackwardConfig",
    "api_configs",
    "async_variant",
    "can_implement",
    "compile_targets",
    "choose_config",
    "dkdv_kernel",
    "dkdv_shared_bytes",
    "dkdv_shared_offsets",
    "dq_convert_kernel",
    "dq_convert_wide_kernel",
    "dq_kernel",
    "dq_shared_bytes",
    "dq_shared_offsets",
    "kernel_signature",
    "launch_backward",
    "launch_dq_convert",
    "launch_preprocess",
    "preprocess_kernel",
    "preprocess_wide_kernel",
    "takes_wide_rows",
    "with_copies",
]
