"""The FlashAttention-2 backward pass on tensor cores: ``mma.sync`` tiles, ``cp.async`` double buffering.

The same algorithm as the SIMT backward of :mod:`nbflash.backward` (read that
one first: it derives the gradients), with its five matrix products moved onto
the tensor cores through the inline-PTX building blocks of
:mod:`nbflash.intrinsics`, laid out as in the tensor-core forward of
:mod:`nbflash.forward_tc`.

Shapes (every tensor indexed ``[batch, head, row, d]``; ``bshd`` arrives as a strided view)::

    q, o, do, dq   (B, H, N_q, D)      k, v, dk, dv   (B, H, N_k, D)      float16, or bfloat16 as uint16 bits
    lse            (B, H, N_q)  float32, from the forward
    delta, lse2    (B, H, N_q)  float32 scratch (step 0)     dq_accum  (B, H, N_q, D)  float32 (atomic dQ)
    bulk_dq's dq_accum  (B, H, N_q rounded up to whole query tiles, D padded to 16)  float32, each query tile in
                   the fragment order of dq_tile_position

The gradients, with ``P_ij = exp(S_ij·scale − lse_i)`` recomputed tile by tile::

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D)      dQ = dS K · scale      dK = dSᵀ Q · scale

where ``D_i = rowsum(dO_i ∘ O_i)``.

0. **Preprocess** — :func:`nbflash.backward.preprocess_wide_kernel` (16-byte loads and stores): ``D_i``,
   ``lse2_i = lse_i · log2 e`` (``+inf`` for a row that saw no key) and, for
   the atomic variant, a cleared float32 dQ accumulator.

1. **dK, dV** (grid: key tiles × slices × heads × batch; ``BLOCK_N / 16`` warps;
   one slice, all of D, up to D = 128 — see *Large head dims* below).  Warp
   ``w`` owns the 16 keys ``16w .. 16w + 15`` of ``K_j, V_j``.  Because its
   rows are keys, every product below comes out *transposed*, with keys as the
   rows of the accumulator — and the accumulator layout of ``Pᵀ`` and ``dSᵀ``
   is the A-fragment layout of the next products once packed to 16 bits
   (FlashAttention-2's register reuse), so no value crosses lanes.

   ``cp.async`` K_j, V_j and the first Q_i, dO_i into shared memory; with
   ``kv_in_registers`` each warp then keeps its rows of K_j and V_j as A
   fragments for the whole loop (else it re-reads them with ``ldmatrix``).  For
   each query tile ``i`` that sees some key of the tile (:func:`~nbflash.masking.query_range`):

   a. wait for tile i's copies, then one barrier: it makes them visible and
      ends every warp's use of tile i − 1's buffers, so the copy of Q_{i+1},
      dO_{i+1} and their lse2, D (``cp.async``, 4 bytes a value) into those
      buffers starts right after it and runs under tile i's products.  One
      barrier per tile: copies started before the wait would need a second
      one at the end of every tile, to keep them off a buffer still in use;
   b. ``Sᵀ = K_j Q_iᵀ`` (16 × BLOCK_M per warp): A = K fragments, B = Q rows
      by ``ldmatrix`` (no transpose), as K in the forward's ``S = Q Kᵀ``;
   c. ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_col)``: value i of a thread's
      8-column tile n is key ``g + 8(i >> 1)``, query ``8n + 2t + (i & 1)``, so
      lse2 is per *column*; invisible pairs set to 0 (:mod:`nbflash.masking`);
   d. ``dPᵀ = V_j dO_iᵀ`` like b, and ``dSᵀ = Pᵀ ∘ (dPᵀ − D_col)``;
   e. ``dV_j += Pᵀ dO_i``: A = Pᵀ packed from the accumulator, B = dO_i by
      ``ldmatrix.trans`` (as V in the forward's ``O += P V``);
   f. ``dK_j += dSᵀ Q_i``: A = dSᵀ packed, B = Q_i by ``ldmatrix.trans``;
   g. *atomic variant:* the packed dSᵀ also goes to a shared ``[key][query]``
      tile; after a barrier the warps split the ``BLOCK_M × D`` block of
      ``dQ_i += dS K_j`` (A = dS by ``ldmatrix.trans`` of that tile, B = K_j by
      ``ldmatrix.trans``) and add it into the float32 accumulator with
      ``red.global.add`` — one ``.v2.f32`` per accumulator pair on sm_90
      (``vector_red``), else two scalar ones; the order of the additions
      changes from run to run.

   Finally ``dK_j · scale`` and ``dV_j`` are written once.

2. **dQ**, deterministic variant (grid: query tiles × slices × heads × batch; the same
   warps, now each owning 16 *queries*).  Q_i and dO_i stay as A fragments (with
   several slices they are re-read for every key tile, a slice's width at a time);
   K_j, V_j stream past, double-buffered, with step 1a's one barrier per
   tile.  Per key tile: ``S = Q_i K_jᵀ``,
   ``P = exp2(S · scale · log2 e − lse2_row)`` (masked), ``dP = dO_i V_jᵀ``
   (B = V rows, no transpose), ``dS = P ∘ (dP − D_row)``, ``dQ_i += dS K_j``
   (A = dS packed, B = K_j by ``ldmatrix.trans``).  ``dQ_i · scale`` written once.

2'. **Convert**, atomic variant — :func:`nbflash.backward.dq_convert_wide_kernel`:
   ``dq = accumulator · scale`` in the output type (with ``bulk_dq``: :func:`dq_tile_convert_kernel`, which
   reads the accumulator's tiles in fragment order); both 16 bytes per load and store.

**The grid layout** (:attr:`TCBackwardConfig.warps_keys`; :func:`_dkdv_grid_kernel`).  In the layout
above a warp owns 16 keys and *all* of every product's other side, so each ``ldmatrix`` of a B operand
feeds two mma: at D = 128 with 128 keys × 64 queries (the atomic route) a warp issues 184 ``ldmatrix.x4``
per 320 mma — by a count of bytes (512 per ``ldmatrix.x4`` at 128 a cycle per multiprocessor, against
an mma every ~2.9 cycles at the measured mma.sync ceiling) nearly as long on the shared-memory pipe as
on the tensor pipe.
FlashAttention-2 instead arranges the warps in a grid per product — 4 key groups × 2 query groups for
Sᵀ and dPᵀ (32 × 32 warp tiles), 4 × 2 over keys × columns for dK and dV (32 × 64), 2 × 4 over queries ×
columns for dQ (32 × 32) — which takes 144 ``ldmatrix.x4`` per 320 mma.  The price is that ``Pᵀ`` and
``dSᵀ`` no longer stay in the registers of the warp that computed them: they go to shared ``[key][query]``
tiles, behind a second barrier per query tile, and dV, dK and dQ read their A operands from there.

**Large head dims.**  A warp's dK and dV accumulators hold its 16 keys × the
block's gradient columns: 64 + 64 registers at D = 128, too many at D = 256.
So above a padded D of 128 the head dim is cut into *slices* of at most 128
gradient columns (:attr:`TCBackwardConfig.d_slice`; two slices of 128 at
D = 256, of 80 at D = 160), one block per (key tile, slice).  Each block
still recomputes ``Sᵀ`` and ``dPᵀ`` over the whole head dim — loading its K
(or V) fragments one slice's width of k-steps at a time, so that one group of
fragments is live — and then accumulates only its own columns of dV, dK and
(atomic) dQ.  The recomputed products are the price: at D = 256 the two
blocks of a key tile do 1.5× the matrix work of one unsliced block (12
products of 128 columns against 8), which would need twice the accumulator
registers.  The dQ kernel is sliced the same way.

Constraints (:func:`can_implement`): ``D`` a multiple of 8 up to 256 (padded
to a multiple of 16 — the mma's k — in shared memory, the padding zero-filled
by ``cp.async`` and never written back: a gradient tile of padding is neither
stored nor, since it is dead, computed); any ``N_q, N_k ≥ 1`` (ragged tails
are zero-filled by ``cp.async``; causal is bottom-right aligned); q, k, v, do
contiguous along ``D`` with 16-byte aligned rows (with ``staged_out`` dq, dk,
dv too).  Shared memory per block
(:func:`shared_bytes`; ``C`` = :attr:`~TCBackwardConfig.d_smem`, the padded
D, or every slice whole), every row padded by 8 elements (16 bytes) so that
``ldmatrix``'s eight row addresses fall in different banks::

    dK/dV:  K_j, V_j     2 × BLOCK_N × (C + 8)                   2 bytes each
            Q_i, dO_i    2 × 2 buffers × BLOCK_M × (C + 8)
            lse2, D      2 × 2 buffers × BLOCK_M                 4 bytes each
            dSᵀ          BLOCK_N × (BLOCK_M + 8)                 atomic variant, and the grid layout
            Pᵀ           BLOCK_N × (BLOCK_M + 8)                 the grid layout
            dQ_i         BLOCK_M × D padded to 16                4 bytes each; bulk_dq's staging
    dQ:     Q_i, dO_i    2 × BLOCK_N × (C + 8)                   (the dQ kernel's query tile is BLOCK_N)
            K_j, V_j     2 × 2 buffers × BLOCK_M × (C + 8)

    D=64 (64 × 64 tiles):           dK/dV 56 320 bytes (atomic 65 536), dQ 55 296
    D=128 (64 × 64 tiles):          dK/dV 105 472 bytes (atomic 114 688), dQ 104 448
    D=128 (64 keys × 32 queries, where a block gets less than that): 70 144 (75 264), 69 632
    D=128 (128 keys × 64 queries, the atomic route's 8 warps):       atomic 158 720
    D=128 (128 keys × 64 queries, grid layout):                      dK/dV 177 152 (both routes; bulk_dq 209 920)
    D=64 (128 keys × 128 queries, grid layout, the atomic default):  182 272 (bulk_dq, sm_90: 215 040)
    D=256 (128 keys × 32 queries, two slices of 128): dK/dV 203 264 (atomic 213 504), dQ 202 752
    D=256 (64 keys × 32 queries, where a block gets less):              135 680 (140 800), 135 168

Status: correct in the Numba simulator (tests/test_backward_tc.py) and
compiles for sm_80/sm_90 with no local memory and no spills.  The H200 run
that picked the tiles (``benchmarks/tc_backward.py --configs``, bf16, 786f6ad;
registers as Numba reports them on the GPU) measured 64 × 64 tiles with K/V
re-read at 166 (D=64) / 244 (D=128) registers for dK/dV and 131–198 TFLOP/s
with deterministic dQ (0.69–0.86× FlashAttention-2 at D = 64, 0.63–0.77× at
D = 128).  The atomic dQ route (``red.global.add.v2.f32`` on sm_90) measured
within a few per cent of it, faster on some shapes and slower on others, so
the deterministic route stays the default.  With the tile copier's short
path (one address per tile, 3f5a8c4; ``tc-backward-…-copier.json``, bf16):
164–207 TFLOP/s at D = 128 and 127–204 at D = 64, 0.69–0.94×
FlashAttention-2.  With the product nests unrolled and one barrier per
tile (``tc-backward-NVIDIA-H200-2026-12-01-one-barrier.json``, bf16,
N = 1k–16k, the same run as FlashAttention-2): deterministic 139–221
TFLOP/s, 0.72–0.89×; atomic at D = 128 with 64 × 128 tiles 127–252, 0.74–0.82×.  With the grid
layout's dK/dV kernel on those tiles (``tc-backward-NVIDIA-H200-2026-12-02-grid.json``): atomic at
D = 128 133–270 TFLOP/s, 0.78–0.88× FlashAttention-2 in the same run (+5–9 % over the register layout).
With ``bulk_dq`` (dQ by one bulk reduction per warp and tile, the accumulator in fragment order;
``tc-backward-NVIDIA-H200-2026-12-02-bulk-tile*.json``): 2–4 % faster at D = 64 from N = 2k; within ±2 % at
D = 128.  With those bulk reductions issued between the dV and dK products (``dq_before_dk``,
``tc-backward-NVIDIA-H200-2026-12-03-dqorder*.json``): +8–14 % at both head dims, 0.80–1.00× FlashAttention-2
at D = 128 and 0.82–0.97× at D = 64 — the atomic default on sm_90.  With steps 0 and 2' moving 16 bytes per load
and store (they took 418 µs of every call at batch·N = 16k, heads·D = 2048, now 122;
``bwd-kernels-NVIDIA-H200-2026-12-03-*.json``, per kernel by CUPTI): 0.96–1.10× SDPA's FlashAttention-2 backward
at N = 512–16k, D = 64 and 128, bf16 and fp16; the dK/dV kernel alone 0.81–1.01× FlashAttention-2's.  In
``bench.py``'s run of every (dtype, D, N, causal) pair (``NVIDIA-H200-2026-12-03-tc.json``): 0.95–1.07×.
:func:`nbflash.attention_backward` runs it for float16/bfloat16 (``backend=``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from . import backward as bw
from . import hopper as H
from . import intrinsics as I
from ._device import (
    SIMULATOR,
    compute_capability,
    cuda,
    device_function,
    kernel,
    launch,
    max_shared_per_block,
    numba,
    syncwarp,
)
from ._tiles import (
    LOG2E,
    HeadDimSlices,
    make_padded_offset,
    make_pair_stager,
    make_storer,
    make_tc_tile_copier,
    make_tc_tile_storer,
)
from ._validate import array_module, tile_rows_problem
from .masking import d_key_columns, d_key_range, d_query_range, d_row_key_end, d_tile_needs_mask

__all__ = [
    "DQTiles",
    "TCBackwardConfig",
    "can_implement",
    "choose_config",
    "compile_targets",
    "dkdv_tc_kernel",
    "dq_tc_kernel",
    "dq_tile_convert_kernel",
    "dq_tile_position",
    "kernel_signature",
    "launch_backward_tc",
    "shared_bytes",
]

KERNELS = ("dkdv", "dkdv_atomic", "dq")


@dataclass(frozen=True)
class DQTiles:
    """The layout of a float32 dQ accumulator added to by bulk reductions (``bulk_dq`` here and in
    :mod:`nbflash.backward_wgmma`): whole query tiles of ``rows`` queries × ``d_pad`` columns, each one
    contiguous run, cut into the parts of ``warp_tile = (R, C)`` values that one warp computes, each part in
    the mma's fragment order (:func:`dq_tile_position`).  ``input_kind`` and ``threads`` are step 2''s
    (:func:`dq_tile_convert_kernel`: the output type, the block)."""

    rows: int
    d_pad: int
    warp_tile: tuple[int, int]
    input_kind: str
    threads: int


@dataclass(frozen=True)
class TCBackwardConfig(HeadDimSlices):
    """Compile-time constants of the tensor-core backward kernels.

    Both kernels keep ``block_n`` rows stationary (16 per warp) and stream tiles
    of ``block_m`` rows past them: keys stay and queries stream in the dK/dV
    kernel; in the deterministic dQ kernel the roles swap (``block_n`` queries
    stay, ``block_m`` keys stream), so both kernels have the same warps and
    similar registers per warp.

    The head dim is padded to a multiple of 16 (the mma's k) in shared memory,
    the padding zero-filled by ``cp.async`` and never written back.  A block
    owns the gradient columns of one *slice* of the padded head dim
    (``d_slice`` columns; 0: all of them): its dK, dV (or dQ) accumulators
    hold ``16 · d_slice / 32`` values per thread each, so a large head dim is
    cut into slices, one block per slice.  Every slice's block recomputes Sᵀ
    and dPᵀ over the whole head dim (their K fragments read one slice wide at
    a time) — the price of keeping the accumulators in registers at D = 256.
    """

    block_m: int  # dK/dV kernel: queries per streamed Q_i, dO_i tile (dQ kernel: keys per K_j, V_j tile)
    block_n: int  # dK/dV kernel: keys per block, 16 per warp (dQ kernel: queries per block)
    head_dim: int  # D, a multiple of 8 up to 256 (padded to 16 inside)
    input_kind: str  # "float16" or "bfloat16"
    kv_in_registers: bool = True  # dK/dV: keep the warp's K_j, V_j A-fragments in registers (else re-ldmatrix)
    vector_red: bool = False  # atomic dQ (step 1g): red.global.add.v2.f32, one per accumulator pair (sm_90+)
    d_slice: int = 0  # gradient columns per block, a multiple of 16 up to 128 (0: the whole padded head dim)
    # dK/dV kernel in FlashAttention-2's warp grid (step 1, *grid layout*; 0: one warp per 16 keys): the warps in
    # ``warps_keys`` groups along the keys, the rest of the split along the queries of Sᵀ and the columns of dK, dV;
    # ``warps_dq_rows`` groups along the queries of step 1g's dQ_i, the rest along its columns.
    warps_keys: int = 0
    warps_dq_rows: int = 0
    # Atomic dQ in the grid layout: each warp stores its part of dQ_i to shared memory and the bulk copy engine adds
    # it into the float32 accumulator, one ``cp.reduce.async.bulk .add.f32`` per warp and query tile (sm_90+),
    # instead of ``red.global.add`` from registers.  The accumulator then holds each query tile in the warps'
    # fragment order (:func:`dq_tile_position`), and step 2' reads it back in that order.
    bulk_dq: bool = False
    # Atomic dQ in the grid layout: step 1g between dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i (FlashAttention-2's order),
    # so that the dK product's mma issue while dQ's reductions drain, instead of after both products.
    dq_before_dk: bool = False
    # Both kernels' last step through shared memory (:func:`_make_staged_writer`): after a block barrier every
    # warp packs its dK_j · scale and dV_j pairs over the K_j, V_j tiles (dQ_i · scale over Q_i), then the block
    # writes whole 16-byte chunks of rows, instead of two 16-bit stores per pair from the accumulators.  The
    # Hopper backward's same change took its dK/dV kernel's last step from 14 to 2.0 µs a block at D = 128 (H100,
    # 2026-12-06).  :func:`choose_config` turns it on above a padded D of 64 (measured +1 % to +8 % at D = 256,
    # +5 % geomean at D = 128); at D <= 64 it is not timed, so off.  dq, dk and dv must then have rows of whole,
    # aligned 16-byte chunks (:func:`can_implement`).
    staged_out: bool = False

    def __post_init__(self):
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"block_n must be 16, 32, 64 or 128 (16 rows per warp), got {self.block_n}")
        if self.block_m <= 0 or self.block_m % 16:
            raise ValueError(f"block_m must be a positive multiple of 16, got {self.block_m}")
        if self.head_dim <= 0 or self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"head_dim must be a multiple of 8 up to 256, got {self.head_dim}")
        if self.input_kind not in ("float16", "bfloat16"):
            raise ValueError(f"input_kind must be 'float16' or 'bfloat16', got {self.input_kind!r}")
        if self.d_slice < 0 or self.d_slice % 16 or self.d_slice > 128:
            raise ValueError(f"d_slice must be 0 or a multiple of 16 up to 128, got {self.d_slice}")
        if self.kv_in_registers and self.slices > 1:
            raise ValueError("kv_in_registers holds the whole head dim's fragments: it needs one slice (d_slice=0)")
        if not self.d_slice and self.d_pad > 128:
            raise ValueError(f"a padded head dim of {self.d_pad} needs d_slice (at most 128 columns per block)")
        if self.warps_keys or self.warps_dq_rows:
            self._check_grid()
        if self.bulk_dq and not self.grid:
            raise ValueError("bulk_dq stages dQ_i in the grid layout's dK/dV kernel: it needs warps_keys > 0")
        if self.dq_before_dk and not self.grid:
            raise ValueError("dq_before_dk orders the grid layout's products: it needs warps_keys > 0")

    def _check_grid(self):
        """The grid layout's constraints: whole 16-row (16-column) fragment tiles for every warp."""
        w, chunks, m16 = self.warps, self.d_pad // 16, self.block_m // 16
        for name, groups in (("warps_keys", self.warps_keys), ("warps_dq_rows", self.warps_dq_rows)):
            if groups <= 0 or w % groups:
                raise ValueError(f"{name} must divide the {w} warps (grid layout), got {groups}")
        cols = w // self.warps_keys  # Sᵀ query groups = dK/dV column groups
        if m16 % cols or chunks % cols:
            raise ValueError(f"warps_keys={self.warps_keys} leaves {cols} warps per key group: they must split the "
                             f"{m16} 16-query and {chunks} 16-column tiles evenly")
        dq_cols = w // self.warps_dq_rows
        if m16 % self.warps_dq_rows or chunks % dq_cols:
            raise ValueError(f"warps_dq_rows={self.warps_dq_rows}: {self.warps_dq_rows} × {dq_cols} warps must split "
                             f"the {m16} 16-query and {chunks} 16-column tiles of dQ_i evenly")
        if self.slices > 1 or self.kv_in_registers:
            raise ValueError("the grid layout takes one slice (d_slice=0) and K/V re-read (kv_in_registers=False)")

    @property
    def grid(self) -> bool:
        """The dK/dV kernel in FlashAttention-2's warp grid, Pᵀ and dSᵀ through shared memory."""
        return self.warps_keys > 0

    @property
    def dq_warp_tile(self) -> tuple[int, int]:
        """Step 1g's warp tile of dQ_i in the grid layout: (queries, columns) of one warp, ``warps_dq_rows`` warps
        down the ``block_m`` queries and the rest across the padded head dim."""
        return self.block_m // self.warps_dq_rows, self.d_pad * self.warps_dq_rows // self.warps

    @property
    def dq_tiles(self) -> DQTiles:
        """``bulk_dq``'s accumulator layout: query tiles of ``block_m`` rows, parts of :attr:`dq_warp_tile`."""
        return DQTiles(self.block_m, self.d_pad, self.dq_warp_tile, self.input_kind, self.threads)

    @property
    def warps(self) -> int:
        return self.block_n // 16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def d_pad(self) -> int:
        """D rounded up to the mma's k = 16."""
        return -(-self.head_dim // 16) * 16

    @property
    def pitch(self) -> int:
        """Row pitch of the Q, K, V, dO tiles (elements): the columns plus one 16-byte chunk against bank conflicts."""
        return self.d_smem + 8

    @property
    def ds_pitch(self) -> int:
        """Row pitch of the dSᵀ tile (elements): BLOCK_M queries plus 8."""
        return self.block_m + 8


def shared_offsets(cfg: TCBackwardConfig, name: str) -> dict[str, int]:
    """Offsets of kernel ``name``'s tiles in its dynamic shared memory, in 16-bit elements; ``end`` is the size.

    A second buffer of a double-buffered tile starts one tile after the first.
    """
    P = cfg.pitch
    offs = {}
    end = 0

    def put(tile, elements):
        nonlocal end
        offs[tile] = end
        end += elements

    if name in ("dkdv", "dkdv_atomic"):
        put("k", cfg.block_n * P)  # K_j: the block's keys, for the whole kernel
        put("v", cfg.block_n * P)  # V_j
        put("q", 2 * cfg.block_m * P)  # Q_i: two buffers
        put("do", 2 * cfg.block_m * P)  # dO_i: two buffers
        put("lse2", 2 * cfg.block_m * 2)  # lse2 of Q_i's queries: two buffers of float32
        put("delta", 2 * cfg.block_m * 2)  # D of Q_i's queries: two buffers of float32
        if cfg.grid:
            put("p", cfg.block_n * cfg.ds_pitch)  # grid layout: Pᵀ [key][query], 16-bit, for dV_j += Pᵀ dO_i
        if name == "dkdv_atomic" or cfg.grid:
            put("ds", cfg.block_n * cfg.ds_pitch)  # dSᵀ [key][query], 16-bit, for dQ_i += dS K_j (and grid: dK_j)
        if name == "dkdv_atomic" and cfg.bulk_dq:
            put("dq", cfg.block_m * cfg.d_pad * 2)  # bulk_dq: dQ_i in float32, each warp's part in fragment order
    elif name == "dq":
        put("q", cfg.block_n * P)  # Q_i: the block's queries
        put("do", cfg.block_n * P)  # dO_i
        put("k", 2 * cfg.block_m * P)  # K_j: two buffers
        put("v", 2 * cfg.block_m * P)  # V_j: two buffers
    else:
        raise ValueError(f"unknown kernel {name!r}; expected one of {KERNELS}")
    offs["end"] = end
    return offs


def shared_bytes(cfg: TCBackwardConfig, name: str = "dkdv_atomic") -> int:
    """Dynamic shared memory of one block of kernel ``name`` (bytes)."""
    return shared_offsets(cfg, name)["end"] * 2


# ----------------------------------------------------------------------------
# Device building blocks shared by the two kernels
# ----------------------------------------------------------------------------


def _make_tile_copier(rows: int, cfg: TCBackwardConfig):
    """``copy(smem, offset, src, b, h, start, seqlen, tid)``: ``cp.async`` rows ``[start, start + rows)``
    of ``src[b, h]`` to ``smem[offset + r·PITCH]``, rows past ``seqlen`` and the columns from D to
    ``cfg.d_smem`` zero-filled — the tensor-core tile copy of :func:`nbflash._tiles.make_tc_tile_copier`."""
    return make_tc_tile_copier(rows, cfg.threads, cfg.head_dim, cfg.d_smem // 8, make_padded_offset(cfg.pitch))


def _make_fragment_ops(input_kind: str):
    """Two device functions on accumulator arrays ``acc[tile, 0..3]`` (one 16×8 tile per row of ``acc``).

    * ``mma_into(acc, n, a0, a1, a2, a3, b0, b1)``: ``acc[n] += A·B`` (one ``mma.m16n8k16``);
    * ``pack_pair(acc, n, i)``: ``acc[n, i]``, ``acc[n, i + 1]`` — one row, two adjacent columns —
      rounded to 16 bits and packed into one A-fragment register.
    """
    if input_kind == "float16":
        mma, pack = I.mma_m16n8k16_f16, I.pack_f16x2
    else:
        mma, pack = I.mma_m16n8k16_bf16, I.pack_bf16x2

    def mma_into(acc, n, a0, a1, a2, a3, b0, b1):
        d = mma(a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
        for i in range(4):
            acc[n, i] = d[i]

    def pack_pair(acc, n, i):
        return pack(acc[n, i], acc[n, i + 1])

    return device_function(mma_into), device_function(pack_pair)


@device_function
def load_fragments(frags, smem, row_address, steps):
    """``frags[kk] =`` the A fragment of a warp's 16 rows of a shared tile (K_j or V_j in the dK/dV kernel,
    Q_i or dO_i in the dQ kernel) for the k-steps ``kk < steps`` from ``row_address`` (this lane's
    ``ldmatrix`` address): one ``ldmatrix.x4`` each, all before the products that use them, so that NVVM
    unrolls those products (with each k-step's load inside the nest, it kept them as loops)."""
    for kk in range(steps):
        f = I.ldmatrix_x4(smem, row_address + 16 * kk)
        for i in range(4):
            frags[kk, i] = f[i]


def _make_row_product(groups: int, group: int, held: bool, b_tiles: int, pitch: int, mma_into):
    """``row_product(acc, frags, smem, a_address, b_address)``: ``acc += A Bᵀ`` over every k-step of the shared
    columns, for a warp's 16 rows A of one shared tile against ``16 · b_tiles`` rows B of another — Sᵀ = K_j Q_iᵀ
    and dPᵀ = V_j dO_iᵀ in the dK/dV kernel, S = Q_i K_jᵀ and dP = dO_i V_jᵀ in the dQ kernel.

    ``frags`` holds A's fragments: all ``groups · group`` k-steps when ``held`` (loaded once by the caller),
    else one group of ``group`` k-steps, loaded here from ``a_address`` (this lane's ``ldmatrix`` address of
    the warp's rows) before that group's products.  B's fragments come by ``ldmatrix`` (no transpose) from
    ``b_address`` (this lane's address in B's first 16 rows), each feeding two 16×8 tiles of ``acc``.
    """

    def row_product(acc, frags, smem, a_address, b_address):
        for grp in range(groups):
            k0 = group * grp  # the group's first k-step
            if not held:
                # (With one group the address is spelt without the loop index: with it, NVVM placed the lane
                # arithmetic differently and ptxas spilled 16 bytes in the dK/dV kernel at D = 96.)
                load_fragments(frags, smem, a_address if groups == 1 else a_address + 16 * k0, group)
            for kg in range(group):
                kk = k0 + kg
                kr = kk if held else kg
                a0, a1, a2, a3 = frags[kr, 0], frags[kr, 1], frags[kr, 2], frags[kr, 3]
                for n2 in range(b_tiles):
                    bf = I.ldmatrix_x4(smem, b_address + 16 * n2 * pitch + 16 * kk)
                    for half in range(2):
                        mma_into(acc, 2 * n2 + half, a0, a1, a2, a3, bf[2 * half], bf[2 * half + 1])

    return device_function(row_product)


def _make_tile_product(m_tiles: int, n_pairs: int, k_steps: int, a_trans: bool, b_trans: bool, a_steps, b_steps,
                       mma_into):
    """``tile_product(acc, af, smem, a_address, b_address)``: ``acc += A B`` for one warp's tile of
    ``16 · m_tiles`` rows × ``16 · n_pairs`` columns over ``k_steps`` k-steps of 16, both operands in shared
    memory — every product of the grid-layout dK/dV kernel.

    ``acc[m · 2n_pairs + n]`` is the 16×8 accumulator tile of rows ``16m ..``, columns ``8n ..``.  ``a_address``
    (``b_address``) is this lane's ``ldmatrix`` address of A's first 16-row tile (B's first 16 columns) at
    k-step 0: by :func:`~nbflash.intrinsics.ldmatrix_x4` from the rows of A stored row-major (the lane address of
    ``d_ldmatrix_x4_a_address``), or with ``a_trans`` by ``ldmatrix_x4_trans`` from A stored k-major (the
    address of ``d_ldmatrix_x4_bt_address``); B by ``ldmatrix_x4`` from Bᵀ stored n-major (``bt`` address) or
    with ``b_trans`` by ``ldmatrix_x4_trans`` from B stored k-major (``a`` address).  ``a_steps`` = (elements
    to A's next 16 rows, to its next k-step), ``b_steps`` = (to B's next 16 columns, to its next k-step).
    Per k-step: ``m_tiles + n_pairs`` ``ldmatrix.x4`` feed ``2 · m_tiles · n_pairs`` mma — the warp tile's
    shape sets the shared-memory traffic per mma; ``af`` holds the step's A fragments (``m_tiles`` rows).

    The k-steps are unrolled here, in Python: one device function per k-step (its offsets constants),
    called in order.  As a loop over the k-steps, with the loads inside, NVVM kept it rolled (56 of the
    kernel's 320 mma in the PTX at D = 128), each step's ``ldmatrix`` just before the mma that wait for it.
    The steps and the chain are inlined by NVVM, not by Numba (``nvvm_inline``): Numba's IR inlining copied
    the chain's IR at every link, and the kernel took 68 s to compile at D = 128 instead of 27 s (offline, on
    one CPU core), for the same PTX.
    """
    A_ROW, A_K = a_steps
    B_COL, B_K = b_steps
    N_TILES = 2 * n_pairs

    def k_step(kk):
        def one_step(acc, af, smem, a_address, b_address):
            for m in range(m_tiles):
                a_at = a_address + m * A_ROW + kk * A_K
                f = I.ldmatrix_x4_trans(smem, a_at) if a_trans else I.ldmatrix_x4(smem, a_at)
                for i in range(4):
                    af[m, i] = f[i]
            for n2 in range(n_pairs):
                b_at = b_address + n2 * B_COL + kk * B_K
                bf = I.ldmatrix_x4_trans(smem, b_at) if b_trans else I.ldmatrix_x4(smem, b_at)
                for half in range(2):
                    for m in range(m_tiles):
                        mma_into(acc, m * N_TILES + 2 * n2 + half, af[m, 0], af[m, 1], af[m, 2], af[m, 3],
                                 bf[2 * half], bf[2 * half + 1])

        return device_function(one_step, nvvm_inline=True)

    def then(first, second):
        def both(acc, af, smem, a_address, b_address):
            first(acc, af, smem, a_address, b_address)
            second(acc, af, smem, a_address, b_address)

        return device_function(both, nvvm_inline=True)

    return functools.reduce(then, (k_step(kk) for kk in range(k_steps)))


def _make_transposed_gradients(m_tiles: int, n_tiles: int):
    """``transposed_gradients(S, dP, smem_f, lse_at, delta_at, key_g, query_t, masked, seqlen_q, seqlen_k, causal,
    scale_log2)``: steps 1c–1d in place on a warp's accumulators of ``16 · m_tiles`` keys × ``8 · n_tiles``
    queries (``S[m · n_tiles + n]`` as in :func:`_make_tile_product`): Sᵀ becomes
    ``Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_col)``, zero at invisible pairs, and dPᵀ becomes
    ``dSᵀ = Pᵀ ∘ (dPᵀ − D_col)``.

    Value i of tile (m, n) is key ``key_g + 16m + 8(i >> 1)`` (``key_g``: the key of the thread's row g in
    the first tile) and query ``query_t + 8n + (i & 1)`` (``query_t``: the query of its column 2t), so lse2
    and D are per *column*, read from ``smem_f[lse_at + 8n + (i & 1)]`` (``delta_at`` likewise).  ``masked``:
    the block's tile pair needs the mask (:func:`~nbflash.masking.d_tile_needs_mask`); each key's visible columns
    (:func:`~nbflash.masking.d_key_columns`) are then computed here, on the few masked tiles.
    """
    u64 = numba.uint64
    ZERO = numba.float32(0)
    I32 = int if SIMULATOR else numba.int32  # the mask's compares in 32 bits (the simulator: Python ints, faster)

    def transposed_gradients(S, dP, smem_f, lse_at, delta_at, key_g, query_t, masked, seqlen_q, seqlen_k, causal,
                             scale_log2):
        for n in range(n_tiles):
            for c in range(2):
                lse2_c = smem_f[lse_at + u64(8 * n + c)]
                for m in range(m_tiles):
                    for r in range(2):
                        x = m * n_tiles + n
                        S[x, 2 * r + c] = I.ex2_approx(S[x, 2 * r + c] * scale_log2 - lse2_c)
        if masked:
            for m in range(m_tiles):
                for r in range(2):
                    # Key key_g + 16m + 8r is seen by this thread's columns 8n + c in [lo, hi) (masking.key_columns),
                    # as 32 bits, so that each test below is two 32-bit compares (a 64-bit compare is two ISETP).
                    first, past = d_key_columns(key_g + 16 * m + 8 * r, query_t, 8 * n_tiles, seqlen_q, seqlen_k,
                                                causal)
                    lo, hi = I32(first), I32(past)
                    for n in range(n_tiles):
                        for c in range(2):
                            if (I32(8 * n + c) < lo) | (I32(8 * n + c) >= hi):  # past a ragged end, above the diagonal
                                S[m * n_tiles + n, 2 * r + c] = ZERO
        for n in range(n_tiles):
            for c in range(2):
                delta_c = smem_f[delta_at + u64(8 * n + c)]
                for m in range(m_tiles):
                    for r in range(2):
                        x = m * n_tiles + n
                        dP[x, 2 * r + c] = S[x, 2 * r + c] * (dP[x, 2 * r + c] - delta_c)

    return device_function(transposed_gradients)


def _make_pair_storer(input_kind: str):
    """``store_pair(out, b, h, row, col, x, y)``: ``out[b, h, row, col : col + 2] = x, y`` in the input type.

    bfloat16 is rounded by one ``cvt.rn.bf16x2.f32`` per pair (as in the forward's
    epilogue), which gives the bits of :func:`~nbflash._tiles.make_storer`'s
    round-to-nearest-even for every non-NaN value in far fewer instructions: done
    one value at a time, in 64-bit integer arithmetic, the rounding of the 128
    dK, dV accumulators at D = 128 made ptxas spill.
    """
    if input_kind == "float16":
        to_out = make_storer(input_kind)

        def store_pair(out, b, h, row, col, x, y):
            out[b, h, row, col] = to_out(x)
            out[b, h, row, col + 1] = to_out(y)

    else:

        def store_pair(out, b, h, row, col, x, y):
            w = I.pack_bf16x2(x, y)  # x in the low half
            out[b, h, row, col] = numba.uint16(w & 0xFFFF)
            out[b, h, row, col + 1] = numba.uint16(w >> 16)

    return device_function(store_pair)


def _make_dkdv_storer(cfg: TCBackwardConfig, m_tiles: int, n_tiles: int):
    """``store_dkdv(dk, dv, dK, dV, b, h, key_g, col0, t, seqlen_k, scale)``: a dK/dV kernel's last step for a
    warp's accumulators of ``16 · m_tiles`` keys × ``8 · n_tiles`` columns (tile ``m · n_tiles + n`` as in
    :func:`_make_tile_product`): ``dk = dK · scale`` and ``dv = dV`` in the input type, rows from key
    ``key_g`` (the key of the thread's row g), columns ``col0 + 8n + 2t`` and the next; keys past
    ``seqlen_k`` and tiles of head-dim padding are not written (D is a multiple of 8: a tile is data or
    padding)."""
    D, PADDED = cfg.head_dim, cfg.d_smem > cfg.head_dim
    store_pair = _make_pair_storer(cfg.input_kind)

    def store_dkdv(dk, dv, dK, dV, b, h, key_g, col0, t, seqlen_k, scale):
        for m in range(m_tiles):
            for r in range(2):
                key = key_g + 16 * m + 8 * r
                if key < seqlen_k:
                    for n in range(n_tiles):
                        if PADDED and col0 + 8 * n >= D:
                            continue  # head-dim padding
                        col = col0 + 8 * n + 2 * t
                        x = m * n_tiles + n
                        store_pair(dk, b, h, key, col, dK[x, 2 * r] * scale, dK[x, 2 * r + 1] * scale)
                        store_pair(dv, b, h, key, col, dV[x, 2 * r], dV[x, 2 * r + 1])

    return device_function(store_dkdv)


@functools.cache
def _make_staged_writer(cfg: TCBackwardConfig, rows: int, m_tiles: int, n_tiles: int):
    """``(stage, store)``: a kernel's last step through shared memory (``staged_out``), for a block of ``rows``
    gradient rows × its slice of columns.

    ``stage(smem32, offset, acc, sc, row_g, col_l0, t)`` packs a warp's accumulators ``acc · sc`` (``16 · m_tiles``
    rows from ``row_g``, the tile-local row of the thread's g, × ``8 · n_tiles`` columns from the slice-local
    ``col_l0``; tile ``m · n_tiles + n`` as in :func:`_make_tile_product`) into the tile at element ``offset``,
    rows :attr:`~TCBackwardConfig.pitch` apart, the layout the tile's copies used
    (:func:`~nbflash._tiles.make_pair_stager`).  ``store(smem, offset, dst, b, h, start, seqlen, tid, c0)`` then
    writes the tile's rows to rows ``start ...`` of ``dst[b, h]``, columns ``c0 ...``, in whole 16-byte chunks by
    every thread of the block (:func:`~nbflash._tiles.make_tc_tile_storer`; rows past ``seqlen`` and head-dim
    padding skipped).  The caller meets the block before staging (nothing reads the tile any more) and between
    the two (every warp's rows are in place)."""
    PITCH, SLICED = cfg.pitch, cfg.slices > 1
    stage = make_pair_stager(cfg.input_kind, PITCH, m_tiles, n_tiles)
    rows_of = make_tc_tile_storer(rows, cfg.threads, cfg.head_dim, make_padded_offset(PITCH),
                                  slice_cols=cfg.slice_cols if SLICED else 0)

    if SLICED:
        return stage, rows_of

    @device_function
    def store(smem, offset, dst, b, h, start, seqlen, tid, c0):
        rows_of(smem, offset, dst, b, h, start, seqlen, tid)

    return stage, store


def _make_dq_adder(cfg: TCBackwardConfig, m_tiles: int, n_tiles: int):
    """``add_dq(dQ, dq_cols, dq_row_bytes, row_g, col0, seqlen_q)``: step 1g's addition of a warp's dQ
    accumulators (``16 · m_tiles`` queries from ``row_g``, the query of the thread's row g, × ``8 · n_tiles``
    columns from ``col0``) into the float32 accumulator: one address per row (``dq_cols``: the byte address
    of ``dq_accum[b, h, 0, 2t]``), then a reduction per accumulator pair at a constant offset from it — one
    ``red.global.add.v2.f32`` with ``cfg.vector_red`` (sm_90), else two scalar ones.  Rows past
    ``seqlen_q`` and tiles of head-dim padding are skipped (dq_accum has D columns)."""
    D, PADDED, VECTOR_RED = cfg.head_dim, cfg.d_smem > cfg.head_dim, cfg.vector_red
    TILE_BYTES = 8 * 4  # float32 dQ: from a column of one 8-column tile to the same column of the next

    def add_dq(dQ, dq_cols, dq_row_bytes, row_g, col0, seqlen_q):
        for m in range(m_tiles):
            for r in range(2):
                row = row_g + 16 * m + 8 * r
                if row < seqlen_q:
                    addr = dq_cols + row * dq_row_bytes + 4 * col0
                    for n in range(n_tiles):
                        if PADDED and col0 + 8 * n >= D:
                            continue  # head-dim padding
                        x = m * n_tiles + n
                        if VECTOR_RED:
                            I.red_add_f32x2(addr + n * TILE_BYTES, dQ[x, 2 * r], dQ[x, 2 * r + 1])
                        else:
                            I.red_add_f32(addr + n * TILE_BYTES, dQ[x, 2 * r])
                            I.red_add_f32(addr + n * TILE_BYTES + 4, dQ[x, 2 * r + 1])

    return device_function(add_dq)


def dq_tile_position(tiles: DQTiles):
    """The bulk accumulator's layout (``cfg.dq_tiles``): ``position(r, c)``, where query ``r`` (< ``tiles.rows``),
    column ``c`` (< ``tiles.d_pad``) of a query tile's dQ_i lies among the tile's ``rows · d_pad`` float32 values.

    A query tile is one contiguous run (rows ``q_start .. q_start + rows`` of a ``(B, H, N_q padded to whole
    tiles, d_pad)`` array), so that each warp's part of it, written by the warp to shared memory in the same
    order, is one contiguous run too and one bulk reduction adds it (FlashAttention-3 keeps its dQ accumulator
    in the MMA's fragment order for the same reason).  The parts are numbered row-major over the tile's
    ``rows / R × d_pad / C`` grid of warp tiles (``tiles.warp_tile = (R, C)``); inside one, value ``i`` of lane
    ``lane``'s accumulator tile ``n`` (16 × 8, the mma's C fragment, which is also a warp's slice of a wgmma
    accumulator: row ``g + 8(i >> 1)``, column ``2t + (i & 1)`` with ``g, t = lane >> 2, lane & 3``; tiles
    ``n`` row-major over the part's 16 × 8 tiles) is at ``(4n + i) · 32 + lane``, so a warp's 32 stores of one
    (n, i) are 128 consecutive bytes: no bank conflict.
    """
    R, C = tiles.warp_tile
    WDQ = tiles.d_pad // C  # parts across the columns
    N8 = C // 8  # 8-column accumulator tiles across a part's columns

    def position(r, c):
        part = (r // R) * WDQ + c // C
        rw, cw = r % R, c % C  # the part's query and column
        n = (rw // 16) * N8 + cw // 8
        lane = 4 * (rw % 8) + (cw % 8) // 2
        i = 2 * ((rw % 16) // 8) + cw % 2
        return part * R * C + (4 * n + i) * 32 + lane

    return position


def _make_dq_bulk_adder(tiles: DQTiles, stage: int, pending: int = 0):
    """Bulk dQ: ``add_dq_bulk(dQ, smem_f, tile_address, part, lane)`` adds a warp's dQ accumulators (part ``part``
    of a query tile laid out as :func:`dq_tile_position`, ``tiles.warp_tile`` values) into the query tile of the
    float32 accumulator that starts at byte address ``tile_address``, through the same part of a shared staging
    tile (float32 offset ``stage`` of ``smem_f``) and the bulk copy engine:

    1. the warp waits until the copy engine has read what lane 0 handed over from this part last time (one
       tile of work ago, so it is long done; ``pending``: the bulk groups lane 0 has committed since then,
       which may still read), and syncs: no lane overwrites the staging before that;
    2. every lane stores its values and fences them to the async proxy, and the warp syncs;
    3. lane 0 starts one ``cp.reduce.async.bulk .add.f32`` of the warp's whole part, one group.

    No branch: every lane executes the wait and the commit (the other lanes have no group, so theirs return at
    once and close empty ones), and the reduction is predicated on ``lane == 0``
    (:func:`~nbflash.hopper.bulk_reduce_add_f32_where`).  A branch around lane 0's instructions, between a
    wgmma's issue and its wait, made ptxas serialise the wgmma kernels' products (its C7514).

    Only the warp's own lanes touch its part, so no block barrier is involved.  Rows past ``seqlen_q`` and
    columns of padding are added too — into the accumulator's padding, which step 2' does not read.  Before the
    kernel exits, lane 0 waits until the copy engine has read the last group (``bulk_wait_group_read(0)``).
    """
    R, C = tiles.warp_tile
    TILES = R * C // 128  # 16 × 8 accumulator tiles of a warp
    WARP_VALUES = R * C

    def add_dq_bulk(dQ, smem_f, tile_address, part, lane):
        at = stage + part * WARP_VALUES
        H.bulk_wait_group_read(pending)  # the copy engine has read this part's previous dQ_i (lane 0's groups) ...
        syncwarp()  # ... before any lane of the warp overwrites it
        mine = numba.uint64(at + lane)  # unsigned: no negative-index test per store (it cost registers)
        for n in range(TILES):
            for i in range(4):
                smem_f[mine + numba.uint64((4 * n + i) * 32)] = dQ[n, i]
        H.fence_proxy_async()  # my stores, visible to the copy engine (the async proxy) ...
        syncwarp()  # ... and every lane's, before lane 0 hands the part over
        H.bulk_reduce_add_f32_where(lane == 0, tile_address + 4 * part * WARP_VALUES, smem_f, at, 4 * WARP_VALUES)
        H.bulk_commit_group()

    return device_function(add_dq_bulk)


def _make_query_stream(cfg: TCBackwardConfig, name: str):
    """Steps 1 and 1a of both dK/dV kernels, the copies of the streamed query tiles (layout of ``name``):

    * ``first_tile(smem, smem_f, q, k, v, do, lse2, delta, b, h, k_start, seqlen_q, seqlen_k, causal, tid)``:
      the block's range of query tiles (:func:`~nbflash.masking.d_query_range`) as ``(i_first, n_tiles)``,
      after starting one ``cp.async`` group with K_j, V_j and tile ``i_first``'s Q, dO, lse2 and D;
    * ``next_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start, it, n_tiles, seqlen_q, tid)``: one group
      with tile ``it + 1``'s into the other buffers (empty after the last tile) — to be called only after the
      barrier that ends every warp's use of those buffers.

    lse2 and D travel as 4-byte ``cp.async`` copies.  A row past ``seqlen_q`` gets 0, not lse2's +inf: its
    Q and dO rows are zero-filled, so its Pᵀ column is exp2(0) = 1 but dPᵀ is 0, and it adds nothing to
    dV (P·dO = 0), dSᵀ, dK or dQ.
    """
    BLOCK_M, BLOCK_N, THREADS = cfg.block_m, cfg.block_n, cfg.threads
    off = shared_offsets(cfg, name)
    K_OFF, V_OFF, Q_OFF, DO_OFF = off["k"], off["v"], off["q"], off["do"]
    LSE_F, DELTA_F = off["lse2"] // 2, off["delta"] // 2  # float32 offsets of the lse2 and D buffers
    QD_STRIDE = BLOCK_M * cfg.pitch  # elements from one Q (or dO) buffer to the other
    copy_kv = _make_tile_copier(BLOCK_N, cfg)
    copy_q = _make_tile_copier(BLOCK_M, cfg)

    @device_function
    def copy_row_values(smem_f, offset, src, b, h, start, seqlen, tid):
        """``src[b, h, start : start + BLOCK_M]`` (lse2 or D of a query tile) to ``smem_f[offset:]``."""
        for c in range(tid, BLOCK_M, THREADS):
            row = start + c
            inside = row < seqlen
            I.cp_async_4(smem_f, offset + c, src, (b, h, row if inside else seqlen - 1), 4 if inside else 0)

    @device_function
    def copy_query_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start, buf, seqlen_q, tid):
        copy_q(smem, Q_OFF + buf * QD_STRIDE, q, b, h, q_start, seqlen_q, tid)
        copy_q(smem, DO_OFF + buf * QD_STRIDE, do, b, h, q_start, seqlen_q, tid)
        copy_row_values(smem_f, LSE_F + buf * BLOCK_M, lse2, b, h, q_start, seqlen_q, tid)
        copy_row_values(smem_f, DELTA_F + buf * BLOCK_M, delta, b, h, q_start, seqlen_q, tid)

    @device_function
    def first_tile(smem, smem_f, q, k, v, do, lse2, delta, b, h, k_start, seqlen_q, seqlen_k, causal, tid):
        q_begin, q_end = d_query_range(k_start, BLOCK_N, seqlen_q, seqlen_k, causal)
        i_first = q_begin // BLOCK_M
        n_tiles = (q_end + BLOCK_M - 1) // BLOCK_M - i_first
        if n_tiles > 0:
            copy_kv(smem, K_OFF, k, b, h, k_start, seqlen_k, tid)
            copy_kv(smem, V_OFF, v, b, h, k_start, seqlen_k, tid)
            copy_query_tile(smem, smem_f, q, do, lse2, delta, b, h, i_first * BLOCK_M, 0, seqlen_q, tid)
        I.cp_async_commit()
        return i_first, n_tiles

    @device_function
    def next_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start, it, n_tiles, seqlen_q, tid):
        if it + 1 < n_tiles:
            copy_query_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start + BLOCK_M, 1 - it % 2, seqlen_q, tid)
        I.cp_async_commit()

    return first_tile, next_tile


# ----------------------------------------------------------------------------
# Step 1: dK_j, dV_j (and, atomically, dQ), parallel over key tiles
# ----------------------------------------------------------------------------


@functools.cache
def dkdv_tc_kernel(cfg: TCBackwardConfig, atomic_dq: bool = False):
    """The compiled dK/dV kernel (step 1) for one configuration (cached); ``atomic_dq`` adds step 1g."""
    if cfg.grid:
        return _dkdv_grid_kernel(cfg, atomic_dq)
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    WARPS, PITCH, DS_PITCH = cfg.warps, cfg.pitch, cfg.ds_pitch
    SLICES, SLICE = cfg.slices, cfg.slice_cols  # blocks per key tile, and the gradient columns of each
    KV_IN_REGS, ATOMIC_DQ = cfg.kv_in_registers, atomic_dq
    off = shared_offsets(cfg, "dkdv_atomic" if atomic_dq else "dkdv")
    K_OFF, V_OFF, Q_OFF, DO_OFF, DS_OFF = off["k"], off["v"], off["q"], off["do"], off.get("ds", 0)
    QD_STRIDE = BLOCK_M * PITCH  # elements from one Q (or dO) buffer to the other
    LSE_F, DELTA_F = off["lse2"] // 2, off["delta"] // 2  # float32 offsets of the lse2 and D buffers
    # Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: k-steps over the shared columns, in groups of one slice's width (the K or V
    # fragments of one group are loaded before its products; one group when there is one slice).
    GROUP = SLICE // 16 if SLICES > 1 else cfg.d_pad // 16
    GROUPS = SLICES
    K_STEPS = GROUP * GROUPS
    Q_TILES = BLOCK_M // 8  # 8-query column tiles of Sᵀ, dPᵀ
    D_TILES = SLICE // 8  # 8-wide column tiles of the block's slice of dK, dV
    M_STEPS = BLOCK_M // 16  # k-steps of dV += Pᵀ dO, dK += dSᵀ Q
    N_STEPS = BLOCK_N // 16  # k-steps of dQ += dS K
    # Step 1g: the BLOCK_M × SLICE block of dQ_i (the block's columns) is cut into units of 16 queries ×
    # DQ_CHUNK columns, dealt round-robin to the warps.  DQ_CHUNK is a multiple of 16 (one mma is 8
    # columns, an ldmatrix.trans of K_j 16) that divides SLICE, as wide as still gives every warp a unit
    # where the tiles allow: D = 80 with 4 warps and 32 queries is 5 chunks of 16, not 2 of 40.
    D16 = SLICE // 16
    want = min(D16, max(1, WARPS // M_STEPS))  # chunks per 16 queries that would keep every warp busy
    DQ_CHUNKS = next(c for c in range(want, D16 + 1) if D16 % c == 0)  # ... rounded up to a divisor of D / 16
    DQ_CHUNK = SLICE // DQ_CHUNKS
    DQ_TILES = DQ_CHUNK // 8  # 8-wide column tiles of one unit
    DQ_UNITS = M_STEPS * DQ_CHUNKS
    DQ_ROUNDS = -(-DQ_UNITS // WARPS)
    DQ_EVEN = DQ_UNITS % WARPS == 0
    ZERO = numba.float32(0)
    u32, u64 = numba.uint32, numba.uint64
    SMEM_ALIGN = None if SIMULATOR else 16
    mma_into, pack_pair = _make_fragment_ops(cfg.input_kind)
    first_tile, next_tile = _make_query_stream(cfg, "dkdv_atomic" if atomic_dq else "dkdv")
    store_dkdv, add_dq = _make_dkdv_storer(cfg, 1, D_TILES), _make_dq_adder(cfg, 1, DQ_TILES)
    STAGED_OUT = cfg.staged_out
    stage, store_rows = _make_staged_writer(cfg, BLOCK_N, 1, D_TILES)
    row_product = _make_row_product(GROUPS, GROUP, KV_IN_REGS, M_STEPS, PITCH, mma_into)
    transposed_gradients = _make_transposed_gradients(1, Q_TILES)
    block_tile = cfg.block_tile(BLOCK_N)

    @kernel(fastmath=True)
    def flash_backward_dkdv_tc(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, scale, causal):
        """One block: dK_j and dV_j for BLOCK_N keys of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        # The block's keys (the first key tiles have the most causal queries: they start first) and its first
        # gradient column.
        k_start, c0 = block_tile()
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))  # known ≥ 0: no sign fix-ups in // and % below
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this thread's rows of every fragment: keys g and g + 8 of the warp ...
        t = lane % 4  # ... and columns 2t, 2t + 1 of every 8-column tile
        # One block of dynamic shared memory, seen three ways: 16-bit tiles, packed pairs of dSᵀ, float32 lse2/D.
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, numba.float32, alignment=SMEM_ALIGN)

        kf = cuda.local.array((K_STEPS if KV_IN_REGS else GROUP, 4), numba.uint32)  # K_j A-fragments
        vf = cuda.local.array((K_STEPS if KV_IN_REGS else GROUP, 4), numba.uint32)  # V_j A-fragments
        S = cuda.local.array((Q_TILES, 4), numba.float32)  # Sᵀ, then Pᵀ
        dP = cuda.local.array((Q_TILES, 4), numba.float32)  # dPᵀ, then dSᵀ
        dK = cuda.local.array((D_TILES, 4), numba.float32)
        dV = cuda.local.array((D_TILES, 4), numba.float32)
        dQ = cuda.local.array((DQ_TILES, 4), numba.float32)  # step 1g: one unit of dQ_i
        dsf = cuda.local.array((N_STEPS, 4), numba.uint32)  # step 1g: the unit's dS A-fragments
        for n in range(D_TILES):
            for i in range(4):
                dK[n, i] = ZERO
                dV[n, i] = ZERO
        scale_log2 = numba.float32(qk_scale_log2)

        # ldmatrix addresses of this lane inside a 16×16 tile (see nbflash.intrinsics).
        a_row, a_col = I.d_ldmatrix_x4_a_address(lane)  # K, V rows (A); dO, Q, K rows (.trans → B)
        bt_row, bt_col = I.d_ldmatrix_x4_bt_address(lane)  # Q, dO rows (→ B of Sᵀ, dPᵀ); dSᵀ (.trans → A)
        k_row = K_OFF + (16 * warp + a_row) * PITCH + a_col  # this lane's address in the warp's K rows
        v_row = V_OFF + (16 * warp + a_row) * PITCH + a_col
        # Step 1g's global byte address of dq_accum[b, h, 0, 2t], and the bytes from one query row to the next
        # (unused in the deterministic kernel, whose dq_accum is a dummy).
        dq_cols = I.global_address(dq_accum, (b, h, 0, 2 * t))
        dq_row_bytes = dq_accum.strides[2]

        # Step 1: K_j, V_j and the first Q_i, dO_i with its lse2, D: one cp.async group.
        i_first, n_tiles = first_tile(smem, smem_f, q, k, v, do, lse2, delta, b, h, k_start, seqlen_q, seqlen_k,
                                      causal, tid)

        for it in range(n_tiles):
            q_start = (i_first + it) * BLOCK_M
            buf = it % 2
            I.cp_async_wait_all()  # this thread's copies of tile i, started one tile earlier (or by step 1)
            # Every thread's copies of tile i (and K_j, V_j) and its lse2, D are visible, and every warp is done
            # with tile i - 1, whose buffers step 1a refills: one barrier per tile.
            cuda.syncthreads()
            # Step 1a: start the copy of Q_{i+1}, dO_{i+1} and their lse2, D into the other buffers, under this
            # tile's products.
            next_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start, it, n_tiles, seqlen_q, tid)

            # The warp's 16 rows of K_j and V_j into registers, once.
            if KV_IN_REGS and it == 0:
                load_fragments(kf, smem, k_row, K_STEPS)
                load_fragments(vf, smem, v_row, K_STEPS)

            # Step 1b: Sᵀ = K_j Q_iᵀ (16 keys × BLOCK_M queries per warp); 1d's dPᵀ = V_j dO_iᵀ likewise.
            # Two loop nests, not one: NVVM unrolls each of them fully (a fused one it would not).
            q_base = Q_OFF + buf * QD_STRIDE
            do_base = DO_OFF + buf * QD_STRIDE
            for n in range(Q_TILES):
                for i in range(4):
                    S[n, i] = ZERO
                    dP[n, i] = ZERO
            # With several slices, K_j's (V_j's) fragments are loaded one slice's width of k-steps at a time.
            row_product(S, kf, smem, k_row, q_base + bt_row * PITCH + bt_col)
            row_product(dP, vf, smem, v_row, do_base + bt_row * PITCH + bt_col)

            # Step 1c: Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_col).  Value i of tile n: key g + 8(i >> 1),
            # query 8n + 2t + (i & 1).  Step 1d: dSᵀ = Pᵀ ∘ (dPᵀ − D_col), kept in dP.
            masked = d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal)
            cols_at = buf * BLOCK_M + 2 * t  # lse2, D of query 2t in this tile's buffers
            transposed_gradients(S, dP, smem_f, u64(LSE_F + cols_at), u64(DELTA_F + cols_at), k_start + 16 * warp + g,
                                 q_start + 2 * t, masked, seqlen_q, seqlen_k, causal, scale_log2)

            # Step 1e: dV_j += Pᵀ dO_i.  The A-fragment of queries 16kk .. 16kk + 15 is accumulator
            # tiles 2kk, 2kk + 1 packed (rows g, g + 8; columns 2t, 2t + 1).
            for kk in range(M_STEPS):
                pa0 = pack_pair(S, 2 * kk, 0)  # key g,     queries 2t, 2t + 1
                pa1 = pack_pair(S, 2 * kk, 2)  # key g + 8, queries 2t, 2t + 1
                pa2 = pack_pair(S, 2 * kk + 1, 0)  # key g,     queries 8 + 2t, 8 + 2t + 1
                pa3 = pack_pair(S, 2 * kk + 1, 2)  # key g + 8, queries 8 + 2t, 8 + 2t + 1
                for d2 in range(D_TILES // 2):
                    ob = I.ldmatrix_x4_trans(smem, do_base + (16 * kk + a_row) * PITCH + c0 + 16 * d2 + a_col)
                    for half in range(2):
                        mma_into(dV, 2 * d2 + half, pa0, pa1, pa2, pa3, ob[2 * half], ob[2 * half + 1])
            # Step 1f: dK_j += dSᵀ Q_i, dSᵀ packed the same way.
            for kk in range(M_STEPS):
                sa0 = pack_pair(dP, 2 * kk, 0)
                sa1 = pack_pair(dP, 2 * kk, 2)
                sa2 = pack_pair(dP, 2 * kk + 1, 0)
                sa3 = pack_pair(dP, 2 * kk + 1, 2)
                for d2 in range(D_TILES // 2):
                    qb = I.ldmatrix_x4_trans(smem, q_base + (16 * kk + a_row) * PITCH + c0 + 16 * d2 + a_col)
                    for half in range(2):
                        mma_into(dK, 2 * d2 + half, sa0, sa1, sa2, sa3, qb[2 * half], qb[2 * half + 1])
                if ATOMIC_DQ:  # the same packed dSᵀ registers, to the shared [key][query] tile (32-bit stores)
                    ds_row = u64(DS_OFF + (16 * warp + g) * DS_PITCH + 16 * kk + 2 * t) // u64(2)
                    smem32[ds_row] = sa0
                    smem32[ds_row + u64(4 * DS_PITCH)] = sa1  # 8 rows down: 8 · DS_PITCH / 2 words
                    smem32[ds_row + u64(4)] = sa2  # 8 columns right: 4 words
                    smem32[ds_row + u64(4 * DS_PITCH + 4)] = sa3

            if ATOMIC_DQ:
                cuda.syncthreads()  # step 1g reads whole columns of dSᵀ, written by every warp
                # Step 1g: dQ_i += dS K_j, one unit of 16 queries × DQ_CHUNK columns at a time.
                for rnd in range(DQ_ROUNDS):
                    unit = warp + WARPS * rnd
                    if DQ_EVEN or unit < DQ_UNITS:  # the same for the whole warp: mma stays converged
                        mt = unit // DQ_CHUNKS  # the unit's 16 queries: 16mt ..
                        d0 = c0 + (unit % DQ_CHUNKS) * DQ_CHUNK  # ... and its columns d0 ..
                        for n in range(DQ_TILES):
                            for i in range(4):
                                dQ[n, i] = ZERO
                        # dS = (dSᵀ)ᵀ: ldmatrix.trans of the [key][query] tile gives the A-fragments, all of
                        # them before the products (as load_fragments, for the same reason).
                        for kk in range(N_STEPS):
                            f = I.ldmatrix_x4_trans(smem, DS_OFF + (16 * kk + bt_row) * DS_PITCH + 16 * mt + bt_col)
                            for i in range(4):
                                dsf[kk, i] = f[i]
                        for kk in range(N_STEPS):
                            for d2 in range(DQ_TILES // 2):
                                kb = I.ldmatrix_x4_trans(smem, K_OFF + (16 * kk + a_row) * PITCH + d0 + 16 * d2 + a_col)
                                for half in range(2):
                                    mma_into(
                                        dQ,
                                        2 * d2 + half,
                                        dsf[kk, 0],
                                        dsf[kk, 1],
                                        dsf[kk, 2],
                                        dsf[kk, 3],
                                        kb[2 * half],
                                        kb[2 * half + 1],
                                    )
                        # Add the unit into dQ_i (rows g, g + 8; columns 2t, 2t + 1 of each tile).
                        add_dq(dQ, dq_cols, dq_row_bytes, q_start + 16 * mt + g, d0, seqlen_q)

        I.cp_async_wait_all()  # nothing left in flight (also when no query tile sees these keys)

        # dK_j · scale and dV_j, written once.
        sc = numba.float32(scale)
        if STAGED_OUT:  # over the K_j, V_j tiles, then whole 16-byte chunks of rows
            cuda.syncthreads()  # every warp's last read of K_j, V_j (step 1g reads all of K_j) and copy are done
            stage(smem32, K_OFF, dK, sc, 16 * warp + g, 0, t)
            stage(smem32, V_OFF, dV, numba.float32(1), 16 * warp + g, 0, t)
            cuda.syncthreads()  # every warp's rows are staged before the block reads whole rows
            store_rows(smem, K_OFF, dk, b, h, k_start, seqlen_k, tid, c0)
            store_rows(smem, V_OFF, dv, b, h, k_start, seqlen_k, tid, c0)
        else:
            store_dkdv(dk, dv, dK, dV, b, h, k_start + 16 * warp + g, c0, t, seqlen_k, sc)

    return flash_backward_dkdv_tc


def _dkdv_grid_kernel(cfg: TCBackwardConfig, atomic_dq: bool):
    """Step 1 in FlashAttention-2's warp grid (``cfg.grid``): every product a 2-D warp tile from shared memory.

    In the register layout a warp owns 16 keys and all of every product's other side, so each ``ldmatrix``
    of a B operand feeds 2 mma (16 × 16 warp tiles in k-steps: 0.625 ``ldmatrix.x4`` per mma at D = 128,
    128 keys × 64 queries, atomic).  Here the ``WARPS`` warps form a ``WK × WC`` grid: warp (wk, wc) owns
    the ``KT`` 16-key tiles from key ``16 · KT · wk`` and, of Sᵀ and dPᵀ, the ``QP`` 16-query tiles from
    query ``16 · QP · wc``; of dK and dV the ``CP`` 16-column tiles from column ``16 · CP · wc``; of step
    1g's dQ_i (a ``WQ × WDQ`` grid) queries × columns again — 32 × 32 tiles at D = 128 (``warps_keys=4``,
    ``warps_dq_rows=2``): 0.45 ``ldmatrix.x4`` per mma.  The price: Pᵀ and dSᵀ leave the warp that computed them,
    through shared memory, and one more barrier per tile.  Per query tile i:

    a. wait for tile i's copies; barrier; start tile i + 1's (as in the register layout);
    b. ``Sᵀ = K_j Q_iᵀ``, ``dPᵀ = V_j dO_iᵀ`` on the warp's keys × queries;
    c–d. ``Pᵀ``, masked, and ``dSᵀ = Pᵀ ∘ (dPᵀ − D_col)`` (:func:`_make_transposed_gradients`), packed to
       16 bits into the shared ``[key][query]`` tiles Pᵀ and dSᵀ; barrier;
    e–f. ``dV_j += Pᵀ dO_i`` and ``dK_j += dSᵀ Q_i`` on the warp's keys × columns: A = rows of the shared
       Pᵀ (dSᵀ) by ``ldmatrix``, B = dO_i (Q_i) by ``ldmatrix.trans``;
    g. *atomic:* ``dQ_i += dS K_j`` on the warp's queries × columns, A = dS by ``ldmatrix.trans`` of dSᵀ,
       added into the float32 accumulator by ``red.global.add`` — or, with ``cfg.bulk_dq`` (sm_90), stored by
       each warp to its own part of a shared staging tile and added by the bulk copy engine, one
       ``cp.reduce.async.bulk`` per warp and tile, with no block barrier (:func:`_make_dq_bulk_adder`).
       With ``cfg.dq_before_dk`` step g comes between e and f (FlashAttention-2's order), so the dK product's
       mma issue while the reductions are in flight; with ``bulk_dq`` that measured +8–14 % on the H200.

    The next tile's first barrier ends every warp's reads of Pᵀ, dSᵀ and of tile i's buffers before either
    is written again.
    """
    BLOCK_M, BLOCK_N = cfg.block_m, cfg.block_n
    WARPS, PITCH, DS_PITCH = cfg.warps, cfg.pitch, cfg.ds_pitch
    ATOMIC_DQ = atomic_dq
    BULK_DQ = atomic_dq and cfg.bulk_dq
    DQ_BEFORE_DK = atomic_dq and cfg.dq_before_dk
    off = shared_offsets(cfg, "dkdv_atomic" if atomic_dq else "dkdv")
    K_OFF, V_OFF, Q_OFF, DO_OFF, P_OFF, DS_OFF = off["k"], off["v"], off["q"], off["do"], off["p"], off["ds"]
    QD_STRIDE = BLOCK_M * PITCH  # elements from one Q (or dO) buffer to the other
    LSE_F, DELTA_F = off["lse2"] // 2, off["delta"] // 2  # float32 offsets of the lse2 and D buffers
    CHUNKS = cfg.d_pad // 16  # 16-column tiles of the padded head dim
    WK = cfg.warps_keys  # warp grid of steps b–f: key groups ...
    WC = WARPS // WK  # ... × query (Sᵀ) or column (dK, dV) groups
    KT = BLOCK_N // WK // 16  # 16-key tiles of a warp
    QP = BLOCK_M // WC // 16  # 16-query tiles of a warp's Sᵀ, dPᵀ (two 8-column accumulator tiles each)
    CP = CHUNKS // WC  # 16-column tiles of a warp's dK, dV
    WQ = cfg.warps_dq_rows  # warp grid of step g: query groups ...
    WDQ = WARPS // WQ  # ... × column groups
    QTQ = BLOCK_M // WQ // 16  # 16-query tiles of a warp's dQ_i
    CPQ = CHUNKS // WDQ  # 16-column tiles of a warp's dQ_i
    K_STEPS, M_STEPS, N_STEPS = CHUNKS, BLOCK_M // 16, BLOCK_N // 16  # k-steps of Sᵀ/dPᵀ, dV/dK, dQ
    AF_ROWS = max(KT, QTQ)  # A-fragment tiles of one k-step, for the largest product
    S_TILES, KV_TILES, DQ_TILES = KT * 2 * QP, KT * 2 * CP, QTQ * 2 * CPQ  # 16×8 accumulator tiles of a warp
    ZERO = numba.float32(0)
    u32, u64 = numba.uint32, numba.uint64
    SMEM_ALIGN = None if SIMULATOR else 16
    mma_into, pack_pair = _make_fragment_ops(cfg.input_kind)
    first_tile, next_tile = _make_query_stream(cfg, "dkdv_atomic" if atomic_dq else "dkdv")
    store_dkdv, add_dq = _make_dkdv_storer(cfg, KT, 2 * CP), _make_dq_adder(cfg, QTQ, 2 * CPQ)
    STAGED_OUT = cfg.staged_out
    stage, store_rows = _make_staged_writer(cfg, BLOCK_N, KT, 2 * CP)
    add_dq_bulk = _make_dq_bulk_adder(cfg.dq_tiles, off.get("dq", 0) // 2)
    # Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: A = K (V) rows, B = Q (dO) rows; k = the head dim.
    s_product = _make_tile_product(KT, QP, K_STEPS, False, False, (16 * PITCH, 16), (16 * PITCH, 16), mma_into)
    # dV += Pᵀ dO, dK += dSᵀ Q: A = rows of the shared [key][query] tile, B = dO (Q) k-major; k = the queries.
    kv_product = _make_tile_product(KT, CP, M_STEPS, False, True, (16 * DS_PITCH, 16), (16, 16 * PITCH), mma_into)
    # dQ += dS K: A = dS, k-major in the dSᵀ tile; B = K k-major; k = the keys.
    dq_product = _make_tile_product(QTQ, CPQ, N_STEPS, True, True, (16, 16 * DS_PITCH), (16, 16 * PITCH), mma_into)
    transposed_gradients = _make_transposed_gradients(KT, 2 * QP)
    block_tile = cfg.block_tile(BLOCK_N)

    @kernel(fastmath=True)
    def flash_backward_dkdv_grid_tc(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, scale, causal):
        """One block: dK_j and dV_j for BLOCK_N keys of one (batch, head), the warps in a grid."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        k_start, _ = block_tile()  # one slice: the first column is 0
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))  # known ≥ 0: no sign fix-ups in // and % below
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this thread's rows of every fragment: g and g + 8 of each 16-row tile ...
        t = lane % 4  # ... and columns 2t, 2t + 1 of every 8-column tile
        key0 = 16 * KT * (warp // WC)  # the warp's first key (tile-local) ...
        qry0 = 16 * QP * (warp % WC)  # ... its first query of Sᵀ, dPᵀ ...
        col0 = 16 * CP * (warp % WC)  # ... its first column of dK, dV ...
        dq_q0 = 16 * QTQ * (warp // WDQ)  # ... and its first query and column of dQ_i
        dq_c0 = 16 * CPQ * (warp % WDQ)
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, numba.float32, alignment=SMEM_ALIGN)

        af = cuda.local.array((AF_ROWS, 4), numba.uint32)  # one k-step's A fragments
        S = cuda.local.array((S_TILES, 4), numba.float32)  # Sᵀ, then Pᵀ
        dP = cuda.local.array((S_TILES, 4), numba.float32)  # dPᵀ, then dSᵀ
        dK = cuda.local.array((KV_TILES, 4), numba.float32)
        dV = cuda.local.array((KV_TILES, 4), numba.float32)
        dQ = cuda.local.array((DQ_TILES, 4), numba.float32)  # step g
        for n in range(KV_TILES):
            for i in range(4):
                dK[n, i] = ZERO
                dV[n, i] = ZERO
        scale_log2 = numba.float32(qk_scale_log2)

        # This lane's ldmatrix addresses (see nbflash.intrinsics) at each product's first tile and k-step.
        a_row, a_col = I.d_ldmatrix_x4_a_address(lane)
        bt_row, bt_col = I.d_ldmatrix_x4_bt_address(lane)
        k_at = K_OFF + (key0 + a_row) * PITCH + a_col  # A of Sᵀ: the warp's K rows
        v_at = V_OFF + (key0 + a_row) * PITCH + a_col  # A of dPᵀ
        qt_at = (qry0 + bt_row) * PITCH + bt_col  # B of Sᵀ, dPᵀ: the warp's Q (dO) rows, from a buffer's start
        p_at = P_OFF + (key0 + a_row) * DS_PITCH + a_col  # A of dV: the warp's rows of Pᵀ
        ds_at = DS_OFF + (key0 + a_row) * DS_PITCH + a_col  # A of dK: of dSᵀ
        qk_at = a_row * PITCH + col0 + a_col  # B of dV, dK: dO (Q), k-major, from a buffer's start
        dst_at = DS_OFF + bt_row * DS_PITCH + dq_q0 + bt_col  # A of dQ: dS by transposing dSᵀ
        kd_at = K_OFF + a_row * PITCH + dq_c0 + a_col  # B of dQ: K, k-major
        # Step g's global byte address of dq_accum[b, h, 0, 2t], and the bytes from one query row to the next.
        dq_cols = I.global_address(dq_accum, (b, h, 0, 2 * t))
        dq_row_bytes = dq_accum.strides[2]
        dq_tiles = I.global_address(dq_accum, (b, h, 0, 0))  # bulk_dq: where query tile 0 starts

        # K_j, V_j and the first Q_i, dO_i with its lse2, D: one cp.async group.
        i_first, n_tiles = first_tile(smem, smem_f, q, k, v, do, lse2, delta, b, h, k_start, seqlen_q, seqlen_k,
                                      causal, tid)

        for it in range(n_tiles):
            q_start = (i_first + it) * BLOCK_M
            buf = it % 2
            I.cp_async_wait_all()  # this thread's copies of tile i, started one tile earlier (or before the loop)
            # Step a: every thread's copies of tile i are visible, and every warp is done with tile i - 1 — its
            # buffers, refilled just below, and the shared Pᵀ, dSᵀ, rewritten in step d.
            cuda.syncthreads()
            next_tile(smem, smem_f, q, do, lse2, delta, b, h, q_start, it, n_tiles, seqlen_q, tid)
            q_base = Q_OFF + buf * QD_STRIDE
            do_base = DO_OFF + buf * QD_STRIDE

            # Step b: Sᵀ and dPᵀ on the warp's keys × queries.
            for n in range(S_TILES):
                for i in range(4):
                    S[n, i] = ZERO
                    dP[n, i] = ZERO
            s_product(S, af, smem, k_at, q_base + qt_at)
            s_product(dP, af, smem, v_at, do_base + qt_at)

            # Steps c–d: Pᵀ and dSᵀ, then both to the shared [key][query] tiles as packed 16-bit pairs (row
            # g or g + 8 of tile (m, n), columns 2t, 2t + 1: one 32-bit word).
            masked = d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal)
            cols_at = buf * BLOCK_M + qry0 + 2 * t
            transposed_gradients(S, dP, smem_f, u64(LSE_F + cols_at), u64(DELTA_F + cols_at), k_start + key0 + g,
                                 q_start + qry0 + 2 * t, masked, seqlen_q, seqlen_k, causal, scale_log2)
            for m in range(KT):
                for r in range(2):
                    word = u64((key0 + 16 * m + g + 8 * r) * DS_PITCH + qry0 + 2 * t) // u64(2)
                    for n in range(2 * QP):
                        smem32[u64(P_OFF // 2) + word + u64(4 * n)] = pack_pair(S, m * 2 * QP + n, 2 * r)
                        smem32[u64(DS_OFF // 2) + word + u64(4 * n)] = pack_pair(dP, m * 2 * QP + n, 2 * r)
            cuda.syncthreads()  # steps e–g read rows and columns of Pᵀ and dSᵀ that other warps wrote

            # Steps e–f: dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i on the warp's keys × columns (dq_before_dk: step g
            # between the two).
            kv_product(dV, af, smem, p_at, do_base + qk_at)
            if not DQ_BEFORE_DK:
                kv_product(dK, af, smem, ds_at, q_base + qk_at)

            if ATOMIC_DQ:
                # Step g: dQ_i += dS K_j on the warp's queries × columns, added into dQ's float32 accumulator.
                for n in range(DQ_TILES):
                    for i in range(4):
                        dQ[n, i] = ZERO
                dq_product(dQ, af, smem, dst_at, kd_at)
                if BULK_DQ:
                    add_dq_bulk(dQ, smem_f, dq_tiles + q_start * dq_row_bytes, warp, lane)
                else:
                    add_dq(dQ, dq_cols, dq_row_bytes, q_start + dq_q0 + g, dq_c0, seqlen_q)
            if DQ_BEFORE_DK:
                kv_product(dK, af, smem, ds_at, q_base + qk_at)

        I.cp_async_wait_all()  # nothing left in flight (also when no query tile sees these keys)

        # dK_j · scale and dV_j, written once.
        sc = numba.float32(scale)
        if STAGED_OUT:  # over the K_j, V_j tiles, then whole 16-byte chunks of rows
            cuda.syncthreads()  # every warp's last read of K_j, V_j (steps b and g) and copy are done
            stage(smem32, K_OFF, dK, sc, key0 + g, col0, t)
            stage(smem32, V_OFF, dV, numba.float32(1), key0 + g, col0, t)
            cuda.syncthreads()  # every warp's part is staged before the block reads whole rows
            store_rows(smem, K_OFF, dk, b, h, k_start, seqlen_k, tid, 0)
            store_rows(smem, V_OFF, dv, b, h, k_start, seqlen_k, tid, 0)
        else:
            store_dkdv(dk, dv, dK, dV, b, h, k_start + key0 + g, col0, t, seqlen_k, sc)
        if BULK_DQ and lane == 0:
            # The copy engine has read this warp's last staged dQ_i, so the block's shared memory may go.  Its
            # additions need not have landed: nothing here reads dQ, and the grid's end makes them visible to
            # step 2' (as a TMA store epilogue waits for its reads only).
            H.bulk_wait_group_read(0)

    return flash_backward_dkdv_grid_tc


# ----------------------------------------------------------------------------
# Step 2: dQ_i, parallel over query tiles (deterministic: no atomics)
# ----------------------------------------------------------------------------


@functools.cache
def dq_tc_kernel(cfg: TCBackwardConfig):
    """The compiled deterministic dQ kernel (step 2) for one configuration (cached).

    Its query tile is ``cfg.block_n`` rows (16 per warp, as the key tile of the
    dK/dV kernel) and its key tiles ``cfg.block_m`` rows.
    """
    BLOCK_M, BLOCK_N, D = cfg.block_n, cfg.block_m, cfg.head_dim  # queries per block, keys per K_j tile
    PITCH = cfg.pitch
    SLICES, SLICE = cfg.slices, cfg.slice_cols  # blocks per query tile, and the dQ columns of each
    off = shared_offsets(cfg, "dq")
    Q_OFF, DO_OFF, K_OFF, V_OFF = off["q"], off["do"], off["k"], off["v"]
    KV_STRIDE = BLOCK_N * PITCH  # elements from one K (or V) buffer to the other
    # S = Q Kᵀ and dP = dO Vᵀ: k-steps over the shared columns.  With one slice, the warp's Q_i and dO_i
    # A-fragments of every k-step stay in registers; with several (a large head dim) they are re-read for
    # each key tile, one slice's width of k-steps (a group) before that group's products.
    HOLD = SLICES == 1
    GROUP = cfg.d_pad // 16 if HOLD else SLICE // 16
    GROUPS = SLICES
    K_STEPS = GROUP * GROUPS
    N_TILES = BLOCK_N // 8  # 8-key column tiles of S, dP
    D_TILES = SLICE // 8  # 8-wide column tiles of the block's slice of dQ
    PADDED = cfg.d_smem > D  # some dQ columns are padding: not written
    N_STEPS = BLOCK_N // 16  # k-steps of dQ += dS K
    ZERO = numba.float32(0)
    u32 = numba.uint32
    SMEM_ALIGN = None if SIMULATOR else 16
    mma_into, pack_pair = _make_fragment_ops(cfg.input_kind)
    store_pair = _make_pair_storer(cfg.input_kind)
    STAGED_OUT = cfg.staged_out
    stage, store_rows = _make_staged_writer(cfg, BLOCK_M, 1, D_TILES)
    copy_q = _make_tile_copier(BLOCK_M, cfg)
    copy_kv = _make_tile_copier(BLOCK_N, cfg)
    row_product = _make_row_product(GROUPS, GROUP, HOLD, N_TILES // 2, PITCH, mma_into)
    block_tile = cfg.block_tile(BLOCK_M, last_first=True)

    @kernel(fastmath=True)
    def flash_backward_dq_tc(q, k, v, do, lse2, delta, dq, qk_scale_log2, scale, causal):
        """One block: dQ_i for BLOCK_M (= cfg.block_n) queries of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        q_start, c0 = block_tile()  # the block's queries (longest causal rows first) and first dQ column
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))  # known ≥ 0: no sign fix-ups in // and % below
        warp = tid // 32
        lane = tid % 32
        g = lane // 4  # this thread's rows of every fragment: queries g and g + 8 of the warp ...
        t = lane % 4  # ... and columns 2t, 2t + 1 of every 8-column tile
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)  # (staged_out: 32-bit pairs)

        qf = cuda.local.array((K_STEPS if HOLD else GROUP, 4), numba.uint32)  # Q_i A-fragments, one set per k-step
        of = cuda.local.array((K_STEPS if HOLD else GROUP, 4), numba.uint32)  # dO_i A-fragments
        S = cuda.local.array((N_TILES, 4), numba.float32)  # S, then P
        dP = cuda.local.array((N_TILES, 4), numba.float32)  # dP, then dS
        dQ = cuda.local.array((D_TILES, 4), numba.float32)
        lse2_r = cuda.local.array(2, numba.float32)  # rows g, g + 8: lse2_i ...
        delta_r = cuda.local.array(2, numba.float32)  # ... and D_i
        for r in range(2):
            row = q_start + 16 * warp + g + 8 * r
            lse2_r[r] = lse2[b, h, row] if row < seqlen_q else ZERO  # rows past the end are masked anyway
            delta_r[r] = delta[b, h, row] if row < seqlen_q else ZERO
        for n in range(D_TILES):
            for i in range(4):
                dQ[n, i] = ZERO
        scale_log2 = numba.float32(qk_scale_log2)

        # Q_i, dO_i and the first K_j, V_j: one cp.async group.
        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        copy_q(smem, Q_OFF, q, b, h, q_start, seqlen_q, tid)
        copy_q(smem, DO_OFF, do, b, h, q_start, seqlen_q, tid)
        if n_tiles > 0:
            copy_kv(smem, K_OFF, k, b, h, 0, seqlen_k, tid)
            copy_kv(smem, V_OFF, v, b, h, 0, seqlen_k, tid)
        I.cp_async_commit()

        a_row, a_col = I.d_ldmatrix_x4_a_address(lane)  # Q, dO rows (A); K rows (.trans → B of dS K)
        bt_row, bt_col = I.d_ldmatrix_x4_bt_address(lane)  # K, V rows (→ B of S = Q Kᵀ, dP = dO Vᵀ)
        q_row = Q_OFF + (16 * warp + a_row) * PITCH + a_col  # this lane's address in the warp's Q rows
        do_row = DO_OFF + (16 * warp + a_row) * PITCH + a_col

        for j in range(n_tiles):
            k_start = j * BLOCK_N
            buf = j % 2
            I.cp_async_wait_all()  # this thread's copies of tile j, started one tile earlier (or before the loop)
            # Every thread's copies of tile j (and Q_i, dO_i) are visible, and every warp is done with tile
            # j - 1, whose buffers the copy below refills: one barrier per tile.
            cuda.syncthreads()
            # Start the copy of K_{j+1}, V_{j+1} into the other buffer, under this tile's products.
            if j + 1 < n_tiles:
                copy_kv(smem, K_OFF + (1 - buf) * KV_STRIDE, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                copy_kv(smem, V_OFF + (1 - buf) * KV_STRIDE, v, b, h, k_start + BLOCK_N, seqlen_k, tid)
            I.cp_async_commit()

            # The warp's 16 rows of Q_i and dO_i into registers, once (one slice: every k-step).
            if HOLD and j == 0:
                load_fragments(qf, smem, q_row, K_STEPS)
                load_fragments(of, smem, do_row, K_STEPS)

            # S = Q_i K_jᵀ and dP = dO_i V_jᵀ (16 queries × BLOCK_N keys per warp).
            k_base = K_OFF + buf * KV_STRIDE
            v_base = V_OFF + buf * KV_STRIDE
            for n in range(N_TILES):
                for i in range(4):
                    S[n, i] = ZERO
                    dP[n, i] = ZERO
            # Two loop nests, not one, k-steps outside: NVVM unrolls each of them fully (with the key tiles
            # outside, 128-key tiles at D = 64 and 64-key tiles at D = 128 stayed loops, S and dP in local memory).
            row_product(S, qf, smem, q_row, k_base + bt_row * PITCH + bt_col)
            row_product(dP, of, smem, do_row, v_base + bt_row * PITCH + bt_col)

            # P = exp2(S · scale · log2 e − lse2_row), invisible pairs 0; dS = P ∘ (dP − D_row), kept in dP.
            # Value i of tile n: query g + 8(i >> 1), key 8n + 2t + (i & 1).
            for r in range(2):
                for n in range(N_TILES):
                    for c in range(2):
                        S[n, 2 * r + c] = I.ex2_approx(S[n, 2 * r + c] * scale_log2 - lse2_r[r])
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                for r in range(2):  # the row ends computed here, on the few masked tiles, not held in registers
                    key_end = d_row_key_end(q_start + 16 * warp + g + 8 * r, seqlen_q, seqlen_k, causal)
                    first_hidden = key_end - k_start - 2 * t  # tile-local: key 8n + c hidden iff ≥ this
                    for n in range(N_TILES):
                        for c in range(2):
                            if 8 * n + c >= first_hidden:  # past the ragged end, or above the diagonal
                                S[n, 2 * r + c] = ZERO
            for r in range(2):
                for n in range(N_TILES):
                    for c in range(2):
                        dP[n, 2 * r + c] = S[n, 2 * r + c] * (dP[n, 2 * r + c] - delta_r[r])

            # dQ_i += dS K_j: dS's A-fragment for keys 16kk .. 16kk + 15 is tiles 2kk, 2kk + 1 packed.
            for kk in range(N_STEPS):
                sa0 = pack_pair(dP, 2 * kk, 0)  # query g,     keys 2t, 2t + 1
                sa1 = pack_pair(dP, 2 * kk, 2)  # query g + 8, keys 2t, 2t + 1
                sa2 = pack_pair(dP, 2 * kk + 1, 0)  # query g,     keys 8 + 2t, 8 + 2t + 1
                sa3 = pack_pair(dP, 2 * kk + 1, 2)  # query g + 8, keys 8 + 2t, 8 + 2t + 1
                for d2 in range(D_TILES // 2):
                    kb = I.ldmatrix_x4_trans(smem, k_base + (16 * kk + a_row) * PITCH + c0 + 16 * d2 + a_col)
                    for half in range(2):
                        mma_into(dQ, 2 * d2 + half, sa0, sa1, sa2, sa3, kb[2 * half], kb[2 * half + 1])

        I.cp_async_wait_all()  # nothing left in flight (only Q_i's group when no key tile was visible)

        # dQ_i · scale, written once.  A row that sees no key keeps dQ_i = 0.
        sc = numba.float32(scale)
        if STAGED_OUT:  # over the Q_i tile, then whole 16-byte chunks of rows
            cuda.syncthreads()  # every copy of Q_i has landed and every warp's last read of it (its rows) is done
            stage(smem32, Q_OFF, dQ, sc, 16 * warp + g, 0, t)
            cuda.syncthreads()  # every warp's rows are staged before the block reads whole rows
            store_rows(smem, Q_OFF, dq, b, h, q_start, seqlen_q, tid, c0)
        else:
            for r in range(2):
                row = q_start + 16 * warp + g + 8 * r
                if row < seqlen_q:
                    for n in range(D_TILES):
                        if PADDED and c0 + 8 * n >= D:
                            continue  # head-dim padding
                        store_pair(dq, b, h, row, c0 + 8 * n + 2 * t, dQ[n, 2 * r] * sc, dQ[n, 2 * r + 1] * sc)

    return flash_backward_dq_tc


# ----------------------------------------------------------------------------
# Configuration and launch
# ----------------------------------------------------------------------------


@functools.cache
def dq_tile_convert_kernel(tiles: DQTiles):
    """Step 2' of a bulk dQ route (``cfg.dq_tiles``): ``dq = accumulator · scale`` in the output type, read in the
    tiles' fragment order (:func:`dq_tile_position`) by 16-byte loads, written by 16-byte stores.  One block per
    query tile, ``tiles.threads`` threads.

    In a warp's part of the tile, the values ``i`` and ``i + 1`` (i even) of accumulator tile ``n`` are two runs
    of 32 floats, lane by lane; lanes ``4g .. 4g + 3`` of them hold row ``g`` (i = 0) or ``g + 8`` (i = 2) of
    the 16-row tile, columns ``2t`` and ``2t + 1`` of its 8.  So a thread that loads four floats from each run
    has one row's eight consecutive columns: it packs them into four 16-bit pairs and stores them with one
    ``st.global.v4``.
    Threads take those units in the order of the storage — eight rows (``g``), both halves of the 16-row
    tile, tile after tile — so every load of a warp reads four whole 128-byte lines.  A row of ``dq`` that is
    not contiguous and 16-byte aligned gets element stores instead.
    """
    store_pair = _make_pair_storer(tiles.input_kind)
    pack = I.pack_bf16x2 if tiles.input_kind == "bfloat16" else I.pack_f16x2
    R, C = tiles.warp_tile
    WDQ = tiles.d_pad // C  # parts across the columns
    N8 = C // 8  # 8-column accumulator tiles across a part's columns
    TILES = R * C // 128  # 16 × 8 accumulator tiles of a part
    BLOCK_M, THREADS = tiles.rows, tiles.threads
    UNITS = BLOCK_M * tiles.d_pad // 8  # (row, 8 columns) units of a query tile

    @kernel(fastmath=True)
    def flash_backward_dq_convert_tiled_tc(dq_accum, dq, scale):
        """One block: dq for one query tile of one (batch, head); ``dq_accum`` is ``(B, H, tiles · ROWS, D_PAD)``."""
        seqlen_q = dq.shape[2]
        head_dim = dq.shape[3]
        q_start = cuda.blockIdx.x * BLOCK_M
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        sc = numba.float32(scale)
        tile = I.global_address(dq_accum, (b, h, q_start, 0))  # the query tile: block_m · d_pad floats in a run
        unit = dq.strides[3] == 2
        for j in range(cuda.threadIdx.x, UNITS, THREADS):
            g = j % 8
            half = (j // 8) % 2  # rows g (values 0, 1) or g + 8 (values 2, 3) of the 16-row tile
            n = (j // 16) % TILES
            w = j // (16 * TILES)
            row = q_start + (w // WDQ) * R + (n // N8) * 16 + 8 * half + g
            col = (w % WDQ) * C + (n % N8) * 8
            if row < seqlen_q and col < head_dim:  # D is a multiple of 8: the whole chunk is data or padding
                at = tile + 4 * (w * R * C + (4 * n + 2 * half) * 32 + 4 * g)  # columns 2t: lanes 4g .. 4g + 3
                e0, e1, e2, e3 = I.ld_global_v4_f32(at)
                o0, o1, o2, o3 = I.ld_global_v4_f32(at + 128)  # columns 2t + 1: the next value, 32 floats on
                out = I.global_address(dq, (b, h, row, col))
                if unit and (out & 15) == 0:
                    I.st_global_v4_b32(out, pack(e0 * sc, o0 * sc), pack(e1 * sc, o1 * sc), pack(e2 * sc, o2 * sc),
                                       pack(e3 * sc, o3 * sc))
                else:
                    store_pair(dq, b, h, row, col, e0 * sc, o0 * sc)
                    store_pair(dq, b, h, row, col + 2, e1 * sc, o1 * sc)
                    store_pair(dq, b, h, row, col + 4, e2 * sc, o2 * sc)
                    store_pair(dq, b, h, row, col + 6, e3 * sc, o3 * sc)

    return flash_backward_dq_convert_tiled_tc


def choose_config(
    head_dim: int,
    input_kind: str,
    *,
    simulator: bool = SIMULATOR,
    cc: tuple[int, int] | None = None,
    max_shared: int | None = None,
    atomic: bool = False,
) -> TCBackwardConfig:
    """The configuration for a head dim (a multiple of 8 up to 256, padded to 16): 4 warps, 64 stationary rows;
    for the atomic dQ route (``atomic=True``) above D = 64, FlashAttention-2's 8 warps and 128 keys per block;
    above D = 128, slices of at most 128 gradient columns with 32-row streamed tiles.

    Chosen by the H200 tile sweep (``benchmarks/tc_backward.py --configs``,
    ``benchmarks/results/tc-backward-NVIDIA-H200-2026-11-30-tiles.json``; bf16, N = 1k/4k/16k,
    causal and not, geometric mean of TFLOP/s, deterministic dQ):

    ================  ==============================  =======================================
    head dim          dK/dV: keys × queries per tile   measured (geomean TFLOP/s)
    ================  ==============================  =======================================
    ≤ 64              64 × 64, K/V re-read by ldmatrix 176 (64 × 64 with K/V in registers: 165)
    ≤ 128             64 × 64, K/V re-read by ldmatrix 173 (64 keys × 32 queries: 142)
    ================  ==============================  =======================================

    Keeping the warp's K and V fragments in registers frees the ``ldmatrix``
    of the B operand but costs 53 registers (219 against 166 at D = 64): two
    blocks per multiprocessor become one plus, and the sweep measured it 6 %
    slower.  FlashAttention-2's own shapes (8 warps, 128 keys: 128 × 128 at
    D = 64, 64 × 128 at D = 128) measured within 2 % of these on the atomic
    route and slower on the deterministic one.  At D = 128 the 64 × 64 tiles
    need 105 KB of shared memory (115 KB for the atomic route); a GPU that allows less per block
    (``max_shared``, default the current device's) gets 64 keys × 32 queries (70 / 75 KB).
    The deterministic dQ kernel uses the same numbers with the roles swapped.

    The atomic route (``atomic=True``, ``deterministic=False``) has no dQ
    kernel, and above D = 64 it takes 64 queries × 128 keys per block (8
    warps; 155 KB of shared memory at D = 128): with twice the keys per block
    it adds each dQ value half as often.  After the one-barrier schedule of
    step 1a, at D = 128 (bf16, N = 1k / 4k / 16k non-causal,
    ``tc-backward-…-2026-12-01-one-barrier.json``): 180 / 234 / 252 TFLOP/s,
    against 169 / 210 / 225 with the 64 × 64 tiles and 184 / 213 / 220 for
    the deterministic route.  Since this session's grid layout
    (``tc-backward-NVIDIA-H200-2026-12-02-grid.json``, bf16, N = 1k / 4k / 16k),
    the same tiles with the dK/dV kernel's warps in FlashAttention-2's grid
    (``warps_keys=4``, ``warps_dq_rows=2``; 177 KB): 189 / 249 / 270 TFLOP/s
    non-causal and 133 / 213 / 266 causal at D = 128, against 178 / 231 / 249
    and 126 / 199 / 247 for the register layout in the same run (+5–9 %).  It
    takes head dims whose 16-column tiles the warps split evenly (padded 96:
    ``warps_dq_rows=4``; 80 and 112 keep the register layout).  At D = 64 the
    grid's atomic route measured 4–9 % slower than the register layout's
    64 × 64 one, which stays.
    Where a GPU allows less shared memory per block, the atomic route falls back to the
    register layout's 64 × 128 tiles, then to the deterministic route's.
    On sm_90, at padded D = 64 and 128, the grid layout's atomic route adds dQ by bulk reductions from shared
    memory (``bulk_dq``; 210 KB at D = 64 and 128) issued between the dV and the dK products
    (``dq_before_dk``), where shared memory allows.  Measured in one run each (bf16, N = 1k … 16k, causal and
    not, ``tc-backward-NVIDIA-H200-2026-12-03-dqorder*.json``), geomean TFLOP/s: D = 128 239.5 against 218.1
    for ``red.global.add`` (ratio to SDPA flash 0.80–1.00 against 0.78–0.87) and 217.2 for bulk reductions
    after both products; D = 64 216.3 against 202.1 for bulk reductions after both products and 200.1 for red
    between them.  Moving ``red`` between the products alone measured 2–3 % slower at D = 128, so before sm_90
    (no bulk reductions) the order stays.

    Above a padded D of 128: the head dim in as few slices of at most 128
    columns as cover it, and 128 keys × 32 queries per dK/dV block (8 warps;
    208 KB of shared memory at D = 256), for both dQ routes.  Measured at
    D = 256 (``tc-backward-NVIDIA-H200-2026-12-01-d256.json``, bf16, N = 1k /
    4k / 16k non-causal, TFLOP/s): 101 / 112 / 116 deterministic and 131 /
    157 / 166 atomic, against 74 / 81 / 82 and 98 / 113 / 116 for 64 × 32
    tiles and 43–81 for 64-column slices (four per key tile); SDPA's
    FlashAttention-2 202 / 247 / 261 (the slices redo Sᵀ and dPᵀ: 1.5× the
    matrix work).  Where a block gets less shared memory: 64 × 32 (141 KB),
    then 32 × 16 (69 KB).  Head dims that are not multiples of 16 take the
    tiles of the padded one.  Every configuration above a padded D of 64
    writes its gradients through shared memory in 16-byte chunks
    (``staged_out``; it takes no more shared memory).  On an H100 at D = 256
    (``tc-backward-NVIDIA-H100-80GB-HBM3-2026-12-06-s34-mma-staged.json``, bf16,
    N = 2k / 4k / 16k, same run) it measured +2 % to +8 % on the deterministic
    route (117 / 119 / 121 against 111 / 115 / 118 TFLOP/s non-causal, 100 /
    110 / 122 against 92 / 105 / 119 causal) and +1 % to +6 % on the atomic
    one.  At D = 128 too (``…-2026-12-06-s35-mma-staged-d128.json``, bf16,
    N = 1k … 16k causal and not, checked first), geomean TFLOP/s: 208.5
    against 197.3 deterministic (64 × 64), 266.1 against 252.7 atomic (the
    bulk-reduction grid tiles): up to +15 % at 1k, level at 16k.  At D <= 64
    it stays off: not timed there.

    In the simulator: 2 warps (32 keys) and 16-query tiles, so that short
    sequences cross tile edges with few Python threads; D = 32 there takes the
    ldmatrix path, other head dims the register path.

    ``cc``: the compute capability to compile for (default: the current
    device's; None in the simulator).  On sm_90 and newer the atomic dQ adds
    each accumulator pair with one ``red.global.add.v2.f32`` (``vector_red``),
    before that with two scalar reductions.
    """
    if cc is None and not simulator:
        cc = compute_capability()
    if max_shared is None and not simulator:
        max_shared = max_shared_per_block()
    return _choose_config(head_dim, input_kind, simulator, None if cc is None else tuple(cc), max_shared, atomic)


@functools.cache
def _choose_config(
    head_dim: int, input_kind: str, simulator: bool, cc: tuple[int, int] | None, max_shared: int | None,
    atomic: bool = False,
) -> TCBackwardConfig:
    cfg = _choose_tiles(head_dim, input_kind, simulator, cc, max_shared, atomic)
    # Above a padded D of 64 the last step goes through shared memory (staged_out; it takes no more shared memory,
    # so the tiles above do not depend on it): measured +1 % to +8 % at D = 256, and at D = 128 +5 % geomean on
    # both routes (up to +15 % at 1k, level at 16k); at D <= 64 not timed.
    return dataclasses.replace(cfg, staged_out=-(-head_dim // 16) * 16 > 64)


def _choose_tiles(
    head_dim: int, input_kind: str, simulator: bool, cc: tuple[int, int] | None, max_shared: int | None,
    atomic: bool,
) -> TCBackwardConfig:
    """:func:`_choose_config`'s tiles, dQ route options and slices (the caller sets ``staged_out``)."""
    vector_red = cc is not None and cc >= (9, 0)
    if head_dim % 8 or not 0 < head_dim <= 256:
        raise ValueError(
            f"the tensor-core backward supports head dims that are multiples of 8 up to 256, got {head_dim}"
        )
    d_pad = -(-head_dim // 16) * 16
    slices = -(-d_pad // 128)  # blocks per row tile: the gradient columns of a block at most 128
    d_slice = 0 if slices == 1 else -(-d_pad // (16 * slices)) * 16
    if simulator:
        return TCBackwardConfig(16, 32, head_dim, input_kind, kv_in_registers=head_dim != 32 and slices == 1,
                                vector_red=vector_red, d_slice=d_slice)
    if slices > 1:
        # D > 128: 32-row streamed tiles keep the slice's dK, dV (128 registers at a 128-column slice), Sᵀ and dPᵀ
        # and one group of fragments within 255 registers (238).  8 warps, 128 keys × 32 queries (208 KB of
        # shared memory at D = 256, the atomic route's), where the GPU allows it; else 64 × 32 (141 KB), 32 × 16.
        for m, n in ((32, 128), (32, 64), (16, 32)):
            cfg = TCBackwardConfig(m, n, head_dim, input_kind, kv_in_registers=False, vector_red=vector_red,
                                   d_slice=d_slice)
            if max_shared is None or max(shared_bytes(cfg, name) for name in KERNELS) <= max_shared:
                break
        return cfg
    # On sm_90 the grid layout's atomic route adds dQ by bulk reductions, issued between the dV and dK products
    # (bulk_dq + dq_before_dk), where measured (padded D 64 and 128) and where shared memory allows.
    bulk = dict(bulk_dq=True, dq_before_dk=True) if cc is not None and cc >= (9, 0) and d_pad in (64, 128) else {}
    if atomic and d_pad == 64:  # FlashAttention-2's D = 64 tiles: 128 queries × 128 keys, dQ's warps 4 × 4
        red = TCBackwardConfig(128, 128, head_dim, input_kind, kv_in_registers=False, vector_red=vector_red,
                               warps_keys=4, warps_dq_rows=4)
        for cfg in ([dataclasses.replace(red, **bulk)] if bulk else []) + [red]:
            if max_shared is None or shared_bytes(cfg, "dkdv_atomic") <= max_shared:
                return cfg
    if atomic and d_pad > 64:
        chunks = d_pad // 16
        candidates = [TCBackwardConfig(64, 128, head_dim, input_kind, kv_in_registers=False, vector_red=vector_red)]
        if chunks % 2 == 0:  # FlashAttention-2's warp grid where its warps split the head dim evenly
            grid = dataclasses.replace(candidates[0], warps_keys=4, warps_dq_rows=2 if chunks % 4 == 0 else 4)
            candidates[:0] = ([dataclasses.replace(grid, **bulk)] if bulk else []) + [grid]
        for cfg in candidates:
            if max_shared is None or shared_bytes(cfg, "dkdv_atomic") <= max_shared:
                return cfg
    cfg = TCBackwardConfig(64, 64, head_dim, input_kind, kv_in_registers=False, vector_red=vector_red)
    if max_shared is not None and max(shared_bytes(cfg, name) for name in KERNELS) > max_shared:
        cfg = TCBackwardConfig(32, 64, head_dim, input_kind, kv_in_registers=False, vector_red=vector_red)
    return cfg


def can_implement(cfg: TCBackwardConfig, *arrays) -> tuple[bool, str]:
    """Will this configuration launch on these arrays (do, q, k, v, then optionally o, dq, dk, dv)?  ``(ok, reason)``.

    The first four are copied by ``cp.async`` 16 bytes at a time: they must be
    contiguous along the head dim, with 16-byte aligned rows and start.
    """
    limit = max_shared_per_block()
    cc = compute_capability()
    if cfg.vector_red and cc is not None and cc < (9, 0):
        return False, f"vector_red (red.global.add.v2.f32) needs sm_90 or newer, the device is sm_{cc[0]}{cc[1]}"
    if cfg.bulk_dq and cc is not None and cc < (9, 0):
        return False, f"bulk_dq (cp.reduce.async.bulk) needs sm_90 or newer, the device is sm_{cc[0]}{cc[1]}"
    for name in KERNELS:
        need = shared_bytes(cfg, name)
        if need > limit:
            return False, f"the {name} kernel needs {need} bytes of shared memory per block, the device allows {limit}"
    # do, q, k, v are copied by cp.async; with ``staged_out`` the gradients are written in 16-byte chunks
    why = tile_rows_problem(cfg.head_dim, ("do", "q", "k", "v", "o", "dq", "dk", "dv"), arrays, copied=4,
                            written=("dq", "dk", "dv") if cfg.staged_out else ())
    return not why, why


def launch_backward_tc(
    cfg: TCBackwardConfig,
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
    deterministic: bool = True,
    stream=0,
    empty=None,
    check: bool = True,
):
    """Run steps 0–2 on canonical ``(B, H, N, D)`` views (float16, or bfloat16 as uint16), writing dq, dk, dv.

    ``lse`` is the forward's float32 ``(B, H, N_q)``.  ``deterministic=True``:
    dQ by its own query-parallel kernel (step 2), the same bits on every run.
    ``False``: dQ by float32 atomics inside the dK/dV kernel (step 1g) and the
    convert kernel (step 2').  ``empty(shape, dtype)`` allocates the scratch
    (default: the array module of ``q``); bridges that pass kernel argument
    descriptors give their own.  ``check=False`` skips :func:`can_implement`
    for a caller that has just run it on the inputs and allocated the outputs
    itself (nbflash.api's plan).
    """
    ok, why = can_implement(cfg, do, q, k, v, o, dq, dk, dv) if check else (True, "")
    if not ok:
        raise ValueError(f"tensor-core backward configuration {cfg} cannot run: {why}")
    if empty is None:  # scratch from the inputs' array module
        empty = array_module(q).empty
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    simt = bw.choose_config(head_dim, cfg.input_kind, simulator=SIMULATOR).dq  # steps 0 and 2'
    delta = empty((batch, heads, seqlen_q), np.float32)
    lse2 = empty((batch, heads, seqlen_q), np.float32)
    bulk = cfg.bulk_dq and not deterministic
    q_tiles = -(-seqlen_q // cfg.block_m)
    if deterministic:
        shape = (1, 1, 1, 1)  # unused
    elif bulk:  # whole query tiles, each in fragment order (dq_tile_position)
        shape = (batch, heads, q_tiles * cfg.block_m, cfg.d_pad)
    else:
        shape = (batch, heads, seqlen_q, head_dim)
    dq_accum = empty(shape, np.float32)  # cleared by step 0
    qk_scale_log2, sc = float(scale * LOG2E), float(scale)
    # Step 0 clears the accumulator's rows; bulk_dq's padding rows too (its bulk reductions add to them).
    bw.launch_preprocess(simt, o, do, lse, delta, lse2, dq_accum, not deterministic, stream,
                         rows=shape[2] if bulk else seqlen_q)
    name = "dkdv" if deterministic else "dkdv_atomic"
    launch(
        dkdv_tc_kernel(cfg, not deterministic),
        (-(-seqlen_k // cfg.block_n) * cfg.slices, heads, batch),
        (cfg.threads, 1, 1),
        stream,
        shared_bytes(cfg, name),
        *(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, sc, bool(causal)),
    )
    if deterministic:
        launch(
            dq_tc_kernel(cfg),
            (-(-seqlen_q // cfg.block_n) * cfg.slices, heads, batch),
            (cfg.threads, 1, 1),
            stream,
            shared_bytes(cfg, "dq"),
            *(q, k, v, do, lse2, delta, dq, qk_scale_log2, sc, bool(causal)),
        )
    elif bulk:
        launch(dq_tile_convert_kernel(cfg.dq_tiles), (q_tiles, heads, batch), (cfg.threads, 1, 1), stream, 0, dq_accum,
               dq, sc)
    else:
        bw.launch_dq_convert(simt, dq_accum, dq, sc, stream)


def kernel_signature(cfg: TCBackwardConfig, name: str):
    """The Numba argument types of kernel ``name`` (one of :data:`KERNELS`, or ``"dq_convert_tiled"``) for ``cfg``
    (any strides)."""
    from numba import types

    x4 = types.Array(types.float16 if cfg.input_kind == "float16" else types.uint16, 4, "A")
    f3, f4 = types.Array(types.float32, 3, "A"), types.Array(types.float32, 4, "A")  # lse2, delta; dq_accum
    f64, flag = types.float64, types.boolean
    if name == "dq":
        return (x4, x4, x4, x4, f3, f3, x4, f64, f64, flag)
    if name == "dq_convert_tiled":
        return (f4, x4, f64)
    return (x4, x4, x4, x4, f3, f3, x4, x4, f4, f64, f64, flag)


def _kernel(cfg: TCBackwardConfig, name: str):
    if name == "dq_convert_tiled":
        return dq_tile_convert_kernel(cfg.dq_tiles)
    return dq_tc_kernel(cfg) if name == "dq" else dkdv_tc_kernel(cfg, name == "dkdv_atomic")


def compile_targets(cc: tuple[int, int] = (9, 0)):
    """``(name, cfg, kernel, signature, fastmath)`` for every GPU configuration and kernel for compute capability
    ``cc`` (the PTX check; default sm_90, the H200).

    Steps 0 and 2' are the SIMT kernels of :mod:`nbflash.backward`, covered by its own compile targets —
    except ``bulk_dq``'s step 2' (``dq_convert_tiled``), which is this module's.
    """
    targets = []
    for d in (32, 40, 64, 96, 128, 256):
        for kind in ("float16", "bfloat16"):
            # Hopper's limit: the largest tiles; the atomic route's own where it has them (from D = 64)
            cfg, atomic = (choose_config(d, kind, simulator=False, cc=cc, max_shared=227 * 1024, atomic=a)
                           for a in (False, True))
            targets += [(name, cfg) for name in KERNELS if name != "dkdv_atomic" or atomic == cfg]
            if atomic != cfg:
                targets.append(("dkdv_atomic", atomic))
    # The grid layout's dK/dV kernels at D = 128 with red (8 warps; one kind: the types change only the mma): both
    # routes, and the atomic one with dQ between the products.
    grid = TCBackwardConfig(64, 128, 128, "bfloat16", kv_in_registers=False, vector_red=cc >= (9, 0), warps_keys=4,
                            warps_dq_rows=2)
    targets += [(name, grid) for name in ("dkdv", "dkdv_atomic") if (name, grid) not in targets]
    targets.append(("dkdv_atomic", dataclasses.replace(grid, dq_before_dk=True)))  # red between the products
    if cc >= (9, 0):  # the atomic defaults' step 2' (bulk_dq; one kind), and bulk_dq after both products at D = 128
        a64, a128 = (choose_config(d, "bfloat16", simulator=False, cc=cc, max_shared=227 * 1024, atomic=True)
                     for d in (64, 128))
        after = dataclasses.replace(a128, dq_before_dk=False)  # (its step 2' is a128's: the order does not enter it)
        targets += [("dq_convert_tiled", a64), ("dq_convert_tiled", a128), ("dkdv_atomic", after)]
    # ``staged_out`` where it is off (not timed at D <= 64; one kind): the float16 defaults' kernels at D = 64, the
    # atomic route's too.  (Above D = 64 the defaults above have it.)
    cfg, atomic = (dataclasses.replace(choose_config(64, "float16", simulator=False, cc=cc, max_shared=227 * 1024,
                                                     atomic=a), staged_out=True) for a in (False, True))
    targets += [("dkdv", cfg), ("dq", cfg), ("dkdv_atomic", atomic)]
    return [
        (f"flash_backward_{name}_tc", cfg, _kernel(cfg, name), kernel_signature(cfg, name), True)
        for name, cfg in targets
    ]
