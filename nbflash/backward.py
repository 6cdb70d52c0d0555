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
   cleared here too (same grid, same stream).

1. **dK, dV** (grid: key tiles × heads × batch — parallel over keys, so every
   block owns its ``dK_j, dV_j`` and nothing is shared between blocks).  Load
   ``K_j, V_j`` into shared memory; ``dK_j = dV_j = 0`` in registers.  For every
   query tile ``i`` that sees some key of the tile (causal tiles with no visible
   pair are skipped, see :func:`nbflash.masking.query_range`):

   a. load ``Q_i, dO_i`` into shared memory, and ``lse2_i, D_i`` into registers;
   b. ``Sᵀ = K_j Q_iᵀ`` and ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_i)``, with
      invisible pairs set to 0 (each thread a ``ROWS × COLS`` piece: keys are
      rows, queries columns);
   c. ``dPᵀ = V_j dO_iᵀ`` and ``dSᵀ = Pᵀ ∘ (dPᵀ − D_i)``;
   d. ``dV_j += Pᵀ dO_i`` and ``dK_j += dSᵀ Q_i`` (``Pᵀ`` and ``dSᵀ`` go
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
   ``dP = dO_i V_jᵀ``; ``dS = P ∘ (dP − D_i)``; ``dQ_i += dS K_j``.  Write
   ``dQ_i · scale``.  ``S``, ``P`` and ``dP`` are computed twice in total
   (once per kernel): the price of needing no atomics and no N×N storage.

2'. **Convert**, atomic variant: ``dq = accumulator · scale`` in the caller's
   dtype and layout.

Exponentials are base 2 with the scale folded in, as in the forward.  Inputs
float16/bfloat16/float32 accumulate in float32; float64 in float64.
Constraints: any ``N_q, N_k ≥ 1`` (they may differ; causal is bottom-right
aligned); ``D ≤ 256``, padded inside to a multiple of ``THREADS_X``.  Shared
memory per block: :func:`dkdv_shared_bytes` and :func:`dq_shared_bytes`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ._device import (
    SIMULATOR,
    cuda,
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
    d_chunk,
    grid_shape,
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


def dkdv_shared_offsets(cfg: TileConfig) -> tuple[int, int, int, int, int, int, int]:
    """Offsets (elements) of K_j, V_j, Q_i, dO_i, Pᵀ and dSᵀ in the dK/dV kernel's shared buffer, and its end.

    Pitches: every tile is read 16 bytes at a time along rows that belong to
    different threads (K_j, V_j, Q_i, dO_i in steps 1b/1c, Pᵀ and dSᵀ in
    1d), so each row gets one spare vector: neighbouring rows then start in
    different banks, and every row stays 16-byte aligned.
    """
    vec = vector_width(cfg)
    d_pitch = cfg.head_dim_pad + vec
    p_pitch = cfg.block_m + vec
    k_off = 0
    v_off = k_off + cfg.block_n * d_pitch  # K_j: BLOCK_N keys
    q_off = v_off + cfg.block_n * d_pitch  # V_j: BLOCK_N keys
    do_off = q_off + cfg.block_m * d_pitch  # Q_i: BLOCK_M queries
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
    on the H200 (``benchmarks/fp32_candidates.py``); the others were not tuned.
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
    return True, ""


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
                if clear_dq:  # every column of the accumulator, padding included
                    for d in range(tx, dq_accum.shape[3], THREADS_X):
                        dq_accum[b, h, row, d] = zero
            D_i = row_sum(part)  # every lane of the row takes part in the shuffles
            if tx == 0 and row < seqlen_q:
                delta[b, h, row] = D_i
                lse_i = acc_t(lse[b, h, row])
                # +inf for a row that saw no key: then exp2(S − lse2) = 0, not NaN.
                lse2[b, h, row] = lse_i * acc_t(LOG2E) if lse_i != -inf else inf

    return flash_backward_preprocess


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
    # Step 1e adds 16 bytes at once where a thread's dQ columns come in runs of 4 floats.
    RED4 = cfg.acc_kind == "float32" and d_chunk(cfg, DQCOLS) % 4 == 0
    acc_t = numba_type(cfg.acc_kind)
    u64 = numba.uint64
    K_OFF, V_OFF, Q_OFF, DO_OFF, P_OFF, DS_OFF, _ = (u64(x) for x in dkdv_shared_offsets(cfg))
    VEC = vector_width(cfg)
    D_PITCH, P_PITCH = u64(D_PAD + VEC), u64(BLOCK_M + VEC)
    BLOCK_N_U = u64(BLOCK_N)
    SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte vector loads need 16-byte alignment

    load_tile = make_tile_loader(cfg)
    to_out = make_storer(cfg.input_kind)
    block_tile = make_block_tile(cfg)  # the first key tiles have the most (causal) queries: they start first
    d_column = make_d_column(cfg)
    dq_column = make_d_column(cfg, DQCOLS)
    # One thread's piece of each product: Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ (rows · rows over D),
    # dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i (rows of Pᵀ, dSᵀ times columns of dO_i, Q_i).
    mm_rows = make_mm_nt(ROWS, COLS, D_PAD, int(D_PITCH), VEC, cfg.acc_kind)
    mm_cols = make_mm_nn(ROWS, DCOLS, BLOCK_M, int(P_PITCH), int(D_PITCH), VEC, cfg.acc_kind)

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
        load_tile(smem, K_OFF, D_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
        load_tile(smem, V_OFF, D_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
        # With two groups a thread holds one accumulator and one score tile: the
        # names below then share their registers (dV_j is dK_j, S is dP).
        dV_j = cuda.local.array((ROWS, DCOLS), acc_t)
        dK_j = cuda.local.array((ROWS, DCOLS), acc_t) if GROUPS == 1 else dV_j
        S = cuda.local.array((ROWS, COLS), acc_t)  # Sᵀ, then Pᵀ
        dP = cuda.local.array((ROWS, COLS), acc_t) if GROUPS == 1 else S  # dPᵀ
        lse2_i = cuda.local.array(COLS, acc_t)  # of this thread's query columns
        D_i = cuda.local.array(COLS, acc_t)
        key_end = cuda.local.array(COLS, numba.int64)  # column c sees keys [0, key_end[c])
        dQ_part = cuda.local.array((QROWS, DQCOLS), acc_t)
        ds_m = cuda.local.array(QROWS, acc_t)  # a column of dSᵀ (step 1e)
        k_e = cuda.local.array(DQCOLS, acc_t)  # a row of K_j (step 1e)
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
        inf = acc_t(math.inf)
        scale_log2 = acc_t(qk_scale_log2)
        for r in range(ROWS):
            for e in range(DCOLS):
                dK_j[r, e] = zero
                dV_j[r, e] = zero

        q_begin, q_end = d_query_range(k_start, BLOCK_N, seqlen_q, seqlen_k, causal)
        for i in range(q_begin // BLOCK_M, (q_end + BLOCK_M - 1) // BLOCK_M):
            q_start = i * BLOCK_M
            # Step 1a: stream Q_i and dO_i through shared memory; lse2_i, D_i to registers.
            load_tile(smem, Q_OFF, D_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
            load_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
            for c in range(COLS):
                col = q_start + tx + THREADS_X * c
                key_end[c] = d_row_key_end(col, seqlen_q, seqlen_k, causal)
                lse2_i[c] = lse2[b, h, col] if col < seqlen_q else inf
                D_i[c] = delta[b, h, col] if col < seqlen_q else zero
            cuda.syncthreads()  # Q_i, dO_i (and, the first time, K_j, V_j) are complete before anyone reads them

            # Step 1b: Sᵀ = K_j Q_iᵀ, this thread's ROWS × COLS piece (step 1c's dPᵀ = V_j dO_iᵀ with two
            # groups: group 1 computes it here, into the same registers, in the same instructions).
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = zero
            mm_rows(S, smem, sk_off, key_row, sq_off, query_row)
            if p_role:
                # ... Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_i) ...
                for r in range(ROWS):
                    for c in range(COLS):
                        S[r, c] = math.exp2(S[r, c] * scale_log2 - lse2_i[c])
                # ... 0 where the pair is invisible (only tiles on the diagonal or a ragged end pay for this).
                if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                    for r in range(ROWS):
                        key = k_start + ty + THREADS_Y * r
                        for c in range(COLS):
                            if key >= key_end[c]:
                                S[r, c] = zero  # past a ragged end, or above the causal diagonal
                for r in range(ROWS):
                    for c in range(COLS):
                        smem[P_OFF + key_row[r] * P_PITCH + query_row[c]] = S[r, c]

            # Step 1c: dPᵀ = V_j dO_iᵀ (one group), and dSᵀ = Pᵀ ∘ (dPᵀ − D_i).
            if GROUPS == 1:
                for r in range(ROWS):
                    for c in range(COLS):
                        dP[r, c] = zero
                mm_rows(dP, smem, V_OFF, key_row, DO_OFF, query_row)
            else:
                cuda.syncthreads()  # Pᵀ, written by group 0, is complete
            if ds_role:
                for r in range(ROWS):
                    for c in range(COLS):
                        p = S[r, c] if GROUPS == 1 else smem[P_OFF + key_row[r] * P_PITCH + query_row[c]]
                        smem[DS_OFF + key_row[r] * P_PITCH + query_row[c]] = p * (dP[r, c] - D_i[c])
            if ATOMIC_DQ:
                cuda.syncthreads()  # step 1e reads whole columns of dSᵀ, written by every warp
            else:
                syncwarp()  # a row of Pᵀ and of dSᵀ is written and read by the lanes of one warp

            # Step 1d: dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i (with two groups: group 0 the first,
            # group 1 the second, in the same instructions).
            mm_cols(dV_j, smem, pd_off, key_row, dq_off, d_col)
            if GROUPS == 1:
                mm_cols(dK_j, smem, DS_OFF, key_row, Q_OFF, d_col)

            if ATOMIC_DQ:
                # Step 1e: dQ_i += dS K_j; here a thread owns query rows ty·QROWS + r and
                # (with two groups) columns in its group's half of the head dim.
                for r in range(QROWS):
                    for e in range(DQCOLS):
                        dQ_part[r, e] = zero
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
            cuda.syncthreads()  # everyone is done with Q_i, dO_i, Pᵀ and dSᵀ before the next load

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
    """The compiled dQ kernel (step 2) for one configuration (cached)."""
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

    load_tile = make_tile_loader(cfg)
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
        load_tile(smem, Q_OFF, D_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
        load_tile(smem, DO_OFF, D_PITCH, do, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
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
        for j in range((k_end + BLOCK_N - 1) // BLOCK_N):
            k_start = j * BLOCK_N
            # Load K_j and V_j.
            load_tile(smem, K_OFF, D_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
            load_tile(smem, V_OFF, D_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
            cuda.syncthreads()  # Q_i, dO_i, K_j and V_j are complete before anyone reads them

            # S = Q_i K_jᵀ ...
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = zero
                    dP[r, c] = zero
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

            # dP = dO_i V_jᵀ, and dS = P ∘ (dP − D_i).
            mm_rows(dP, smem, DO_OFF, query_row, V_OFF, key_row)
            for r in range(ROWS):
                for c in range(COLS):
                    smem[DS_OFF + query_row[r] * DS_PITCH + key_row[c]] = S[r, c] * (dP[r, c] - D_i[r])
            syncwarp()  # a row of dS is written and read by the lanes of one warp

            # dQ_i += dS K_j.
            mm_cols(dQ_i, smem, DS_OFF, query_row, K_OFF, d_col)
            cuda.syncthreads()  # everyone is done with K_j, V_j and dS before the next load

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


# ----------------------------------------------------------------------------
# Launching
# ----------------------------------------------------------------------------


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
    q_tiles = -(-seqlen_q // dq_cfg.block_m)
    q_grid = (q_tiles, heads, batch)  # steps 0 and 2'
    dq_grid = grid_shape(dq_cfg, q_tiles, heads, batch)  # step 2
    k_grid = grid_shape(kv, -(-seqlen_k // kv.block_n), heads, batch)
    kv_block, q_block = (kv.threads_x, kv.threads_y, kv.groups), (dq_cfg.threads_x, dq_cfg.threads_y, 1)
    sc = float(scale)
    launch(preprocess_kernel(dq_cfg), q_grid, q_block, stream, 0, o, do, lse, delta, lse2, dq_accum, not deterministic)
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
        launch(dq_convert_kernel(dq_cfg), q_grid, q_block, stream, 0, dq_accum, dq, sc)


# ----------------------------------------------------------------------------
# Every configuration, for the offline compile checks
# ----------------------------------------------------------------------------


def api_configs() -> list[BackwardConfig]:
    """Every configuration :func:`choose_config` can pick on a GPU (head dims 1..256, every input kind)."""
    seen = {}
    for kind in INPUT_KINDS:
        for head_dim in range(1, MAX_HEAD_DIM + 1):
            seen[choose_config(head_dim, kind, simulator=False)] = None
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
    }[name]


def _kernel(name: str, tile: TileConfig):
    """Backward kernel ``name`` (as in :func:`kernel_signature`) for ``tile``."""
    if name.startswith("dkdv"):
        return dkdv_kernel(tile, name == "dkdv_atomic")
    return {"preprocess": preprocess_kernel, "dq": dq_kernel, "dq_convert": dq_convert_kernel}[name](tile)


def compile_targets(configs=None) -> list[tuple]:
    """``(name, tile, kernel, signature, fastmath)`` for every backward kernel the API can launch.

    ``configs``: the :class:`BackwardConfig` objects to cover (default: :func:`api_configs`).
    Used by the offline PTX checks.
    """
    targets = {}
    for cfg in api_configs() if configs is None else configs:
        for name, tile in (
            ("preprocess", cfg.dq),
            ("dkdv", cfg.dkdv),
            ("dkdv_atomic", cfg.dkdv),
            ("dq", cfg.dq),
            ("dq_convert", cfg.dq),
        ):
            targets[name, tile] = None
    return [
        (f"flash_backward_{name}", tile, _kernel(name, tile), kernel_signature(name, tile), tile.acc_kind == "float32")
        for name, tile in targets
    ]


__all__ = [
    "BackwardConfig",
    "api_configs",
    "can_implement",
    "compile_targets",
    "choose_config",
    "dkdv_kernel",
    "dkdv_shared_bytes",
    "dkdv_shared_offsets",
    "dq_convert_kernel",
    "dq_kernel",
    "dq_shared_bytes",
    "dq_shared_offsets",
    "kernel_signature",
    "launch_backward",
    "preprocess_kernel",
]
