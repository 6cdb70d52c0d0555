"""The FlashAttention forward pass on tensor cores: ``mma.sync`` tiles, ``cp.async`` K/V pipelines.

The same algorithm as the SIMT kernel of :mod:`nbflash.forward` (read that one
first), with its two matrix products moved onto the tensor cores through the
inline-PTX building blocks of :mod:`nbflash.intrinsics`.

Shapes (every tensor indexed ``[batch, head, row, d]``; ``bshd`` arrives as a strided view)::

    q   (B, H, N_q, D)      k, v  (B, H, N_k, D)      float16, or bfloat16 as raw uint16 bits
    o   (B, H, N_q, D)      like q                     lse  (B, H, N_q)  float32

Grid: one block per (query tile, head, batch).  Each warp owns ``16 · m_tiles``
consecutive query rows of the tile for the whole kernel (one or two 16-row
m-tiles; two is FlashAttention-2's layout, where every K/V fragment read from
shared memory feeds two ``mma``), so no data crosses warps except through the
shared K/V tiles.  The per-m-tile steps are inline device functions
(:func:`online_softmax` and friends, inside :func:`forward_tc_kernel`) called
once per m-tile on its own register arrays.

Two schedules of the K/V copies, a compile-time choice (``TCConfig.kv_pipeline``;
one loop below, the differences under ``if SPLIT_KV``):

* ``"double"`` (the default): two K and two V buffers; K_{j+1} and V_{j+1}
  are one ``cp.async`` group that loads during all of tile j's maths.
* ``"split"``: FlashAttention-2's schedule: one K and one V buffer, each
  loaded as its own group: V_j during S = Q K_jᵀ, K_{j+1} during the
  softmax and O += P V_j.  Half the K/V shared memory, each load hidden
  behind part of an iteration only.

Both have two barriers per key tile.

1. ``cp.async`` the tile Q_i and K_0 (double: and V_0) into shared memory, one group.
2. For each visible key tile j (causal tiles above the diagonal are skipped):

   a. double: start the copy of K_{j+1}, V_{j+1} into the other buffers, wait
      for tile j (``cp.async.wait_group 1``), barrier.
      split: wait for K_j (``cp.async.wait_group 0``: the only group in
      flight), barrier, start the copy of V_j;
   b. (first tile only) ``ldmatrix`` the warp's Q rows into A fragments that
      stay in registers for the whole loop (for large D: re-read per k-step);
   c. ``S = Q_i K_jᵀ``: ``ldmatrix`` (no transpose) of K rows gives the B
      fragments, one ``mma.m16n8k16`` per 16×8×16 piece and m-tile;
   d. online softmax on the accumulator fragments: each thread holds two rows
      (g and g + 8) of S, and a row's other values sit in the 3 other lanes of
      its quad — the row max is two ``shfl.bfly`` steps; masking through
      :mod:`nbflash.masking`; ``P = 2^(S · scale · log2 e − m)``, one FFMA and
      one ``ex2.approx`` per score (the max is taken on the raw scores).
      Lazy rescale (``TCConfig.lazy_rescale``, after FlashAttention-4): a
      row keeps its reference max until a tile's max passes it by more than
      2^8, and the warp skips O's rescale (one ``vote.any``) when no row
      moved — exact, since O and l share the reference.  Both m-tiles'
      rescales come before any exponential, so that the branch ends early
      and the exponentials can be scheduled among step e's ``mma``.
      split, after the mask and before the softmax (where FlashAttention-2
      has it): wait for V_j (``wait_group 0``), barrier, start the copy of
      K_{j+1} into the K buffer;
   e. ``O += P V_j``: the accumulator layout of S *is* the A-fragment layout
      of P once packed to 16 bits (FlashAttention-2's register reuse: no
      shuffle, no shared memory); ``ldmatrix.trans`` of V rows gives B.
      double: barrier, so that no warp still reads the buffers of tile j when
      tile j + 2 is copied into them.  split: none needed (the barrier of
      step a of tile j + 1 comes before V_{j+1} is copied).

3. ``O_i = acc / l_i``, ``lse_i = m_i + log l_i`` written once.  With
   ``TCConfig.stage_o`` (the default; FlashAttention-2's epilogue) each warp
   writes its normalised rows, packed to 16 bits, over its own rows of the Q
   tile in shared memory (no other warp reads them: a warp barrier, not a
   block one), then stores them as 16-byte chunks, each row's chunks from
   consecutive lanes (:func:`nbflash._tiles.make_tc_tile_storer`): whole
   32-byte sectors, 16 ``st.global.v4`` per thread at D = 128 where the
   register epilogue issues 64 4-byte stores, each half a sector.

Constraints (:func:`can_implement`): ``D`` a multiple of 8 up to 256 (padded
to a multiple of 16 in shared memory, the padding zero-filled by ``cp.async``
and never written back); q, k, v contiguous along ``D`` with rows and start
16-byte aligned (cp.async copies 16 bytes); ``scale > 0``.  Shared memory per
block (:func:`shared_bytes`), rows padded by 16 bytes so that ``ldmatrix``'s
eight row addresses fall in different banks::

    Q_i   BLOCK_M × (D_pad + 8)                  2 bytes each
    K_j   2 buffers (split: 1) × BLOCK_N × (D_pad + 8)
    V_j   2 buffers (split: 1) × BLOCK_N × (D_pad + 8)

    128 × 64 tiles, double / split:  D = 64: 54 / 36 KB;  D = 128: 102 / 68 KB

Tile copies and the epilogue cost few instructions around the ``mma``: a
whole K/V tile is copied from one global address per tile plus row strides
(:func:`nbflash._tiles.make_tc_tile_copier`), and O is stored back the same
way (one address per warp plus row strides).

On the H200 (``benchmarks/results/tc-forward-*``, ``docs/performance.md``; the
split pipeline, d601198): 0.92–1.02× FlashAttention-2 at D = 64 and 0.86–0.94×
at D = 128 for N = 1k … 16k, bf16 and fp16, causal and not.  With the lazy
rescale and k-step 0 peeled (``tc-forward-NVIDIA-H200-2026-12-03-lazy2.json``):
0.96–1.03× at D = 64 and 0.91–1.12× at D = 128, within run-to-run noise
(±3 %) of the same run's FlashAttention-2-style softmax (0.95–1.03, 0.87–1.12).
With O staged in shared memory (``benchmarks/results/NVIDIA-H200-2026-12-03-tc.json``,
``bench.py``: the GPU busy while the host launches, median of 30–100 calls,
p10–p90 within 1 %): 0.98–1.13× at D = 64 and 0.95–0.96× (non-causal) /
0.96–1.07× (causal) at D = 128, N = 512 … 16k, bf16 and fp16.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from . import intrinsics as I
from ._device import (
    SIMULATOR,
    any_lane,
    cuda,
    device_function,
    kernel,
    launch,
    max_shared_per_block,
    numba,
    shfl_xor,
    syncwarp,
)
from ._tiles import LN2, LOG2E, make_padded_offset, make_tc_tile_copier, make_tc_tile_storer
from ._validate import tile_rows_problem
from .masking import d_key_range, d_row_key_end, d_tile_needs_mask

__all__ = [
    "TCConfig",
    "can_implement",
    "choose_config",
    "forward_tc_kernel",
    "kernel_signature",
    "launch_forward_tc",
    "shared_bytes",
]


@dataclass(frozen=True)
class TCConfig:
    """Compile-time constants of the tensor-core forward kernel.

    ``block_m`` query rows per block; each warp owns ``16 · m_tiles`` of them.
    With two 16-row m-tiles per warp (FlashAttention-2's layout) every K and V
    fragment read from shared memory feeds two ``mma`` instead of one, halving
    the shared-memory traffic per product.  ``q_in_regs`` keeps the warp's Q
    fragments in registers for the whole kernel; otherwise they are re-read
    from shared memory for every key tile (fewer registers: large head dims).
    ``kv_pipeline`` schedules the K/V copies (see the module docstring):
    ``"double"`` buffers both, ``"split"`` is FlashAttention-2's single K and
    single V buffer loaded as two ``cp.async`` groups (less shared memory).
    ``stage_o`` writes O through shared memory by 16-byte stores (step 3 of the
    module docstring); without it each pair of outputs is one 4-byte store
    from the registers, as the wgmma forward does.
    """

    block_m: int  # query rows per block: 16 per warp
    block_n: int  # keys per K/V tile
    head_dim: int  # D, a multiple of 8 up to 256 (padded to 16 inside)
    input_kind: str  # "float16" or "bfloat16"
    q_in_regs: bool = True
    m_tiles: int = 1  # 16-row m-tiles per warp: 1 or 2
    kv_pipeline: str = "double"  # "double": 2 K and 2 V buffers; "split": 1 each, K and V separate groups
    qk_unroll: int = 0  # > 0: S = Q Kᵀ as straight-line groups of this many k-steps (0: one loop NVVM may keep)
    lazy_rescale: bool = True  # O rescaled only when a row's max moves by > 2^8 (False: every tile, as FA2)
    stage_o: bool = True  # O through the warp's Q rows in shared memory, 16-byte stores (False: 4-byte, from registers)

    def __post_init__(self):
        if self.m_tiles not in (1, 2):
            raise ValueError(f"m_tiles must be 1 or 2, got {self.m_tiles}")
        if self.block_m <= 0 or self.block_m % (16 * self.m_tiles) or self.block_m // (16 * self.m_tiles) > 8:
            raise ValueError(
                f"block_m must be a multiple of {16 * self.m_tiles} rows (16 per m-tile) for at most "
                f"8 warps, got {self.block_m}"
            )
        if self.block_n <= 0 or self.block_n % 16:
            raise ValueError(f"block_n must be a positive multiple of 16, got {self.block_n}")
        if self.head_dim <= 0 or self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"head_dim must be a multiple of 8 up to 256, got {self.head_dim}")
        if self.input_kind not in ("float16", "bfloat16"):
            raise ValueError(f"input_kind must be 'float16' or 'bfloat16', got {self.input_kind!r}")
        if self.kv_pipeline not in ("double", "split"):
            raise ValueError(f"kv_pipeline must be 'double' or 'split', got {self.kv_pipeline!r}")
        if not isinstance(self.qk_unroll, int) or self.qk_unroll < 0:
            raise ValueError(f"qk_unroll must be a non-negative int (k-steps per straight-line group), got "
                             f"{self.qk_unroll!r}")

    @property
    def warps(self) -> int:
        return self.block_m // (16 * self.m_tiles)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def kv_buffers(self) -> int:
        """Buffers of K (and of V) in shared memory: two when double buffered, one for the split pipeline."""
        return 2 if self.kv_pipeline == "double" else 1

    @property
    def d_pad(self) -> int:
        """D rounded up to the mma's k = 16; the padding columns are zero in shared memory."""
        return -(-self.head_dim // 16) * 16

    @property
    def pitch(self) -> int:
        """Row pitch of the shared tiles (elements): padded D plus one 16-byte chunk against bank conflicts."""
        return self.d_pad + 8


def shared_offsets(cfg: TCConfig) -> tuple[int, int, int]:
    """Element offsets of the K buffers and of the V buffers (Q_i starts at 0), and the end."""
    q_off = 0
    k_off = q_off + cfg.block_m * cfg.pitch  # Q_i
    v_off = k_off + cfg.kv_buffers * cfg.block_n * cfg.pitch  # K_j: two buffers, or one (split)
    end = v_off + cfg.kv_buffers * cfg.block_n * cfg.pitch  # V_j: two buffers, or one (split)
    return k_off, v_off, end


@functools.cache
def shared_bytes(cfg: TCConfig) -> int:
    """Dynamic shared memory of one block (bytes)."""
    return shared_offsets(cfg)[-1] * 2


#: Lazy rescaling (after FlashAttention-4): a row keeps its running max m_i as the reference of its exponentials
#: until a tile's max passes it by more than this many powers of two, so P = 2^(s - m_i) ≤ 2^8 = 256, harmless
#: in fp32 accumulators and in fp16/bf16 P.  The result is exact: O = acc / l and lse = m_i + log l hold for any
#: reference m_i as long as acc and l share it.  Only when some row of the warp moves its reference does the
#: warp rescale its O accumulators; with scores of unit scale that is almost only at the first key tile.
RESCALE_SLACK_LOG2 = 8.0


class FragmentSteps(NamedTuple):
    """The device functions of :func:`fragment_steps` (each documented there, in its own docstring)."""

    init_rows: object
    mask_scores: object
    online_softmax: object
    p_frags: object
    write_rows: object
    softmax_rows: object
    rescale_rows: object
    move_references: object
    exponentiate: object
    finish_rows: object


@functools.cache
def fragment_steps(n_tiles: int, d_tiles: int, head_dim: int, input_kind: str, lazy_rescale: bool = True,
                   poly_exp2: int = 0):
    """The per-row steps of a 16-row m-tile held in the ``mma.m16n8`` accumulator layout, as device functions.

    A :class:`FragmentSteps` (``init_rows``, ``mask_scores``, ``online_softmax``,
    ``p_frags``, ``write_rows``, ``softmax_rows``, ``rescale_rows``,
    ``move_references``, ``exponentiate``, ``finish_rows``) for S tiles of
    ``n_tiles`` 8-key column tiles and O tiles of ``d_tiles`` 8-wide column
    tiles: register arrays ``S[n_tiles, 4]``, ``acc[d_tiles, 4]`` where value
    i of tile n is row g + 8(i >> 1), column 8n + 2t + (i & 1) (lane 4g + t).
    The wgmma accumulators of :mod:`nbflash.forward_wgmma` have this layout in
    every warp too, so both tensor-core forwards run the same softmax, masking
    and epilogue.  ``online_softmax`` is ``move_references`` (new row maxima,
    rescale factors), ``rescale_rows`` and ``exponentiate`` (P and the row
    sums); ``softmax_rows`` is the first and the last, for a kernel whose O
    accumulators are still being written by an asynchronous product and that
    calls ``rescale_rows`` later.  ``write_rows`` is ``finish_rows`` (O = acc
    / l in the registers, lse written) and one 32-bit store per pair of
    outputs; a kernel that stages O in shared memory calls ``finish_rows``
    and stores the tile itself.

    ``lazy_rescale`` (the default): a row's reference max moves only when a
    tile's max passes it by more than :data:`RESCALE_SLACK_LOG2`, and
    ``rescale_rows`` skips the multiplications when no row of the warp moved
    (one ``vote.any``); otherwise every tile rescales (FlashAttention-2).

    ``poly_exp2`` (0 … 8): of every 8 consecutive values of a thread's row in
    S, the first ``poly_exp2`` are exponentiated by a polynomial on the FMA
    units (:func:`~nbflash.intrinsics.ex2_poly`), the rest by the
    special-function unit (FlashAttention-4's split of the exponentials
    between the two).
    """
    N_TILES, D_TILES, D = n_tiles, d_tiles, head_dim
    POLY = poly_exp2
    NEG_INF = numba.float32(-math.inf)  # a float32 constant: a Python float would make the softmax float64
    ZERO = numba.float32(0)
    ONE = numba.float32(1)
    LAZY = lazy_rescale
    SLACK = numba.float32(RESCALE_SLACK_LOG2)
    FULL = 0xFFFFFFFF
    # The mask's compares in 32 bits on the GPU; the simulator keeps Python ints (the same values), where a NumPy
    # int32 per score would cost microseconds in every simulated thread.
    I32 = int if SIMULATOR else numba.int32
    pack = I.pack_f16x2 if input_kind == "float16" else I.pack_bf16x2  # two outputs, the first in the low half

    def init_rows(m_i, l_i, acc):
        """m_i = -inf, l_i = 0, acc = 0."""
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
        for dt in range(D_TILES):
            for i in range(4):
                acc[dt, i] = ZERO

    def mask_scores(S, first_row, k_start, seqlen_q, seqlen_k, causal, g, t):
        """S = -inf where a key is past the visible end of row first_row + g or + g + 8 (ragged tail or above
        the causal diagonal).  The ends are computed here, on the few masked tiles, not held in registers
        through the whole key loop."""
        for r in range(2):
            key_end = d_row_key_end(first_row + g + 8 * r, seqlen_q, seqlen_k, causal)
            # Key 8n + c is hidden iff 8n + c ≥ this; clamped to the tile and taken as 32 bits, so that each of the
            # 2 · N_TILES tests below is one 32-bit compare (64-bit: two ISETP each).
            first_hidden = I32(min(max(key_end - k_start - 2 * t, 0), 8 * N_TILES))
            for n in range(N_TILES):
                for c in range(2):
                    if I32(8 * n + c) >= first_hidden:  # int32 on both sides: a 32-bit compare
                        S[n, 2 * r + c] = NEG_INF

    def move_references(S, m_i, scale_log2, alpha):
        """The first half of the softmax of tile S: each row's reference max m_i moves (the tile's max passes it;
        lazily: by more than the slack), and alpha[r] = 2^(old − new) is the factor for row r's O and l."""
        for r in range(2):
            m_tile = NEG_INF  # the max of the raw scores: scale > 0 keeps their order
            for n in range(N_TILES):
                for c in range(2):
                    m_tile = max(m_tile, S[n, 2 * r + c])
            m_tile = max(m_tile, shfl_xor(FULL, m_tile, 1))  # the row's quad: lanes 4g .. 4g + 3
            m_tile = max(m_tile, shfl_xor(FULL, m_tile, 2))
            m_old = m_i[r]
            m_tile = m_tile * scale_log2
            if LAZY:
                # Keep the old reference unless the tile passes it by more than the slack (-inf + slack = -inf:
                # a row's first visible key always moves it); the four lanes of the quad decide alike.
                m_new = m_tile if m_tile > m_old + SLACK else m_old
            else:
                m_new = max(m_old, m_tile)
            # 2^0 = 1 exactly when the max did not move (also -inf to -inf).  The exponential is taken either way:
            # a branch around it would end the basic block, and ptxas waits for every wgmma in flight at the
            # first block boundary (forward_wgmma's overlapped softmax would wait for its P V here).
            alpha[r] = I.ex2_approx(m_old - m_new if m_new != m_old else ZERO)
            m_i[r] = m_new

    def exponentiate(S, m_i, l_i, scale_log2, alpha):
        """The second half: S becomes P = 2^(S · scale − m_i), and l_i = alpha · l_i + the row sums of P."""
        for r in range(2):
            m_ref = m_i[r] if m_i[r] != NEG_INF else ZERO  # a row with no key yet keeps P = 0
            p_sum = ZERO
            for n in range(N_TILES):
                for c in range(2):
                    x = S[n, 2 * r + c] * scale_log2 - m_ref  # one FFMA
                    if (2 * n + c) % 8 < POLY:  # (a compile-time choice: the loops unroll)
                        p = I.ex2_poly(x)  # eleven FMA-unit and integer instructions
                    else:
                        p = I.ex2_approx(x)  # one MUFU.EX2
                    S[n, 2 * r + c] = p
                    p_sum += p
            l_i[r] = alpha[r] * l_i[r] + p_sum  # reduced over the quad only at the end

    def softmax_rows(S, m_i, l_i, scale_log2, alpha):
        """Fold tile S into the running (m_i, l_i) of rows g, g + 8; S becomes P; alpha[r] = the factor by which
        row r's O accumulators must be rescaled (applied by :func:`rescale_rows`)."""
        move_references(S, m_i, scale_log2, alpha)
        exponentiate(S, m_i, l_i, scale_log2, alpha)

    def rescale_rows(acc, alpha):
        """acc of rows g, g + 8 *= alpha[0], alpha[1]; lazily: only if some row of the warp has alpha ≠ 1 (the
        vote keeps the branch uniform, so the warp's later ``mma`` stay converged)."""
        if not LAZY or any_lane(alpha[0] != ONE or alpha[1] != ONE):
            for r in range(2):
                for dt in range(D_TILES):
                    acc[dt, 2 * r] *= alpha[r]
                    acc[dt, 2 * r + 1] *= alpha[r]

    def online_softmax(S, acc, m_i, l_i, scale_log2):
        """Fold tile S into the running (m_i, l_i) of rows g, g + 8; S becomes P; acc is rescaled — before the
        exponentials, so that the lazy rescale's branch ends ahead of them and the compiler may still interleave
        them with the ``mma`` of O += P V that follow."""
        alpha = cuda.local.array(2, numba.float32)
        move_references(S, m_i, scale_log2, alpha)
        rescale_rows(acc, alpha)
        exponentiate(S, m_i, l_i, scale_log2, alpha)

    def p_frags(P, S, kk, slot):
        """P[slot] = P's A fragment for keys 16kk .. 16kk + 15: S tiles 2kk, 2kk + 1 packed to 16 bits (no
        shuffle)."""
        P[slot, 0] = pack(S[2 * kk, 0], S[2 * kk, 1])  # row g,     keys 2t, 2t + 1
        P[slot, 1] = pack(S[2 * kk, 2], S[2 * kk, 3])  # row g + 8, keys 2t, 2t + 1
        P[slot, 2] = pack(S[2 * kk + 1, 0], S[2 * kk + 1, 1])  # row g,     keys 8 + 2t, 8 + 2t + 1
        P[slot, 3] = pack(S[2 * kk + 1, 2], S[2 * kk + 1, 3])  # row g + 8, keys 8 + 2t, 8 + 2t + 1

    def finish_rows(acc, m_i, l_i, lse, b, h, first_row, seqlen_q, g, t):
        """O = acc / l in place (still fp32, in registers), and lse = m + log l written, for rows first_row + g
        and + g + 8 (rows at or past seqlen_q: normalised, not written)."""
        for r in range(2):
            row = first_row + g + 8 * r
            l_row = l_i[r]
            l_row += shfl_xor(FULL, l_row, 1)  # the row's quad: lanes 4g .. 4g + 3
            l_row += shfl_xor(FULL, l_row, 2)
            inv_l = ONE / l_row if l_row > 0 else ZERO
            for dt in range(D_TILES):
                acc[dt, 2 * r] *= inv_l
                acc[dt, 2 * r + 1] *= inv_l
            if t == 0 and row < seqlen_q:
                lse[b, h, row] = m_i[r] * LN2 + math.log(l_row) if l_row > 0 else NEG_INF

    def write_rows(o, lse, acc, m_i, l_i, b, h, first_row, seqlen_q, g, t):
        """O = acc / l, lse = m + log l for rows first_row + g, + g + 8, O stored from the registers (head-dim
        padding not written)."""
        finish_rows(acc, m_i, l_i, lse, b, h, first_row, seqlen_q, g, t)
        for r in range(2):
            row = first_row + g + 8 * r
            if row < seqlen_q:
                # Each pair of adjacent outputs (columns 8·dt + 2t, + 1) is one 32-bit store, at a constant
                # offset from the thread's first column of the row.
                address = I.global_address(o, (b, h, row, 2 * t))
                for dt in range(D_TILES):
                    if 8 * dt < D:
                        I.st_global_b32(address + 16 * dt, pack(acc[dt, 2 * r], acc[dt, 2 * r + 1]))

    # (online_softmax, softmax_rows and write_rows find their parts through their closures: the compiled versions.)
    move_references, exponentiate, finish_rows = (device_function(f) for f in (move_references, exponentiate,
                                                                                finish_rows))
    init_rows, mask_scores, online_softmax, p_frags, write_rows, softmax_rows, rescale_rows = (
        device_function(f)
        for f in (init_rows, mask_scores, online_softmax, p_frags, write_rows, softmax_rows, rescale_rows)
    )
    return FragmentSteps(init_rows, mask_scores, online_softmax, p_frags, write_rows, softmax_rows, rescale_rows,
                         move_references, exponentiate, finish_rows)


@functools.cache
def forward_tc_kernel(cfg: TCConfig):
    """The compiled tensor-core forward kernel for one configuration (cached)."""
    BLOCK_M, BLOCK_N, D, D_PAD = cfg.block_m, cfg.block_n, cfg.head_dim, cfg.d_pad
    THREADS, PITCH = cfg.threads, cfg.pitch
    Q_IN_REGS, TWO = cfg.q_in_regs, cfg.m_tiles == 2  # TWO: each warp owns a second m-tile, 16 rows below
    WARP_ROWS = 16 * cfg.m_tiles
    SPLIT_KV = cfg.kv_pipeline == "split"  # FlashAttention-2's single K and V buffers, two cp.async groups per tile
    K_OFF, V_OFF, _ = shared_offsets(cfg)
    KV_STRIDE = BLOCK_N * PITCH  # elements from one K (or V) buffer to the other (double buffering)
    CHUNKS = D_PAD // 8  # 16-byte chunks per shared row (the last ones zero padding when D < D_PAD)
    N_TILES = BLOCK_N // 8  # 8-key column tiles of S
    D_TILES = D_PAD // 8  # 8-wide column tiles of O
    K_STEPS = D_PAD // 16  # k-steps of Q K^T
    QF_STEPS = K_STEPS if Q_IN_REGS else 1  # Q fragments held at once
    PV_STEPS = BLOCK_N // 16  # k-steps of P V
    # O += P V is two loop nests, over the first and the second half of the k-steps, when a single nest would
    # hold more than 64 mma (D = 128, 64 keys, two m-tiles: 128).  NVVM unrolls a nest of 64 fully, so that
    # every S index is a constant; one of 128 it leaves a loop over k-steps, S[2kk] is indexed at run time
    # and S goes to the stack (local memory).
    PV_SPLIT = PV_STEPS if PV_STEPS * D_TILES * cfg.m_tiles <= 64 else PV_STEPS // 2
    # S = Q Kᵀ: NVVM keeps the k-step loop rolled at D = 128 (even in nests of 64 products), which is harmless
    # for S (no index depends on the k-step) but puts each step's ldmatrix right before the mma that waits for
    # it.  ``qk_unroll`` = u > 0 writes the loop as straight-line calls of u k-steps each (qk_steps_from).
    ZERO = numba.float32(0)
    u32 = numba.uint32
    SMEM_ALIGN = None if SIMULATOR else 16
    mma = I.mma_m16n8k16_f16 if cfg.input_kind == "float16" else I.mma_m16n8k16_bf16

    # Tile copies (cp.async, 16-byte chunks; rows past the end and the head-dim padding zero-filled).
    shared_row = make_padded_offset(PITCH)
    load_q = make_tc_tile_copier(BLOCK_M, THREADS, D, CHUNKS, shared_row)
    load_kv = make_tc_tile_copier(BLOCK_N, THREADS, D, CHUNKS, shared_row)

    # -- the steps of one m-tile (16 query rows of a warp), as inline device functions ------------------

    def load_q_frags(qf, smem, q_lane, kk):
        """The A fragments of Q for k-step kk (all of them when Q stays in registers)."""
        for k2 in range(K_STEPS if Q_IN_REGS else 1):
            f = I.ldmatrix_x4(smem, q_lane + 16 * (k2 if Q_IN_REGS else kk))
            for i in range(4):
                qf[k2, i] = f[i]

    def mma_into(C, n, A, ka, b0, b1):
        """C[n] += A[ka] · (b0, b1): one m16n8k16 product into accumulator tile n."""
        d = mma(A[ka, 0], A[ka, 1], A[ka, 2], A[ka, 3], b0, b1, C[n, 0], C[n, 1], C[n, 2], C[n, 3])
        for i in range(4):
            C[n, i] = d[i]

    def qk_product(S0, S1, qf0, qf1, smem, k_base, q_lane, first, end):
        """S += Q_i K_jᵀ over the k-steps [first, end) (columns 16·first .. 16·end - 1 of D), for every m-tile:
        each K fragment (16 keys × 16 of D, ``ldmatrix`` without transpose) feeds every m-tile of the warp."""
        for kk in range(first, end):
            kq = kk if Q_IN_REGS else 0
            if not Q_IN_REGS:
                load_q_frags(qf0, smem, q_lane, kk)
                if TWO:
                    load_q_frags(qf1, smem, q_lane + 16 * PITCH, kk)
            for n2 in range(N_TILES // 2):
                kb = I.ldmatrix_x4(smem, k_base + 16 * n2 * PITCH + 16 * kk)
                for half in range(2):
                    mma_into(S0, 2 * n2 + half, qf0, kq, kb[2 * half], kb[2 * half + 1])
                    if TWO:
                        mma_into(S1, 2 * n2 + half, qf1, kq, kb[2 * half], kb[2 * half + 1])

    def pv_product(acc0, acc1, S0, S1, P0, P1, smem, v_base, first, end):
        """acc += P V_j over the k-steps [first, end) (keys 16·first .. 16·end - 1), for every m-tile: each V
        fragment (16 keys × 16 of D, ``ldmatrix.trans``) feeds every m-tile of the warp."""
        for kk in range(first, end):
            p_frags(P0, S0, kk, 0)
            if TWO:
                p_frags(P1, S1, kk, 0)
            for d2 in range(D_TILES // 2):
                vb = I.ldmatrix_x4_trans(smem, v_base + 16 * kk * PITCH + 16 * d2)
                for half in range(2):
                    mma_into(acc0, 2 * d2 + half, P0, 0, vb[2 * half], vb[2 * half + 1])
                    if TWO:
                        mma_into(acc1, 2 * d2 + half, P1, 0, vb[2 * half], vb[2 * half + 1])

    load_q_frags, mma_into = (device_function(f) for f in (load_q_frags, mma_into))
    qk_product, pv_product = (device_function(f) for f in (qk_product, pv_product))

    QK_GROUP = cfg.qk_unroll or K_STEPS  # k-steps per call of qk_product (all of them: one loop)

    def qk_steps_from(first):
        """S += Q_i K_jᵀ over the k-steps [first, K_STEPS): one call of :func:`qk_product` per group of
        QK_GROUP k-steps, each with constant bounds, chained as straight-line code.  k-step 0 is a group of its
        own: straight-line code whose ``mma`` add to the S just zeroed, which NVVM folds to constant zeros, so
        ptxas gives them RZ as the accumulator input and S costs no zeroing instructions (32 per key tile at
        128 × 64)."""
        if first >= K_STEPS:
            return None
        end = 1 if first == 0 else min(first + QK_GROUP, K_STEPS)
        rest = qk_steps_from(end)

        def qk_steps(S0, S1, qf0, qf1, smem, k_base, q_lane):
            qk_product(S0, S1, qf0, qf1, smem, k_base, q_lane, first, end)
            if rest is not None:
                rest(S0, S1, qf0, qf1, smem, k_base, q_lane)

        return device_function(qk_steps)

    qk_all = qk_steps_from(0)
    steps = fragment_steps(N_TILES, D_TILES, D, cfg.input_kind, cfg.lazy_rescale)
    init_rows, mask_scores, p_frags, write_rows = steps.init_rows, steps.mask_scores, steps.p_frags, steps.write_rows
    rescale_rows, move_references, exponentiate = steps.rescale_rows, steps.move_references, steps.exponentiate
    finish_rows = steps.finish_rows

    # Step 3 (stage_o): each warp writes its normalised O rows into its own rows of the Q tile, which no other
    # warp reads, then stores them as 16-byte chunks (FlashAttention-2's epilogue, without its block barrier).
    STAGE_O = cfg.stage_o
    PITCH_WORDS = PITCH // 2  # 32-bit words per shared row
    pack = I.pack_f16x2 if cfg.input_kind == "float16" else I.pack_bf16x2
    store_o = make_tc_tile_storer(WARP_ROWS, 32, D, shared_row)

    def stage_rows(smem32, word_row0, acc, g, t):
        """Rows g and g + 8 of one m-tile's O (normalised) into shared memory from word ``word_row0`` on, one
        32-bit store per pair of outputs (columns 8·dt + 2t, + 1).  The 32 lanes of a store hit 32 different
        banks: lane 4g + t writes word g·PITCH/2 + t (+ 4·dt), and PITCH/2 is an odd multiple of 4."""
        for r in range(2):
            base = word_row0 + (g + 8 * r) * PITCH_WORDS + t
            for dt in range(D_TILES):
                if 8 * dt < D:
                    smem32[base + 4 * dt] = pack(acc[dt, 2 * r], acc[dt, 2 * r + 1])

    stage_rows = device_function(stage_rows)

    @kernel(fastmath=True)
    def flash_forward_tc(q, k, v, o, lse, qk_scale_log2, causal):
        """One block: O_i and lse_i for BLOCK_M queries of one (batch, head).

        Every per-row array below exists once per m-tile (suffix 0, and 1 when
        TWO): plain 2-D register arrays, so that NVVM unrolls every loop over
        them and nothing lands in local memory.
        """
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        q_start = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * BLOCK_M  # longest causal rows first
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))  # known ≥ 0: no sign fix-ups in // and % below
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this thread's rows of every fragment: g and g + 8 ...
        t = lane % 4  # ... and columns 2t, 2t + 1 of every 8-column tile
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)  # the same memory, as 32-bit words
        row0 = q_start + WARP_ROWS * warp  # the warp's first row; its second m-tile starts 16 below

        qf0 = cuda.local.array((QF_STEPS, 4), numba.uint32)  # Q A-fragments
        S0 = cuda.local.array((N_TILES, 4), numba.float32)  # S (then P) accumulators
        acc0 = cuda.local.array((D_TILES, 4), numba.float32)  # O accumulators
        P0 = cuda.local.array((1, 4), numba.uint32)  # P A-fragments of one k-step
        m0 = cuda.local.array(2, numba.float32)  # rows g, g + 8: running max (base-2 scaled) ...
        l0 = cuda.local.array(2, numba.float32)  # ... and this lane's share of the running sum
        qf1 = cuda.local.array((QF_STEPS, 4), numba.uint32)  # the same for the second m-tile
        S1 = cuda.local.array((N_TILES, 4), numba.float32)
        acc1 = cuda.local.array((D_TILES, 4), numba.float32)
        P1 = cuda.local.array((1, 4), numba.uint32)
        m1 = cuda.local.array(2, numba.float32)
        l1 = cuda.local.array(2, numba.float32)
        alpha0 = cuda.local.array(2, numba.float32)  # rows g, g + 8: the factor of a key tile's rescale
        alpha1 = cuda.local.array(2, numba.float32)
        init_rows(m0, l0, acc0)
        if TWO:
            init_rows(m1, l1, acc1)
        scale_log2 = numba.float32(qk_scale_log2)

        # Step 1: Q_i and K_0 (double: and V_0), one cp.async group.
        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        load_q(smem, 0, q, b, h, q_start, seqlen_q, tid)
        if n_tiles > 0:
            load_kv(smem, K_OFF, k, b, h, 0, seqlen_k, tid)
            if not SPLIT_KV:
                load_kv(smem, V_OFF, v, b, h, 0, seqlen_k, tid)
        I.cp_async_commit()

        # This lane's ldmatrix addresses (see nbflash.intrinsics), as offsets inside a tile.
        a_row, a_col = I.d_ldmatrix_x4_a_address(lane)  # Q rows (A), and V rows (.trans → B)
        bt_row, bt_col = I.d_ldmatrix_x4_bt_address(lane)  # K rows (→ B of S = Q Kᵀ)
        q_lane = (WARP_ROWS * warp + a_row) * PITCH + a_col
        k_lane = bt_row * PITCH + bt_col
        v_lane = a_row * PITCH + a_col

        for j in range(n_tiles):
            k_start = j * BLOCK_N
            buf = 0 if SPLIT_KV else j % 2
            if SPLIT_KV:
                # Step 2a (split): wait for K_j, then start V_j; it loads while S = Q K_jᵀ is computed.
                I.cp_async_wait(0)  # K_j's group (with Q_i's at j = 0) is the only one in flight
                # Every thread's copies of K_j (and Q_i) are visible; and every warp has finished O += P V_{j-1},
                # so the V buffer may be refilled (this is the only barrier between that read and this copy).
                cuda.syncthreads()
                load_kv(smem, V_OFF, v, b, h, k_start, seqlen_k, tid)
                I.cp_async_commit()
            else:
                # Step 2a (double): prefetch tile j + 1 into the other buffer, then wait for tile j.
                if j + 1 < n_tiles:
                    load_kv(smem, K_OFF + (1 - buf) * KV_STRIDE, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                    load_kv(smem, V_OFF + (1 - buf) * KV_STRIDE, v, b, h, k_start + BLOCK_N, seqlen_k, tid)
                I.cp_async_commit()  # possibly empty: keeps "wait for all but the newest group" uniform
                I.cp_async_wait(1)
                cuda.syncthreads()  # every thread's copies of tile j (and Q) are visible

            # Step 2b: the warp's Q rows into registers, once (for large D: per k-step, in 2c).
            if Q_IN_REGS and j == 0:
                load_q_frags(qf0, smem, q_lane, 0)
                if TWO:
                    load_q_frags(qf1, smem, q_lane + 16 * PITCH, 0)

            # Step 2c: S = Q_i K_jᵀ; each K fragment (16 keys × 16 of D) feeds every m-tile of the warp.
            k_base = K_OFF + buf * KV_STRIDE + k_lane
            for n in range(N_TILES):
                for i in range(4):
                    S0[n, i] = ZERO
                    S1[n, i] = ZERO
            qk_all(S0, S1, qf0, qf1, smem, k_base, q_lane)

            # Step 2d: online softmax, base 2.  Value i of tile n is row g + 8(i >> 1), key 8n + 2t + (i & 1).
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                mask_scores(S0, row0, k_start, seqlen_q, seqlen_k, causal, g, t)
                if TWO:
                    mask_scores(S1, row0 + 16, k_start, seqlen_q, seqlen_k, causal, g, t)
            if SPLIT_KV:
                # Step 2d (split): wait for V_j, then start K_{j+1}; it loads during the softmax and O += P V_j.
                I.cp_async_wait(0)  # V_j's group is the only one in flight
                # Every thread's copies of V_j are visible; and every warp has finished reading K_j (S above), so
                # the K buffer may be refilled.
                cuda.syncthreads()
                if j + 1 < n_tiles:
                    load_kv(smem, K_OFF, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                    I.cp_async_commit()
            # (online_softmax of each m-tile, its steps interleaved: both rescales — each a branch when lazy — come
            # before all exponentials, which the compiler may then schedule among O += P V's mma.)
            move_references(S0, m0, scale_log2, alpha0)
            if TWO:
                move_references(S1, m1, scale_log2, alpha1)
            rescale_rows(acc0, alpha0)
            if TWO:
                rescale_rows(acc1, alpha1)
            exponentiate(S0, m0, l0, scale_log2, alpha0)
            if TWO:
                exponentiate(S1, m1, l1, scale_log2, alpha1)

            # Step 2e: O += P V_j; the accumulator layout of S *is* P's A-fragment layout (FlashAttention-2).
            v_base = V_OFF + buf * KV_STRIDE + v_lane
            pv_product(acc0, acc1, S0, S1, P0, P1, smem, v_base, 0, PV_SPLIT)
            pv_product(acc0, acc1, S0, S1, P0, P1, smem, v_base, PV_SPLIT, PV_STEPS)  # empty unless PV_SPLIT < PV_STEPS
            if not SPLIT_KV:
                cuda.syncthreads()  # everyone is done with buffer `buf` before iteration j + 1 refills it
            # (split: no barrier here.  V_{j+1} is copied only after the first barrier of iteration j + 1, which
            # every warp reaches after this O += P V_j; K_{j+1} is already loading, K_j being read no more.)

        I.cp_async_wait_all()  # nothing left in flight (only Q's group when no key tile was visible)

        # Step 3: O_i = acc / l_i, lse_i = m_i + log l_i.
        if not STAGE_O:
            write_rows(o, lse, acc0, m0, l0, b, h, row0, seqlen_q, g, t)
            if TWO:
                write_rows(o, lse, acc1, m1, l1, b, h, row0 + 16, seqlen_q, g, t)
        else:
            finish_rows(acc0, m0, l0, lse, b, h, row0, seqlen_q, g, t)
            if TWO:
                finish_rows(acc1, m1, l1, lse, b, h, row0 + 16, seqlen_q, g, t)
            if n_tiles == 0:
                # (uniform in the block) Q's copies are waited for only here: every thread's must have landed
                # before a warp overwrites its rows, and another thread may have copied them.
                cuda.syncthreads()
            # Every lane of the warp has finished its last ldmatrix of the warp's Q rows (step 2b / 2c) before
            # any lane overwrites them.
            syncwarp()
            q_rows = WARP_ROWS * warp * PITCH  # element offset of the warp's rows in the Q tile
            stage_rows(smem32, q_rows // 2, acc0, g, t)
            if TWO:
                stage_rows(smem32, (q_rows + 16 * PITCH) // 2, acc1, g, t)
            syncwarp()  # every lane's staged pairs are visible before the warp reads whole chunks of them
            store_o(smem, q_rows, o, b, h, row0, seqlen_q, lane)

    return flash_forward_tc


# ----------------------------------------------------------------------------
# Configuration and launch
# ----------------------------------------------------------------------------


@functools.cache
def choose_config(
    head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR, max_shared: int | None = None
) -> TCConfig:
    """The configuration for a head dim (any multiple of 8 up to 256), chosen by the H200 sweeps.

    ``benchmarks/results/tc-forward-*`` (``benchmarks/tc_sweep.py``), bf16 and
    fp16, batch·N = 16k, heads·D = 2048, TFLOP/s at N = 1k / 4k / 16k:

    * D ≤ 64: 128 × 64 tiles, 4 warps of two m-tiles (FlashAttention-2's
      layout) — 239 / 278 / 293 non-causal against 197 / 224 / 235 for
      64 × 64 with one m-tile per warp; 229 registers, nothing in local memory.
    * D = 128 (a padded head dim of 128): FlashAttention-2's 128 × 64 tiles,
      4 warps of two m-tiles, Q re-read from shared memory (255 registers,
      nothing in local memory, 102 KB of shared memory) — 287 TFLOP/s at
      N = 4k against 212 for 64 × 64 with one m-tile in the same run
      (``tc-forward-*-fa2-d128.json``; causal 245 against 201).
    * 64 < D < 128: 64 × 64 tiles, one m-tile per warp, Q in registers — the
      D = 128 default before the 128 × 64 layout fitted in registers (209 / 245
      / 249 at D = 128); the two-m-tile 128 × 32 is within 2 %.
    * D > 128: 64 × 32 tiles with Q re-read from shared memory, so that S, P
      and O (128 registers at D = 256) still fit.

    O leaves through shared memory by 16-byte stores (``stage_o``) at every
    head dim: in one run (``tc-forward-*-stage-o.json``, N = 1k … 16k, bf16 and
    fp16, causal and not) the geometric mean ratio to SDPA flash was 1.012
    against 1.002 with the register epilogue at D = 64 and 0.957 against 0.948
    at D = 128 (+2 % below N = 8k, −1 % from 8k on).

    At D = 64 and D = 128 the K/V copies follow FlashAttention-2's split
    pipeline (``kv_pipeline="split"``: one K and one V buffer, 36 KB instead of
    54 at D = 64, 68 KB instead of 102 at D = 128).  Measured against the
    double-buffered pipeline in one run (``tc-forward-*-split-pipeline.json``,
    N = 1k … 16k, bf16 and fp16, causal and not): D = 128 +3 % to +8 % at every
    N ≥ 2k (bf16 non-causal 260 → 269 at 2k, 298 → 308 at 16k; fp16 causal
    247 → 267 at 8k); D = 64 within ±2 % (geometric mean +0.6 %).  Other head
    dims keep the double buffer (not timed).

    In the simulator, 2 warps and 16-key tiles keep the Python threads few
    while small sequences still cross tile edges.

    ``max_shared``: the device's shared memory per block (bytes), if known; a
    GPU with less than the chosen tiles need (e.g. 99 KB on sm_86/sm_89
    against 102 KB for D = 128) gets the next smaller layout instead of none.
    """
    if simulator:
        return TCConfig(32, 16, head_dim, input_kind, q_in_regs=head_dim <= 128)
    d_pad = -(-head_dim // 16) * 16
    if d_pad <= 64:
        choices = [
            TCConfig(128, 64, head_dim, input_kind, m_tiles=2, kv_pipeline="split"),
            TCConfig(64, 64, head_dim, input_kind),
        ]
    elif d_pad == 128:
        choices = [
            TCConfig(128, 64, head_dim, input_kind, q_in_regs=False, m_tiles=2, kv_pipeline="split"),
            TCConfig(64, 64, head_dim, input_kind),
        ]
    elif d_pad < 128:
        choices = [TCConfig(64, 64, head_dim, input_kind)]
    else:
        choices = [TCConfig(64, 32, head_dim, input_kind, q_in_regs=False)]
    choices.append(TCConfig(64, 32, head_dim, input_kind, q_in_regs=False))  # the smallest, for any head dim
    if max_shared is not None:
        for cfg in choices:
            if shared_bytes(cfg) <= max_shared:
                return cfg
    return choices[0]


def can_implement(cfg: TCConfig, *arrays) -> tuple[bool, str]:
    """Will this configuration launch on these arrays (q, k, v, o)?  ``(ok, reason)``.

    Any (B, H, N, D) view or descriptor whose rows are whole, 16-byte aligned
    chunks: cp.async copies 16 bytes at a time.
    """
    need = shared_bytes(cfg)
    limit = max_shared_per_block()
    if need > limit:
        return False, f"needs {need} bytes of shared memory per block, the device allows {limit}"
    why = tile_rows_problem(cfg.head_dim, "qkvo", arrays, copied=4)
    return not why, why


def launch_forward_tc(cfg: TCConfig, q, k, v, o, lse, scale: float, causal: bool, stream=0, check: bool = True):
    """Launch the tensor-core forward on canonical ``(B, H, N, D)`` views (float16, or bfloat16 as uint16).

    ``check=False`` skips :func:`can_implement` for a caller that has just run it (nbflash.api's plan).
    """
    if not scale > 0:
        raise ValueError(
            f"tensor-core forward: scale must be positive (the row max is taken before scaling), got {scale}"
        )
    ok, why = can_implement(cfg, q, k, v, o) if check else (True, "")
    if not ok:
        raise ValueError(f"tensor-core forward configuration {cfg} cannot run: {why}")
    batch, heads, seqlen_q, _ = q.shape
    grid = (-(-seqlen_q // cfg.block_m), heads, batch)
    args = (q, k, v, o, lse, float(scale * LOG2E), bool(causal))
    launch(forward_tc_kernel(cfg), grid, (cfg.threads, 1, 1), stream, shared_bytes(cfg), *args)


def kernel_signature(cfg: TCConfig):
    """The Numba argument types of the kernel for ``cfg`` (any strides: layout 'A')."""
    from numba import types

    elem = types.float16 if cfg.input_kind == "float16" else types.uint16
    tensor = types.Array(elem, 4, "A")
    return (tensor, tensor, tensor, tensor, types.Array(types.float32, 3, "A"), types.float64, types.boolean)


def compile_targets():
    """``(name, cfg, kernel, signature, fastmath)`` for the GPU configurations (the PTX check)."""
    cfgs = [choose_config(d, kind, simulator=False) for d in (40, 64, 96, 128, 256) for kind in ("float16", "bfloat16")]
    return [("flash_forward_tc", cfg, forward_tc_kernel(cfg), kernel_signature(cfg), True) for cfg in cfgs]
