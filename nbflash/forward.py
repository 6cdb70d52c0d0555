"""The fused FlashAttention forward pass: one SIMT kernel, exact softmax, linear memory.

Shapes (inside the kernel every tensor is indexed ``[batch, head, row, d]``;
the ``bshd`` layout reaches it as a strided view, never a copy)::

    q   (B, H, N_q, D)      k, v  (B, H, N_k, D)
    o   (B, H, N_q, D)      lse   (B, H, N_q)        lse_i = log sum_j exp(S_ij)

Grid: one block per (query tile, head, batch) — FlashAttention-2's parallelism
over the sequence; the last query tiles (the longest causal rows) start first,
and with ``longest_first`` those of every head before any shorter tile
(:func:`nbflash._tiles.grid_shape`).  Each block computes ``O_i`` for
``BLOCK_M`` queries:

1. Load ``Q_i`` into shared memory; it stays there for the whole loop.  Set the
   running max ``m_i = -inf``, running sum ``l_i = 0`` and accumulator
   ``acc = 0`` (registers: local arrays indexed only by compile-time constants).
2. For each key tile ``j`` that some query of the tile can see (causal tiles
   entirely above the diagonal are skipped — see :mod:`nbflash.masking`):

   a. load ``K_j`` and ``V_j`` into shared memory (with ``async_copy``:
      ``V_j`` streams in by ``cp.async`` while steps b–c run, and ``K_{j+1}``
      while step d runs — see "Copies" below);
   b. ``S = Q_i K_jᵀ · scale`` in registers, each thread a ``ROWS × COLS``
      piece; invisible pairs (ragged end, causal diagonal) get ``-inf`` — only
      tiles that straddle the diagonal or a ragged end run this test;
   c. online softmax: ``m_new = max(m_i, rowmax(S))``,
      ``P = exp(S - m_new)``, ``alpha = exp(m_i - m_new)``,
      ``l_i = alpha · l_i + rowsum(P)``, ``acc = alpha · acc``, ``m_i = m_new``;
   d. ``acc += P V_j`` (``P`` goes through shared memory, one row per warp).

3. ``O_i = acc / l_i`` and ``lse_i = m_i + log(l_i)``, written once.  A row
   that saw no key keeps ``l_i = 0`` and gets ``O_i = 0``, ``lse_i = -inf``.

``S`` and ``P`` never leave the chip.  Exponentials are taken base 2 with the
scale folded in (``exp(x) = exp2(x · log2 e)``), the usual FlashAttention trick.

Copies.  By default each tile is loaded by plain loads (converted to the
accumulator type on the way) before a barrier, and the block waits for them.
For float32 inputs whose rows are 16-byte aligned (:func:`async_copy_ok`)
the API sets ``async_copy``: ``cp.async`` moves 16-byte chunks straight to
shared memory in the background, on this schedule (one K and one V buffer)::

    prologue   copy Q_i, K_0 ─ wait ─ barrier
    tile j     copy V_j ┐ S = Q_i K_jᵀ, softmax ─ wait ─ barrier ─ copy K_{j+1} ┐ acc += P V_j ─ wait ─ barrier
                        └── in flight ──────────┘                              └── in flight ──┘

Constraints: any ``N_q, N_k ≥ 1``; ``D ≤ 256`` (padded inside to a multiple of
``THREADS_X``); inputs float16/bfloat16/float32 accumulate in float32, float64
in float64.  Shared memory per block is given by :func:`shared_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from . import intrinsics as I
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
    LN2,
    LOG2E,
    TileConfig,
    async_copy_ok,
    grid_shape,
    make_async_tile_loader,
    make_block_tile,
    make_d_column,
    make_mm_nn,
    make_mm_nt,
    make_row_reducers,
    make_storer,
    make_tile_loader,
    numba_type,
    pad_head_dim,
    vector_width,
)
from ._validate import array_module
from .masking import d_key_range, d_row_key_end, d_tile_needs_mask


def pitches(cfg: TileConfig) -> tuple[int, int, int, int]:
    """Row pitches (elements) of the shared tiles Q_i, K_j, V_j and P.

    Threads read these tiles 16 bytes at a time.  Q_i, K_j and P are read
    along rows owned by different threads; one extra 16-byte vector per row
    puts those rows in different banks.  V_j is read along a row by
    consecutive lanes, which is conflict-free without padding.
    """
    vec = vector_width(cfg)
    d = cfg.head_dim_pad
    return d + vec, d + vec, d, cfg.block_n + vec


def shared_offsets(cfg: TileConfig) -> tuple[int, int, int, int, int]:
    """Offsets (elements) of Q_i, K_j, V_j and P in the shared buffer, and its end."""
    q_pitch, k_pitch, v_pitch, p_pitch = pitches(cfg)
    q_off = 0
    k_off = q_off + cfg.block_m * q_pitch  # Q_i: BLOCK_M rows
    v_off = k_off + cfg.block_n * k_pitch  # K_j: BLOCK_N rows
    p_off = v_off + cfg.block_n * v_pitch  # V_j: BLOCK_N rows
    end = p_off + cfg.block_m * p_pitch  # P: BLOCK_M rows
    return q_off, k_off, v_off, p_off, end


def shared_bytes(cfg: TileConfig) -> int:
    """Dynamic shared memory of one block of the forward kernel."""
    return shared_offsets(cfg)[-1] * cfg.acc_itemsize


@functools.cache
def forward_kernel(cfg: TileConfig):
    """The compiled forward kernel for one configuration (cached)."""
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    THREADS_X, THREADS_Y = cfg.threads_x, cfg.threads_y
    D_PAD = cfg.head_dim_pad
    ROWS = BLOCK_M // THREADS_Y  # query rows per thread
    COLS = BLOCK_N // THREADS_X  # keys per thread in S
    DCOLS = D_PAD // THREADS_X  # output columns per thread: d_column(tx, e), e < DCOLS
    TRACE = cfg.trace
    acc_t = numba_type(cfg.acc_kind)
    Q_PITCH, K_PITCH, V_PITCH, P_PITCH = pitches(cfg)
    u64 = numba.uint64
    Q_OFF, K_OFF, V_OFF, P_OFF = (u64(x) for x in shared_offsets(cfg)[:4])
    NEG_INF = -math.inf
    VEC = vector_width(cfg)
    SMEM_ALIGN = None if SIMULATOR else 16  # 16-byte vector loads need 16-byte alignment
    P_PITCH_U = u64(P_PITCH)
    assert Q_PITCH == K_PITCH

    load_tile = make_tile_loader(cfg)
    ASYNC = cfg.async_copy
    copy_tile = make_async_tile_loader(cfg) if ASYNC else None
    fill_tile = copy_tile if ASYNC else load_tile  # Q_i: started (cp.async, waited for below) or loaded
    # The two products, one thread's piece each: S = Q_i K_jᵀ and acc += P V_j.
    mm_qk = make_mm_nt(ROWS, COLS, D_PAD, Q_PITCH, VEC, cfg.acc_kind)
    mm_pv = make_mm_nn(ROWS, DCOLS, BLOCK_N, P_PITCH, V_PITCH, VEC, cfg.acc_kind)
    to_out = make_storer(cfg.input_kind)
    row_max, row_sum = make_row_reducers(THREADS_X)
    block_tile = make_block_tile(cfg, reverse=True)
    d_column = make_d_column(cfg)

    @kernel(fastmath=cfg.acc_kind == "float32", launch_bounds=(cfg.threads, cfg.min_blocks) if cfg.min_blocks else None)
    def flash_forward(q, k, v, o, lse, qk_scale_log2, causal, trace):
        """One block: O_i and lse_i for BLOCK_M queries of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        # Longest causal rows first: the last query tiles have the most keys.
        tile, h, b = block_tile()
        q_start = tile * BLOCK_M
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * THREADS_X + tx

        # One flat buffer holds the tiles Q_i, K_j, V_j and P at the offsets
        # Q_OFF, K_OFF, V_OFF, P_OFF (indexing it directly, rather than through
        # slices, lets the compiler prove the alignment of 16-byte loads).
        smem = cuda.shared.array(0, acc_t, alignment=SMEM_ALIGN)

        # Step 1: Q_i stays in shared memory; m_i, l_i, acc in registers.
        fill_tile(smem, Q_OFF, Q_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
        m_i = cuda.local.array(ROWS, acc_t)
        l_i = cuda.local.array(ROWS, acc_t)  # this lane's share of the row sum
        acc = cuda.local.array((ROWS, DCOLS), acc_t)
        S = cuda.local.array((ROWS, COLS), acc_t)
        m_tile = cuda.local.array(ROWS, acc_t)
        m_ref = cuda.local.array(ROWS, acc_t)
        alpha = cuda.local.array(ROWS, acc_t)
        key_end = cuda.local.array(ROWS, numba.int64)  # row r sees keys [0, key_end[r])
        # This thread's rows and columns, as unsigned shared-memory indices
        # (Numba adds a negative-index wraparound to every signed index, which
        # would cost more instructions than the FMAs it feeds).
        q_row = cuda.local.array(ROWS, u64)  # query ty + THREADS_Y·r: a row of Q_i and of P
        k_row = cuda.local.array(COLS, u64)  # key tx + THREADS_X·c: a row of K_j, a column of P
        d_col = cuda.local.array(DCOLS, u64)  # column d_column(tx, e) of V_j (and of O)
        for r in range(ROWS):
            q_row[r] = u64(ty + THREADS_Y * r)
        for c in range(COLS):
            k_row[c] = u64(tx + THREADS_X * c)
        for e in range(DCOLS):
            d_col[e] = u64(d_column(tx, e))
        zero = acc_t(0)
        neg_inf = acc_t(NEG_INF)  # typed: a Python float would turn the softmax into float64 arithmetic
        scale_log2 = acc_t(qk_scale_log2)
        for r in range(ROWS):
            m_i[r] = neg_inf
            l_i[r] = zero
            key_end[r] = d_row_key_end(q_start + ty + THREADS_Y * r, seqlen_q, seqlen_k, causal)
            for e in range(DCOLS):
                acc[r, e] = zero

        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        if ASYNC:
            if n_tiles > 0:
                copy_tile(smem, K_OFF, K_PITCH, k, b, h, 0, BLOCK_N, seqlen_k, head_dim, tid)
            I.cp_async_wait_all()  # this thread's chunks of Q_i and K_0 have landed ...
            cuda.syncthreads()  # ... and everyone's, before anyone reads them
        for j in range(n_tiles):
            k_start = j * BLOCK_N
            # Step 2a: stream K_j and V_j through shared memory.
            if ASYNC:
                # K_j is already here; V_j streams in while S = Q_i K_jᵀ is computed (the barrier that
                # closed the previous tile freed its buffer).
                copy_tile(smem, V_OFF, V_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
            else:
                load_tile(smem, K_OFF, K_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
                load_tile(smem, V_OFF, V_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
                cuda.syncthreads()  # Q_i, K_j and V_j are complete before anyone reads them

            # Step 2b: S = Q_i K_jᵀ, this thread's ROWS × COLS piece.
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = zero
            mm_qk(S, smem, Q_OFF, q_row, K_OFF, k_row)

            # Step 2c: online softmax, in base 2 (scores scaled by scale·log2 e).
            for r in range(ROWS):
                m_tile[r] = neg_inf
                for c in range(COLS):
                    S[r, c] *= scale_log2
            # Only tiles that straddle the diagonal or a ragged end pay for the mask.
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                for r in range(ROWS):
                    for c in range(COLS):
                        if k_start + tx + THREADS_X * c >= key_end[r]:
                            S[r, c] = neg_inf  # invisible: past the ragged end, or above the diagonal
            for r in range(ROWS):
                for c in range(COLS):
                    m_tile[r] = max(m_tile[r], S[r, c])
            for r in range(ROWS):
                m_new = max(m_i[r], row_max(m_tile[r]))
                # A row that has seen no key yet keeps P = 0 (and avoids -inf - -inf).
                m_ref[r] = m_new if m_new != neg_inf else zero
                alpha[r] = math.exp2(m_i[r] - m_ref[r])
                m_i[r] = m_new
            for r in range(ROWS):
                p_sum = zero
                for c in range(COLS):
                    p = math.exp2(S[r, c] - m_ref[r])
                    smem[P_OFF + q_row[r] * P_PITCH_U + k_row[c]] = p
                    p_sum += p
                # The row sum stays split across the row's lanes until the end:
                # alpha is the same on every lane, so the shares rescale alike.
                l_i[r] = alpha[r] * l_i[r] + p_sum
                for e in range(DCOLS):
                    acc[r, e] *= alpha[r]
            if TRACE:
                for r in range(ROWS):
                    l_row = row_sum(l_i[r])
                    row = q_start + ty + THREADS_Y * r
                    if tx == 0 and row < seqlen_q:
                        trace[b, h, row, j, 0] = m_i[r] * LN2
                        trace[b, h, row, j, 1] = l_row
            if ASYNC:
                I.cp_async_wait_all()
                cuda.syncthreads()  # V_j is complete, and everyone is done reading K_j before K_{j+1} replaces it
                if j + 1 < n_tiles:  # K_{j+1} streams in while acc += P V_j is computed
                    copy_tile(smem, K_OFF, K_PITCH, k, b, h, k_start + BLOCK_N, BLOCK_N, seqlen_k, head_dim, tid)
            else:
                syncwarp()  # a row of P is written and read by the lanes of one warp

            # Step 2d: acc += P V_j.
            mm_pv(acc, smem, P_OFF, q_row, V_OFF, d_col)
            if ASYNC:
                I.cp_async_wait_all()  # K_{j+1} has landed (this thread's chunks; the barrier shows everyone's)
            cuda.syncthreads()  # everyone is done with K_j, V_j (and its P) before the next load

        # Step 3: O_i = acc / l_i and lse_i = m_i + log l_i, written once.
        for r in range(ROWS):
            row = q_start + ty + THREADS_Y * r
            l_row = row_sum(l_i[r])
            if row < seqlen_q:
                inv_l = acc_t(1) / l_row if l_row > 0 else zero
                for e in range(DCOLS):
                    d = d_column(tx, e)
                    if d < head_dim:
                        o[b, h, row, d] = to_out(acc[r, e] * inv_l)
                if tx == 0:
                    lse[b, h, row] = m_i[r] * LN2 + math.log(l_row) if l_row > 0 else neg_inf

    return flash_forward


# ----------------------------------------------------------------------------
# Choosing a configuration
# ----------------------------------------------------------------------------


@functools.cache
def choose_config(head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR) -> TileConfig:
    """The tile configuration the API uses for this head dim and input type.

    Chosen by a sweep on the H200 (``benchmarks/forward_sweep.py --sweep``;
    figures in ``benchmarks/results/``), fp32, N = 4096:

    * D ≤ 64: 128 threads as 16 rows × 8 lanes, ``BLOCK_M = 128``,
      ``BLOCK_N = 32``, launch bounds asking for 2 blocks per SM (24.8 TFLOP/s);
    * D ≤ 128: 256 threads as 16 rows × 16 lanes, ``BLOCK_M = 128``,
      ``BLOCK_N = 64`` (24.3 TFLOP/s);
    * D > 128: the accumulator (ROWS × D/16 per thread) would not fit in
      registers, so ``BLOCK_M = 64``, ``BLOCK_N = 32``.

    Up to D = 128 in float32, a head dim that pads to a multiple of four
    16-byte runs per lane (32 or 64 at D ≤ 64, 128 above) takes ``interleave``:
    measured on the H200 (fp32, N = 2k/8k, causal and not;
    ``benchmarks/results/fp32-candidates-NVIDIA-H200-2026-11-30-session4.json``)
    at 26.1 / 23.9 / 26.8 / 26.1 TFLOP/s for D = 64 (default before: 25.8 /
    23.4 / 26.7 / 25.8) and 25.2 / 21.9 / 24.9 / 24.7 for D = 128 (24.8 / 21.4 /
    24.8 / 24.4), non-causal then causal at each N.

    float64 tiles are halved to fit shared memory.  In the simulator, where
    each CUDA thread is a Python thread, tiles are tiny (8 × 8, 8 threads) so
    the tests can still cross tile edges.
    """
    acc_kind = "float64" if input_kind == "float64" else "float32"
    if simulator:
        return TileConfig(8, 8, pad_head_dim(head_dim, 4), 4, 2, input_kind, acc_kind)
    if acc_kind == "float64":
        bm, bn, tx, ty, min_blocks = (64, 32, 16, 8, 0) if head_dim <= 128 else (32, 32, 16, 8, 0)
    elif head_dim <= 64:
        bm, bn, tx, ty, min_blocks = 128, 32, 8, 16, 2
    elif head_dim <= 128:
        bm, bn, tx, ty, min_blocks = 128, 64, 16, 16, 0
    else:
        bm, bn, tx, ty, min_blocks = 64, 32, 16, 16, 0
    d_pad = pad_head_dim(head_dim, tx)
    # 16-byte column runs where the padded head dim allows them without more padding (the H200 run of
    # benchmarks/fp32_candidates.py: 0.4-2 % faster at D = 64 and 128, never slower).
    interleave = acc_kind == "float32" and head_dim <= 128 and d_pad % (4 * tx) == 0
    return TileConfig(
        bm, bn, d_pad, tx, ty, input_kind, acc_kind, min_blocks=min_blocks, interleave=interleave
    )


def with_copies(cfg: TileConfig, q, k, v) -> TileConfig:
    """``cfg`` with ``async_copy`` where :func:`async_copy_ok` allows it (the API's choice), else ``cfg``.

    The cp.async schedule also starts every head's longest tile first
    (``longest_first``).  Measured on the H200 (fp32, batch·N = 16k, heads·D =
    2048, ``fp32-candidates-NVIDIA-H200-2026-11-30-async.json``), TFLOP/s at
    N = 2k / 8k, non-causal then causal:

    ========  =========================  ===========================  ===========================
    head dim  plain loads (before)       cp.async                     cp.async + longest first
    ========  =========================  ===========================  ===========================
    64        26.0 / 23.7 / 26.7 / 26.1  34.9 / 31.4 / 35.2 / 33.8    34.9 / 33.3 / 35.2 / 35.6
    128       24.8 / 21.6 / 24.4 / 24.5  35.6 / 31.7 / 36.1 / 34.5    35.6 / 33.7 / 36.1 / 36.4
    ========  =========================  ===========================  ===========================

    (With plain loads, longest-first cost up to 11 %: it gives up the L2
    sharing of a head's K and V by neighbouring blocks, which the waits on
    those loads then expose.)
    """
    if cfg.async_copy or cfg.input_kind != "float32" or not async_copy_ok(cfg, q, k, v)[0]:
        return cfg
    return dataclasses.replace(cfg, async_copy=True, longest_first=True)


def can_implement(cfg: TileConfig) -> tuple[bool, str]:
    """Will this configuration launch on the current device?  ``(ok, reason)``."""
    need = shared_bytes(cfg)
    limit = max_shared_per_block()
    if need > limit:
        return False, f"needs {need} bytes of shared memory per block, the device allows {limit}"
    if cfg.threads > 1024:
        return False, f"{cfg.threads} threads per block exceed 1024"
    if cfg.groups != 1:
        return False, f"the forward kernel takes one thread group, got groups={cfg.groups}"
    return True, ""


def launch_forward(cfg: TileConfig, q, k, v, o, lse, scale: float, causal: bool, trace=None, stream=0):
    """Launch the forward kernel on canonical ``(B, H, N, D)`` views (no checks here)."""
    ok, why = can_implement(cfg)
    if ok and cfg.async_copy:
        ok, why = async_copy_ok(cfg, q, k, v)
    if not ok:
        raise ValueError(f"forward configuration {cfg} cannot run: {why}")
    batch, heads, seqlen_q, _ = q.shape
    grid = grid_shape(cfg, -(-seqlen_q // cfg.block_m), heads, batch)
    block = (cfg.threads_x, cfg.threads_y, 1)
    nbytes = shared_bytes(cfg)
    if trace is None:
        trace = _dummy_trace(lse)
    args = (q, k, v, o, lse, float(scale * LOG2E), bool(causal), trace)
    launch(forward_kernel(cfg), grid, block, stream, nbytes, *args)


_DUMMY_TRACE: dict = {}


def _dummy_trace(like):
    """A 1-element-per-axis array standing in for the unused trace argument (one per array type, dtype, GPU).

    For a kernel argument descriptor (``like`` is the lse's), a descriptor of
    that same memory with the trace's shape: the kernel never touches it
    (``cfg.trace`` is off), it only has to have the right type.
    """
    if isinstance(like, tuple):  # an nbflash._launch.ArrayArg (a NamedTuple; arrays are not tuples)
        es = like.dtype.itemsize
        return type(like)(like.ptr, (1, 1, 1, 1, 2), (2 * es, 2 * es, 2 * es, 2 * es, es), like.dtype)
    xp = array_module(like)
    key = (xp.__name__, like.dtype, getattr(getattr(like, "device", None), "id", None))
    dummy = _DUMMY_TRACE.get(key)
    if dummy is None:
        dummy = _DUMMY_TRACE[key] = xp.zeros((1, 1, 1, 1, 2), dtype=like.dtype)
    return dummy


def api_configs() -> list[TileConfig]:
    """Every configuration :func:`choose_config` can pick on a GPU (head dims 1..256, every input kind)."""
    seen = {}
    for kind in ("float16", "bfloat16", "float32", "float64"):
        for d in range(1, 257):
            cfg = choose_config(d, kind, simulator=False)
            seen[cfg] = None
            if kind == "float32" and d % 4 == 0:  # aligned float32 rows take cp.async (with_copies)
                seen[dataclasses.replace(cfg, async_copy=True, longest_first=True)] = None
    return list(seen)


def kernel_signature(cfg: TileConfig):
    """The Numba argument types of the forward kernel for ``cfg`` (any strides: layout 'A')."""
    from numba import types

    elem = {"float16": types.float16, "bfloat16": types.uint16, "float32": types.float32, "float64": types.float64}[
        cfg.input_kind
    ]
    acc = numba_type(cfg.acc_kind)
    tensor = types.Array(elem, 4, "A")
    return (
        tensor,
        tensor,
        tensor,
        tensor,
        types.Array(acc, 3, "A"),
        types.float64,
        types.boolean,
        types.Array(acc, 5, "A"),
    )


__all__ = [
    "api_configs",
    "async_copy_ok",
    "can_implement",
    "choose_config",
    "forward_kernel",
    "kernel_signature",
    "launch_forward",
    "shared_bytes",
    "with_copies",
]


def compile_targets():
    """``(name, cfg, kernel, signature, fastmath)`` for every kernel the API can launch (the PTX check)."""
    return [
        ("flash_forward", cfg, forward_kernel(cfg), kernel_signature(cfg), cfg.acc_kind == "float32")
        for cfg in api_configs()
    ]
