"""The fused FlashAttention forward pass: one SIMT kernel, exact softmax, linear memory.

Shapes (inside the kernel every tensor is indexed ``[batch, head, row, d]``;
the ``bshd`` layout reaches it as a strided view, never a copy)::

    q   (B, H, N_q, D)      k, v  (B, H, N_k, D)
    o   (B, H, N_q, D)      lse   (B, H, N_q)        lse_i = log sum_j exp(S_ij)

Grid: one block per (query tile, head, batch) — FlashAttention-2's parallelism
over the sequence.  Each block computes ``O_i`` for ``BLOCK_M`` queries:

1. Load ``Q_i`` into shared memory; it stays there for the whole loop.  Set the
   running max ``m_i = -inf``, running sum ``l_i = 0`` and accumulator
   ``acc = 0`` (registers: local arrays indexed only by compile-time constants).
2. For each key tile ``j`` that some query of the tile can see (causal tiles
   entirely above the diagonal are skipped — see :mod:`nbflash.masking`):

   a. load ``K_j`` and ``V_j`` into shared memory;
   b. ``S = Q_i K_jᵀ · scale`` in registers, each thread a ``ROWS × COLS``
      piece; invisible pairs (ragged end, causal diagonal) get ``-inf``;
   c. online softmax: ``m_new = max(m_i, rowmax(S))``,
      ``P = exp(S - m_new)``, ``alpha = exp(m_i - m_new)``,
      ``l_i = alpha · l_i + rowsum(P)``, ``acc = alpha · acc``, ``m_i = m_new``;
   d. ``acc += P V_j`` (``P`` goes through shared memory, one row per warp).

3. ``O_i = acc / l_i`` and ``lse_i = m_i + log(l_i)``, written once.  A row
   that saw no key keeps ``l_i = 0`` and gets ``O_i = 0``, ``lse_i = -inf``.

``S`` and ``P`` never leave the chip.  Exponentials are taken base 2 with the
scale folded in (``exp(x) = exp2(x · log2 e)``), the usual FlashAttention trick.

Constraints: any ``N_q, N_k ≥ 1``; ``D ≤ 256`` (padded inside to a multiple of
``THREADS_X``); inputs float16/bfloat16/float32 accumulate in float32, float64
in float64.  Shared memory per block is given by :func:`shared_bytes`.
"""

from __future__ import annotations

import functools
import math

from ._device import (
    SIMULATOR,
    cuda,
    kernel,
    max_shared_per_block,
    numba,
    set_max_dynamic_shared,
    syncwarp,
)
from ._tiles import (
    LN2,
    TileConfig,
    make_row_reducers,
    make_storer,
    make_tile_loader,
    numba_type,
    pad_head_dim,
)
from .masking import d_key_range, d_row_key_end, d_tile_needs_mask


def pitches(cfg: TileConfig) -> tuple[int, int, int, int]:
    """Row pitches (elements) of the shared tiles Q_i, K_j, V_j and P.

    Q_i, K_j and P are read down a column by threads that own different rows;
    one extra element per row puts those rows in different banks.  V_j is read
    along a row, which is conflict-free without padding.
    """
    d = cfg.head_dim_pad
    return d + 1, d + 1, d, cfg.block_n + 1


def shared_bytes(cfg: TileConfig) -> int:
    """Dynamic shared memory of one block of the forward kernel."""
    q_pitch, k_pitch, v_pitch, p_pitch = pitches(cfg)
    elems = (
        cfg.block_m * q_pitch  # Q_i
        + cfg.block_n * k_pitch  # K_j
        + cfg.block_n * v_pitch  # V_j
        + cfg.block_m * p_pitch  # P
    )
    return elems * cfg.acc_itemsize


@functools.lru_cache(maxsize=None)
def forward_kernel(cfg: TileConfig):
    """The compiled forward kernel for one configuration (cached)."""
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    THREADS_X, THREADS_Y = cfg.threads_x, cfg.threads_y
    D_PAD = cfg.head_dim_pad
    ROWS = BLOCK_M // THREADS_Y  # query rows per thread
    COLS = BLOCK_N // THREADS_X  # keys per thread in S
    DCOLS = D_PAD // THREADS_X  # output columns per thread
    TRACE = cfg.trace
    acc_t = numba_type(cfg.acc_kind)
    Q_PITCH, K_PITCH, V_PITCH, P_PITCH = pitches(cfg)
    K_OFF = BLOCK_M * Q_PITCH
    V_OFF = K_OFF + BLOCK_N * K_PITCH
    P_OFF = V_OFF + BLOCK_N * V_PITCH
    P_END = P_OFF + BLOCK_M * P_PITCH
    NEG_INF = -math.inf

    load_tile = make_tile_loader(cfg)
    to_out = make_storer(cfg.input_kind)
    row_max, row_sum = make_row_reducers(THREADS_X)

    @kernel(fastmath=cfg.acc_kind == "float32")
    def flash_forward(q, k, v, o, lse, qk_scale_log2, causal, trace):
        """One block: O_i and lse_i for BLOCK_M queries of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        head_dim = q.shape[3]
        # Longest causal rows first: the last query tiles have the most keys.
        q_start = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * THREADS_X + tx

        smem = cuda.shared.array(0, acc_t)
        Q_i = smem[0:K_OFF]
        K_j = smem[K_OFF:V_OFF]
        V_j = smem[V_OFF:P_OFF]
        P = smem[P_OFF:P_END]

        # Step 1: Q_i stays in shared memory; m_i, l_i, acc in registers.
        load_tile(Q_i, Q_PITCH, q, b, h, q_start, BLOCK_M, seqlen_q, head_dim, tid)
        m_i = cuda.local.array(ROWS, acc_t)
        l_i = cuda.local.array(ROWS, acc_t)  # this lane's share of the row sum
        acc = cuda.local.array((ROWS, DCOLS), acc_t)
        S = cuda.local.array((ROWS, COLS), acc_t)
        q_r = cuda.local.array(ROWS, acc_t)
        k_c = cuda.local.array(COLS, acc_t)
        v_e = cuda.local.array(DCOLS, acc_t)
        m_tile = cuda.local.array(ROWS, acc_t)
        m_ref = cuda.local.array(ROWS, acc_t)
        alpha = cuda.local.array(ROWS, acc_t)
        key_end = cuda.local.array(ROWS, numba.int64)  # row r sees keys [0, key_end[r])
        zero = acc_t(0)
        scale_log2 = acc_t(qk_scale_log2)
        for r in range(ROWS):
            m_i[r] = NEG_INF
            l_i[r] = zero
            key_end[r] = d_row_key_end(q_start + ty + THREADS_Y * r, seqlen_q, seqlen_k, causal)
            for e in range(DCOLS):
                acc[r, e] = zero

        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        for j in range((k_end + BLOCK_N - 1) // BLOCK_N):
            k_start = j * BLOCK_N
            # Step 2a: stream K_j and V_j through shared memory.
            load_tile(K_j, K_PITCH, k, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
            load_tile(V_j, V_PITCH, v, b, h, k_start, BLOCK_N, seqlen_k, head_dim, tid)
            cuda.syncthreads()  # Q_i, K_j and V_j are complete before anyone reads them

            # Step 2b: S = Q_i K_jᵀ, this thread's ROWS × COLS piece.
            for r in range(ROWS):
                for c in range(COLS):
                    S[r, c] = 0
            for d in range(D_PAD):
                for r in range(ROWS):
                    q_r[r] = Q_i[(ty + THREADS_Y * r) * Q_PITCH + d]
                for c in range(COLS):
                    k_c[c] = K_j[(tx + THREADS_X * c) * K_PITCH + d]
                for r in range(ROWS):
                    for c in range(COLS):
                        S[r, c] += q_r[r] * k_c[c]

            # Step 2c: online softmax, in base 2 (scores scaled by scale·log2 e).
            masked = d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal)
            for r in range(ROWS):
                m_tile[r] = NEG_INF
                for c in range(COLS):
                    s = S[r, c] * scale_log2
                    if masked and k_start + tx + THREADS_X * c >= key_end[r]:
                        s = NEG_INF  # invisible: past the ragged end, or above the diagonal
                    S[r, c] = s
                    m_tile[r] = max(m_tile[r], s)
            for r in range(ROWS):
                m_new = max(m_i[r], row_max(m_tile[r]))
                # A row that has seen no key yet keeps P = 0 (and avoids -inf - -inf).
                m_ref[r] = m_new if m_new != NEG_INF else zero
                alpha[r] = math.exp2(m_i[r] - m_ref[r])
                m_i[r] = m_new
            for r in range(ROWS):
                p_sum = zero
                for c in range(COLS):
                    p = math.exp2(S[r, c] - m_ref[r])
                    P[(ty + THREADS_Y * r) * P_PITCH + tx + THREADS_X * c] = p
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
            syncwarp()  # a row of P is written and read by the lanes of one warp

            # Step 2d: acc += P V_j.
            for n in range(BLOCK_N):
                for r in range(ROWS):
                    q_r[r] = P[(ty + THREADS_Y * r) * P_PITCH + n]
                for e in range(DCOLS):
                    v_e[e] = V_j[n * V_PITCH + tx + THREADS_X * e]
                for r in range(ROWS):
                    for e in range(DCOLS):
                        acc[r, e] += q_r[r] * v_e[e]
            cuda.syncthreads()  # everyone is done with K_j, V_j (and its P) before the next load

        # Step 3: O_i = acc / l_i and lse_i = m_i + log l_i, written once.
        for r in range(ROWS):
            row = q_start + ty + THREADS_Y * r
            l_row = row_sum(l_i[r])
            if row < seqlen_q:
                inv_l = acc_t(1) / l_row if l_row > 0 else zero
                for e in range(DCOLS):
                    d = tx + THREADS_X * e
                    if d < head_dim:
                        o[b, h, row, d] = to_out(acc[r, e] * inv_l)
                if tx == 0:
                    lse[b, h, row] = m_i[r] * LN2 + math.log(l_row) if l_row > 0 else NEG_INF

    return flash_forward


# ----------------------------------------------------------------------------
# Choosing a configuration
# ----------------------------------------------------------------------------


def choose_config(head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR) -> TileConfig:
    """The tile configuration the API uses for this head dim and input type.

    On the GPU: 128 threads (8 rows × 16 lanes), ``BLOCK_N = 64`` keys, and
    ``BLOCK_M`` = 64 queries (32 when the per-thread accumulator or the shared
    tiles would get too large: D > 128, or float64 with D > 64).  In the
    simulator, where each CUDA thread is a Python thread, tiles are tiny.
    """
    acc_kind = "float64" if input_kind == "float64" else "float32"
    if simulator:
        tx = 4
        return TileConfig(
            block_m=8,
            block_n=8,
            head_dim_pad=pad_head_dim(head_dim, tx),
            threads_x=tx,
            threads_y=2,
            input_kind=input_kind,
            acc_kind=acc_kind,
        )
    tx, ty = 16, 8
    d_pad = pad_head_dim(head_dim, tx)
    big = d_pad > 128 or (acc_kind == "float64" and d_pad > 64)
    return TileConfig(
        block_m=32 if big else 64,
        block_n=32 if (acc_kind == "float64" and d_pad > 128) else 64,
        head_dim_pad=d_pad,
        threads_x=tx,
        threads_y=ty,
        input_kind=input_kind,
        acc_kind=acc_kind,
    )


def can_implement(cfg: TileConfig) -> tuple[bool, str]:
    """Will this configuration launch on the current device?  ``(ok, reason)``."""
    need = shared_bytes(cfg)
    limit = max_shared_per_block()
    if need > limit:
        return False, f"needs {need} bytes of shared memory per block, the device allows {limit}"
    if cfg.threads > 1024:
        return False, f"{cfg.threads} threads per block exceed 1024"
    return True, ""


def launch_forward(cfg: TileConfig, q, k, v, o, lse, scale: float, causal: bool, trace=None, stream=0):
    """Launch the forward kernel on canonical ``(B, H, N, D)`` views (no checks here)."""
    ok, why = can_implement(cfg)
    if not ok:
        raise ValueError(f"forward configuration {cfg} cannot run: {why}")
    batch, heads, seqlen_q, _ = q.shape
    grid = (-(-seqlen_q // cfg.block_m), heads, batch)
    block = (cfg.threads_x, cfg.threads_y, 1)
    nbytes = shared_bytes(cfg)
    kern = forward_kernel(cfg)
    if trace is None:
        trace = _dummy_trace(lse)
    args = (q, k, v, o, lse, float(scale * (1.0 / math.log(2.0))), bool(causal), trace)
    if not SIMULATOR:
        sig = tuple(kern.typeof_pyval(a) for a in args)
        if sig not in kern.overloads:
            kern.compile(sig)
            set_max_dynamic_shared(kern, nbytes)
    kern[grid, block, stream, nbytes](*args)


def _dummy_trace(like):
    """A 1-element-per-axis array standing in for the unused trace argument."""
    xp = _array_module(like)
    return xp.zeros((1, 1, 1, 1, 2), dtype=like.dtype)


def _array_module(a):
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


__all__ = ["can_implement", "choose_config", "forward_kernel", "launch_forward", "shared_bytes", "numba"]
