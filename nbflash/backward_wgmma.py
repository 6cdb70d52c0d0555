"""The FlashAttention backward pass on Hopper's warpgroup tensor cores: ``wgmma.mma_async``.

The algorithm of :mod:`nbflash.backward_tc` (read that one first: the
deterministic route, dK/dV and dQ by two kernels), with its five products
issued per *warpgroup* as in :mod:`nbflash.forward_wgmma`: every product whose
A operand is a tile of Q, K, V or dO reads it from a 128-byte-swizzled shared
tile through a descriptor; every product whose A operand was just computed (Pᵀ,
dSᵀ, dS) takes it from registers, the accumulators packed to 16 bits; every B
operand is a swizzled shared tile, read K-major (``S = Q Kᵀ``-like products) or
N-major (``X += A · Y`` with Y stored row by row, as V in the forward).

Shapes (every tensor indexed ``[batch, head, row, d]``; ``bshd`` arrives as a strided view)::

    q, o, do, dq   (B, H, N_q, D)      k, v, dk, dv   (B, H, N_k, D)      float16, or bfloat16 as uint16 bits
    lse            (B, H, N_q)  float32, from the forward
    delta, lse2    (B, H, N_q)  float32 scratch (step 0)

With ``P_ij = exp(S_ij·scale − lse_i)`` recomputed tile by tile::

    dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D)      dQ = dS K · scale      dK = dSᵀ Q · scale

0. **Preprocess** — the SIMT kernel of :mod:`nbflash.backward`: ``D_i =
   rowsum(dO_i ∘ O_i)`` and ``lse2_i = lse_i · log2 e`` (``+inf`` for a row that
   saw no key).

1. **dK, dV** (grid: key tiles of ``BLOCK_M = 64 · warpgroups`` × heads ×
   batch).  Warpgroup w owns keys ``64w .. 64w + 63`` of the tile, so every
   product comes out transposed, keys as the accumulator's rows.  K_j and V_j
   are copied once; Q_i and dO_i stream past, two buffers each, one barrier
   per query tile (the next tile's copy starts right after it), and so do the
   tile's lse2 and D, staged in shared memory one tile ahead.  For each query
   tile i that sees some key of the tile (:func:`~nbflash.masking.query_range`):

   a. ``Sᵀ = K_j Q_iᵀ`` and ``dPᵀ = V_j dO_iᵀ``: shared × shared, K-major,
      issued as two commit groups; the next tile's lse2, D are loaded meanwhile;
   b. once Sᵀ is done (dPᵀ still running): ``Pᵀ = exp2(Sᵀ · scale · log2 e −
      lse2_col)`` (a thread's values sit in columns 8n + 2t + c: lse2 and D are
      per *column*), invisible pairs 0 — the masked step a compile-time
      variant for the few tiles that need it, and its shared-memory indices
      (as dSᵀ's in d) unsigned: Numba tests every signed index for
      wraparound, and with those tests and a run-time mask flag the unmasked
      step was 313 SASS instructions besides its 32 exponentials, where 39
      do (offline sm_90a, 2026-12-06; a profile had the computing warps
      spending 41 % of their time issuing steps b and d).  The whole
      backward went 1.09–1.17× faster at D = 128 and 1.16–1.33× at D = 64
      with it (H100, bf16, N = 1k–16k).  The masked step asks each of the
      thread's two keys which queries see it
      (:func:`~nbflash.masking.key_query_range`, a range of columns clamped
      to the tile) and tests each pair by two 32-bit compares: one masked
      copy in SASS where there had been two, 13–15 % fewer instructions in
      the kernel, timed level (2026-12-07);
   c. ``dV_j += Pᵀ dO_i`` issued (registers × shared, dO_i read N-major);
   d. once dPᵀ is done (dV still running): ``dSᵀ = Pᵀ ∘ (dPᵀ − D_col)``, then
      ``dK_j += dSᵀ Q_i`` issued; both waited for before the next tile's
      barrier, which refills Q_i, dO_i — or, with three buffers per streamed
      tile (``dkdv_stages=3``), left running under it: the barrier then
      refills the buffer of tile i − 1, whose products finished before tile
      i's Sᵀ.

   One warpgroup's query tile (``|`` a wait; the other warpgroup, and with
   one warpgroup per block the other blocks on the SM, fill the gaps)::

       tensor cores:   [ Sᵀ ][ dPᵀ ]        [ dV ]        [ dK ]
       its threads:    lse2,D | Pᵀ ......  | dSᵀ ...... |        | barrier

   Finally ``dK_j · scale`` and ``dV_j`` are written once, through shared
   memory: the consumers meet (every product that reads K_j, V_j is done),
   each warp packs its 16 keys' rows to 16 bits over the K_j, V_j tiles and
   writes them in whole 16-byte chunks, one tensor after the other, and only
   then waits for its last dQ reduction's read (:func:`staged_row_writer`).
   Per-block ``%clock64`` stamps (H100, 2026-12-06) put this step at 2.0 µs
   a block at D = 128 and 1.1 at D = 64; two 16-bit stores per pair straight
   from the accumulators, as before, took 14 and 4.8 µs, a quarter of a
   block's time at N = 1k.

   **Warp specialisation** (``dkdv_ws``, the GPU default up to D = 128): the
   block gets one more warpgroup, a *producer* that only copies, and the
   computing warpgroups (the *consumers*) meet at no block-wide barrier in
   the loop.  The producer's first thread copies with TMA (:mod:`nbflash.tma`):
   K_j and V_j once, on their own mbarrier, then query tile i into stage
   ``i % stages`` — Q_i's and dO_i's panels and one box of two rows that is
   the tile's ``[lse2 | D]`` buffer (the scratch holds lse2 and D side by side,
   so a 16-bit view of it is one tensor; past the last query the box brings
   zeros, where Q_i and dO_i are zero too, so those columns add nothing).  One
   ``arrive.expect_tx`` per tile announces all its bytes.  A consumer waits on
   the stage's mbarrier (phase parity ``(i // stages) % 2``) instead of on
   cp.async groups and a barrier, and hands the stage back by ``bar.arrive``
   at named barrier ``EMPTY + s`` once its dV and dK products have finished;
   the producer waits there (``bar.sync``) before refilling the stage::

       producer (1 thread): K_j, V_j ─ tile 0 ─ tile 1 ─ EMPTY(0) ─ tile 2 ─ EMPTY(1) ─ tile 3 …
       consumer 0:          wait(0) ─ Sᵀ, dPᵀ, Pᵀ, dV, dSᵀ, dK ─ EMPTY(0) ─ wait(1) ─ …
       consumer 1:             wait(0) ─ Sᵀ, dPᵀ, Pᵀ, dV, dSᵀ, dK ─ EMPTY(0) ─ wait(1) ─ …

   No thread of the consumers issues a copy or its address arithmetic, and
   each consumer runs on as soon as its own tile has landed, so the two drift
   apart and one's softmax and waits fall under the other's products.  With
   two consumers (384 threads, 168 registers each at launch) the producer
   gives registers back (``setmaxnreg``: 24 for it, 240 for each consumer, as
   in :mod:`nbflash.forward_wgmma`) and its thread ends after its last
   hand-over; it takes every release nobody refilled, so that each named
   barrier's counts match.

   e. *Atomic route only* (``deterministic=False``; ``BLOCK_N`` a multiple of
      64): ``dQ_i += dS K_j`` here instead of in step 2.  The packed dSᵀ
      pairs go to a shared ``[key][query]`` tile (before the dK product is
      issued: a wgmma's A registers may not even be read while it runs), a
      barrier, then ``ldmatrix.trans`` reads dS back as A fragments (warp v:
      queries 16v …) and one registers × shared product of ``m64n64k16``
      per 64 queries (K_j N-major, one 64-column panel per warpgroup) gives
      the block's share, added into a float32 accumulator — by
      ``red.global.add.v2.f32`` from registers, or with ``bulk_dq`` (the GPU
      default) through shared memory: each warp stores its part of dQ_i to
      its own part of a staging tile, in the accumulator's fragment order
      (:attr:`WGBackwardConfig.dq_tiles`), fences it to the async proxy, and
      its lane 0 starts one ``cp.reduce.async.bulk .add.f32`` of the part (4
      KB, predicated, not branched); the warp waits for that read only when
      it stages again a tile later, so the reductions run under the next
      tile's products (FlashAttention-3 has a dedicated warp issue them).
      The accumulator has whole tiles, rows and panels, so the additions need
      no bounds test (a branch there made ptxas serialise every wgmma of the
      kernel, its C7514).  With ``dkdv_ws``
      the consumers meet at a named barrier (``DS_READY``, consumers only)
      over two dSᵀ tiles used in turn: a warpgroup writes tile i + 2's into
      the buffer of tile i only after passing tile i + 1's barrier, which the
      other warpgroup reaches after its reads of tile i; and dV, dK are
      waited for before the dQ product, so that dSᵀ's A registers are free
      for dS's (with both live, ptxas serialised the wgmmas at D = 128 within
      240 registers, its C7512); the stage goes back right after that wait.
      At D ≤ 64 (``dq_overlap``, the default there) dQ's product is issued
      while dV's and dK's still run.  There warpgroup 0 computes all of dQ_i
      while the other runs ahead into the next tile (``dq_chunk_split``, a
      128-query tile's two chunks shared out, measured 2–10 % slower).
      ``ds_mn_major`` (off) stores dSᵀ in the layout a wgmma reads
      *MN-major* instead (each key a 128-byte, 128B-swizzled row of 64
      queries), fences it to the async proxy, and dQ's product reads dS =
      (dSᵀ)ᵀ from shared memory through ``imm-trans-a``: no ``ldmatrix``, no
      A registers, and at D = 128 the overlap no longer serialises — but it
      measured 2–11 % slower on the H100 (2026-12-05).  ``dk_last`` (off; D =
      128) takes FlashAttention-3's order instead of waiting for dV and dK
      before step 1e: dV is waited for after the ``DS_READY`` barrier, dQ's
      product is issued before dK's, and only dQ's is waited for (``wait_group
      1``) — dK's runs on under the staging of dQ_i and into the next tile,
      where the wait for Sᵀ covers it too (groups complete in order); the
      stage it read goes back then (the last one after the loop)::

          default:   … dK ─ wait(dV, dK) ─ DS_READY ─ dQ ─ wait(dQ) ─ stage dQ ─ next: Sᵀ, dPᵀ ─ wait(Sᵀ) …
          dk_last:   … DS_READY ─ wait(dV) ─ dQ, dK ─ wait(dQ) ─ stage dQ ─ next: Sᵀ, dPᵀ ─ wait(dK, Sᵀ) …

2. **dQ** (grid: query tiles of ``BLOCK_M`` rows).  Q_i and dO_i are copied
   once; K_j, V_j stream past, two buffers each.  Per key tile: ``S = Q_i
   K_jᵀ`` and ``dP = dO_i V_jᵀ`` (shared × shared, two groups), ``P = exp2(S
   · scale · log2 e − lse2_row)`` (masked through the forward's own
   :func:`~nbflash.forward_tc.fragment_steps`) while dP runs, ``dS = P ∘ (dP −
   D_row)``, ``dQ_i += dS K_j`` (registers × shared, K_j N-major; with
   ``dq_stages=3`` left running under the next tile's barrier, as in 1d).
   ``dQ_i · scale`` written once, through shared memory as in step 1.  No atomics: the same bits on every run.

2'. **Convert** (atomic route): ``dq = accumulator · scale`` by the SIMT
   kernel of :mod:`nbflash.backward` (with ``bulk_dq``: by
   :func:`nbflash.backward_tc.dq_tile_convert_kernel`, which reads the
   fragment order).  Measured on the H200 (bf16/fp16, N = 1k … 16k), without
   warp specialisation: 0.75–0.86× the deterministic route at D = 64 and
   0.87–1.03× at D = 128.  With the warp-specialised dK/dV kernel and
   ``red.global.add`` it was the faster route at D ≤ 64 only (252 against 236
   TFLOP/s geometric mean; at D = 128 300 against 327).  With bulk reductions
   it is the faster route at every D ≤ 128 — 5 products instead of the two
   kernels' 7 — and ``deterministic=None`` takes it (:func:`prefers_atomic`):
   1.07–1.18× the previous defaults (``tc-backward-NVIDIA-H200-2026-12-04-bulk-final.json``).

So each tile's barrier finds every warpgroup done with the buffers it
refills: with two buffers because every product was waited for before it,
with three because the products still running read another buffer (with
``dkdv_ws``, the EMPTY hand-over of step 1 plays that part).
The warpgroup index is made warp-uniform to ptxas
(:func:`~nbflash._device.warp_uniform`), which otherwise serialises the wgmmas.

Requires sm_90a.  Constraints (:func:`can_implement`): D a multiple of 8 up
to 256 (padded to whole 64-column panels in shared memory); rows whole,
16-byte-aligned chunks.  Above D = 128 the head dim is cut into slices of 128
gradient columns, one block each (``WGBackwardConfig.d_slice``), as in
:mod:`nbflash.backward_tc`: every block issues Sᵀ and dPᵀ over the whole head
dim and dV, dK (dQ) for its own panels only, B read N-major from the slice's
first panel.

Status (H200, ``tc-backward-NVIDIA-H200-2026-12-04-bulk-final.json``, bf16 and
fp16, N = 512 … 16k at batch·N = 16k, heads·D = 2048, causal and not, each
kernel beside the previous default and SDPA's flash and cuDNN backwards in
one run): the defaults — one pass, the warp-specialised dK/dV kernel adding
dQ by bulk reductions — reach 246 / 331 / 390 / 429 / 451 / 459 TFLOP/s at
D = 128 (bf16, non-causal), 1.07–1.18× the previous defaults (the same
kernel without step 1e, then the dQ kernel; at D = 64 step 1e by
``red.global.add``), 1.15–1.50× SDPA's FlashAttention-2 backward and
0.69–0.84× cuDNN (0.71–0.84 from N = 2k).  ``backend="auto"`` runs it on
compute capability 9.x up to D = 128.  The way here: the first version
(every product pair waited for at once, lse2 and D read from global memory
in the softmax) reached 99–204; two commit groups per pair and lse2 / D
staged a tile ahead 229–321 (2026-11-30); three buffers per streamed tile
bought 1–3 % in the dQ kernel and lost in dK/dV, whose accumulators then
cross tiles in registers (255 and spills at D = 128); the warp-specialised
dK/dV kernel 7–22 % at D = 128; dQ by bulk reductions in it, one pass, 7–18 %.
dSᵀ read by dQ's product straight from shared memory (``ds_mn_major``) was
correct but 2–11 % slower (2026-12-05, H100).  Next: why (a profile of both
routes side by side), the consumers' per-tile meeting at ``DS_READY`` (both
wait for the slower one's dSᵀ) and the early wait at D = 128.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import backward as bw
from . import backward_tc as bt
from . import hopper as HW
from . import intrinsics as I
from . import tma as T
from ._device import (
    SIMULATOR,
    cuda,
    device_function,
    kernel,
    launch,
    max_shared_per_block,
    numba,
    syncwarp,
    warp_uniform,
)
from ._tiles import LOG2E, HeadDimSlices, make_padded_offset, make_pair_stager, make_tc_tile_storer
from ._validate import array_module, tile_rows_problem
from .forward_tc import fragment_steps
from .forward_wgmma import (
    PANEL,
    REGISTERS,
    no_maps,
    padded_head_dim,
    rs_product,
    ss_product,
    supported_device,
    swizzled_tile_loader,
)
from .masking import d_key_columns, d_key_range, d_query_range, d_tile_needs_mask

__all__ = [
    "WS_MIN_CAUSAL_KEYS_D64",
    "WGBackwardConfig",
    "can_implement",
    "choose_config",
    "compile_targets",
    "config_for",
    "dkdv_wgmma_kernel",
    "dq_wgmma_kernel",
    "kernel_signature",
    "launch_backward_wgmma",
    "prefers_atomic",
    "shared_bytes",
    "takes_atomic",
    "takes_head_dim",
    "tensor_maps",
]


@dataclass(frozen=True)
class WGBackwardConfig(HeadDimSlices):
    """Compile-time constants of the wgmma backward kernels.

    ``block_m``: rows a block owns, 64 per warpgroup (keys in the dK/dV
    kernel, queries in the dQ kernel); ``block_n``: rows of the tiles that
    stream past (queries in dK/dV, keys in dQ) — the N of the shared × shared
    products.
    """

    block_m: int  # 64 or 128
    block_n: int  # a wgmma N: 16 ... 128
    head_dim: int  # a multiple of 8 up to 256 (whole 64-column panels inside)
    input_kind: str  # "float16" or "bfloat16"
    #: buffers of each streamed tile, per kernel: 2 (each tile's gradient products waited for before the
    #: next tile's barrier) or 3 (left in flight across it: the barrier refills the buffer read two tiles
    #: ago; the accumulators then cross tiles, which costs registers)
    dkdv_stages: int = 2
    dq_stages: int = 2
    #: gradient columns per block, 64 or 128 (0: the whole padded head dim): above 128 the head dim is cut
    #: into slices, one block each, as in :mod:`nbflash.backward_tc` (each recomputes Sᵀ and dPᵀ over all of D)
    d_slice: int = 0
    #: the dK/dV kernel warp-specialised (step 1, "ws"): a producer warpgroup copies K_j, V_j and each query
    #: tile's Q_i, dO_i, lse2_i, D_i by TMA into ``dkdv_stages`` buffers (2 to 4), handed over by mbarriers;
    #: the other warpgroups only compute, with no block-wide barrier in the loop
    dkdv_ws: bool = False
    #: the atomic route's dQ (step 1e) staged in shared memory by each warp and added by the bulk copy engine,
    #: one ``cp.reduce.async.bulk .add.f32`` per warp and tile, instead of ``red.global.add`` from registers;
    #: the accumulator then holds whole query tiles in fragment order (:attr:`dq_tiles`)
    bulk_dq: bool = False
    #: the atomic route in the ws kernel: dQ's product issued while the tile's dV and dK products still run
    #: (False: both waited for first, which frees dSᵀ's A registers — needed at D = 128, where ptxas otherwise
    #: serialised the wgmmas within 240 registers)
    dq_overlap: bool = False
    #: the atomic route with two warpgroups and a slice of one panel (D ≤ 64): they split the streamed tile's
    #: 64-query chunks (``block_n = 128``: one each) instead of warpgroup 0 computing all of dQ_i.  Balanced,
    #: but measured 2–10 % slower on the H200 (``tc-backward-NVIDIA-H200-2026-12-04-bulk2.json`` against
    #: ``…-bulk.json``): with warpgroup 0 alone on dQ_i, the other runs ahead into the next tile's products
    dq_chunk_split: bool = False
    #: the atomic route's dSᵀ tile stored in the wgmma's MN-major swizzled layout and read by dQ's product
    #: straight from shared memory (A MN-major, ``imm-trans-a``) instead of by ``ldmatrix.trans`` into A
    #: registers.  Correct on the GPU, and it lets ptxas issue dQ's product under dV's and dK's at D = 128
    #: (``dq_overlap``) without serialising; but measured 2–11 % slower than the ldmatrix route (H100,
    #: ``tc-backward-NVIDIA-H100-80GB-HBM3-2026-12-05-dsmn.json`` against ``…-base.json``), so it is off
    ds_mn_major: bool = False
    #: the atomic route in the ws kernel at two warpgroups with a dQ share each (D = 128) and one 64-query
    #: chunk: FlashAttention-3's order of the tile's last products — dQ's issued before dK's, dQ waited for
    #: while dK's still runs, and dK's left running into the next tile (waited for with its Sᵀ; the stage goes
    #: back then).  dV is waited for before the dQ product (its A registers then free for dS's)
    dk_last: bool = False

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"block_m must be 64 or 128 (64 rows per warpgroup), got {self.block_m}")
        if self.block_n not in (16, 32, 64, 128):
            raise ValueError(f"block_n must be 16, 32, 64 or 128 (a wgmma N), got {self.block_n}")
        if self.head_dim <= 0 or self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"head_dim must be a multiple of 8 up to 256 for the wgmma backward, got {self.head_dim}")
        if self.d_slice not in (0, PANEL, 2 * PANEL):
            raise ValueError(f"d_slice must be 0, {PANEL} or {2 * PANEL} (whole panels, a wgmma N), got {self.d_slice}")
        if not self.d_slice and self.d_pad > 2 * PANEL:
            raise ValueError(f"a padded head dim of {self.d_pad} needs d_slice (at most 128 gradient columns a block)")
        if self.input_kind not in ("float16", "bfloat16"):
            raise ValueError(f"input_kind must be 'float16' or 'bfloat16', got {self.input_kind!r}")
        if self.dq_stages not in (2, 3):
            raise ValueError(f"dq_stages must be 2 or 3, got {self.dq_stages}")
        if self.dkdv_stages not in ((2, 3, 4) if self.dkdv_ws else (2, 3)):
            raise ValueError(f"dkdv_stages must be 2 or 3 (2 to 4 with dkdv_ws), got {self.dkdv_stages}")
        if (self.bulk_dq or self.dq_overlap or self.ds_mn_major) and not takes_atomic(self):
            raise ValueError(f"bulk_dq, dq_overlap and ds_mn_major are the atomic dQ route's: {_atomic_refusal(self)}")
        if self.dq_overlap and not self.dkdv_ws:
            raise ValueError("dq_overlap orders the ws kernel's products: it needs dkdv_ws")
        groups = self.block_m // 64
        if self.dk_last and not (self.dkdv_ws and takes_atomic(self) and not self.dq_overlap and self.block_n == 64
                                 and groups * self.dq_cols == self.slice_cols):
            raise ValueError("dk_last orders the ws kernel's atomic-route products: it needs dkdv_ws, not "
                             "dq_overlap, block_n = 64 (one 64-query chunk) and a dQ share for every warpgroup "
                             "(two warpgroups at a padded D of 128)")
        if self.dq_chunk_split and not (groups > 1 and self.dq_cols == self.slice_cols
                                        and (self.block_n // 64) % groups == 0 and takes_atomic(self)):
            raise ValueError("dq_chunk_split needs two warpgroups, one panel of dQ columns (D <= 64) and "
                             "block_n = 128 (a 64-query chunk for each)")

    @property
    def threads(self) -> int:
        """Threads that compute (64 rows per warpgroup): the dQ kernel's block, the dK/dV kernel's consumers."""
        return HW.WARPGROUP * (self.block_m // 64)

    @property
    def dkdv_threads(self) -> int:
        """The dK/dV kernel's block: with ``dkdv_ws`` the producer warpgroup comes after the consumers."""
        return self.threads + (HW.WARPGROUP if self.dkdv_ws else 0)

    @property
    def setmaxnreg(self) -> bool:
        """Does the dK/dV kernel move registers from its producer to its consumers (ws with two consumer
        warpgroups: 384 threads start at 168 registers each; then 24 and 240, as in the forward)?"""
        return self.dkdv_ws and self.block_m == 128

    @property
    def column_buffers(self) -> int:
        """Buffers of the streamed rows' lse2 and D in the dK/dV kernel: one per stage with ``dkdv_ws`` (they
        come with the tile), else two (the next tile's staged while this one's are read)."""
        return self.dkdv_stages if self.dkdv_ws else 2

    @property
    def d_pad(self) -> int:
        """D rounded up to whole 64-column panels; the padding is zero in shared memory."""
        return padded_head_dim(self.head_dim)

    @property
    def dq_cols(self) -> int:
        """Step 1e: columns of dQ_i one warpgroup computes — half of the slice each when that is whole 64-column
        panels (the B operand's), else all of it."""
        half = self.slice_cols // (self.block_m // 64)
        return half if half % PANEL == 0 else self.slice_cols

    @property
    def dq_tiles(self) -> bt.DQTiles:
        """``bulk_dq``'s accumulator layout: query tiles of ``block_n`` rows; a warp's part is its 16 queries of a
        64-query chunk × its warpgroup's :attr:`dq_cols` columns (the rows of a wgmma accumulator's warp)."""
        return bt.DQTiles(self.block_n, self.d_pad, (16, self.dq_cols), self.input_kind, self.threads)


#: The kernels, as :func:`shared_bytes` and :func:`kernel_signature` name them.
KERNELS = ("dkdv", "dkdv_atomic", "dq")


def shared_offsets(cfg: WGBackwardConfig, stages: int) -> tuple[int, int, int, int, int, int]:
    """16-bit element offsets of the two once-copied tiles (the first at 0: K, V or Q, dO), of the two
    streamed tiles' buffers (``stages`` each: the kernel's own count), of the streamed rows' lse2 and D
    (float32, :attr:`~WGBackwardConfig.column_buffers` buffers of ``[lse2 × BLOCK_N, D × BLOCK_N]``; the
    dK/dV kernel's), and the end.  Every tile starts 1024-byte aligned, every lse2 / D buffer 128-byte
    aligned (TMA destinations)."""
    own = cfg.block_m * cfg.d_smem
    stream = cfg.block_n * cfg.d_smem
    a1, s0 = own, 2 * own
    s1 = s0 + stages * stream
    cols = s1 + stages * stream
    return 0, a1, s0, s1, cols, cols + cfg.column_buffers * 2 * cfg.block_n * 2


def ds_pitch(cfg: WGBackwardConfig) -> int:
    """16-bit elements per row of the atomic route's shared dSᵀ tile (``[key][query]``, read by ``ldmatrix``):
    BLOCK_N + 8, so that the eight rows one ``ldmatrix`` reads fall in different banks and every row starts
    16-byte aligned.  (With ``ds_mn_major``: BLOCK_N, the rows swizzled instead, :func:`ds_panel_bytes`.)"""
    return cfg.block_n if cfg.ds_mn_major else cfg.block_n + 8


def ds_panel_bytes(cfg: WGBackwardConfig) -> int:
    """Bytes of one 64-query panel of the atomic route's shared dSᵀ tile with ``ds_mn_major``: ``BLOCK_M`` key
    rows of 128 bytes.

    The tile is then the A operand of ``dQ_i += dS K_j`` read *MN-major* (``imm-trans-a``): k = key, each key a
    128-byte, 128B-swizzled row of 64 queries (:func:`nbflash.hopper.mnmajor_sw128_offset`, LBO = this), so
    the tensor cores read dS = (dSᵀ)ᵀ as it is stored."""
    return cfg.block_m * PANEL * 2


def dq_staging(cfg: WGBackwardConfig) -> tuple[int, int, int]:
    """16-bit element offset of step 1e's shared tiles in the dK/dV kernel: the dSᵀ tile (two, alternating, with
    ``dkdv_ws``; with ``ds_mn_major`` 1024-byte aligned, a swizzled wgmma operand), then with ``bulk_dq`` the
    float32 staging of dQ_i (:attr:`~WGBackwardConfig.dq_tiles`' order, 16-byte aligned for the bulk copies) —
    returned as ``(dS offset, staging offset, end)``."""
    ds = shared_offsets(cfg, cfg.dkdv_stages)[-1]
    if cfg.ds_mn_major:
        ds = -(-ds // 512) * 512
    staging = ds + (2 if cfg.dkdv_ws else 1) * cfg.block_m * ds_pitch(cfg)
    assert staging % 8 == 0  # 16 bytes
    return ds, staging, staging + (2 * cfg.block_n * cfg.d_pad if cfg.bulk_dq else 0)


@functools.cache
def shared_bytes(cfg: WGBackwardConfig, name: str = "dkdv") -> int:
    """Dynamic shared memory of kernel ``name`` (:data:`KERNELS`): each kernel has its own number of stages;
    ``"dkdv_atomic"`` adds step 1e's tiles (:func:`dq_staging`)."""
    if name == "dkdv_atomic":
        return dq_staging(cfg)[-1] * 2
    return shared_offsets(cfg, cfg.dq_stages if name == "dq" else cfg.dkdv_stages)[-1] * 2


@functools.cache
def mn_major_product(n: int, kind: str, k_steps: int):
    """``acc = product(acc, a_desc, b_desc)``: issue acc += A·B (64 × n) with **both operands MN-major** swizzled
    tiles whose rows are the k index (16 rows of 128 bytes, 2048 bytes, per k-step): A stored transposed (dSᵀ,
    ``[key][query]``), B as in :func:`~nbflash.forward_wgmma.rs_product` (K_j, ``[key][d]``).  Issue only."""
    wgmma_tt = HW.wgmma(n, kind, trans_a=True, trans_b=True)
    u64 = numba.uint64

    def product(acc, a_desc, b_desc):
        for kk in range(k_steps):
            step = u64((2048 * kk) >> 4)
            acc = wgmma_tt(a_desc + step, b_desc + step, acc, 1)
        return acc

    return device_function(product)


class _Consts:
    """The constants both kernels derive from a configuration."""

    def __init__(self, cfg: WGBackwardConfig, stages: int):
        self.BLOCK_M, self.BLOCK_N, self.D, self.D_PAD = cfg.block_m, cfg.block_n, cfg.head_dim, cfg.d_pad
        self.SLICE, self.D_SMEM = cfg.slice_cols, cfg.d_smem
        self.THREADS, self.DKDV_STAGES, self.DQ_STAGES = cfg.threads, cfg.dkdv_stages, cfg.dq_stages
        _, self.A1, self.S0, self.S1, cols, _ = shared_offsets(cfg, stages)
        self.COLS_F = cols // 2  # float32 offset of the lse2 / D buffers
        self.STRIDE = cfg.block_n * cfg.d_smem  # elements from one streamed buffer to the other
        self.N_TILES = cfg.block_n // 8  # 8-column tiles of the shared × shared products
        self.D_TILES = self.SLICE // 8  # 8-column tiles of the block's slice of the gradients
        self.K_STEPS = cfg.d_pad // 16  # k-steps of the shared × shared products (the data panels only)
        self.N_STEPS = cfg.block_n // 16  # k-steps of the registers × shared products
        self.OWN_PANEL, self.STREAM_PANEL = cfg.block_m * PANEL * 2, cfg.block_n * PANEL * 2  # bytes per panel
        self.kind = kind = "f16" if cfg.input_kind == "float16" else "bf16"
        # shared (own tile) × shared (streamed tile), both K-major; registers × shared (streamed, N-major)
        self.ss = ss_product(cfg.block_n, kind, self.K_STEPS, self.OWN_PANEL, self.STREAM_PANEL, unrolled=True)
        self.rs = rs_product(self.SLICE, kind, self.N_STEPS)  # the block's slice of dV, dK or dQ
        self.SMEM_ALIGN = None if SIMULATOR else 1024


@functools.cache
def staged_row_writer(cfg: WGBackwardConfig):
    """``write(smem, smem32, warp, g, t, lane, acc, sc, dst, b, h, row_first, seqlen, c0)``: both kernels' last
    step — a warp's 16 rows of a gradient (keys in dK/dV, queries in dQ) × the block's slice
    of columns, written through shared memory.

    The thread's accumulator pairs ``acc · sc`` (rows g, g + 8 of the warp's 16; columns 8n + 2t, + 1 of the
    slice) are packed to 16 bits into the warp's staged rows, ``16 · warp`` on of the block's ``BLOCK_M``, over
    its two once-copied tiles (``2 · BLOCK_M · D_SMEM`` elements from 0).  Rows are the slice plus 8 elements
    apart: 16 bytes more than the data, so the 32 lanes' words fall in 32 banks and every row starts 16-byte
    aligned.  Then the warp writes its rows to rows ``row_first ...`` of ``dst[b, h]``, columns ``c0 ...``, by
    :func:`~nbflash._tiles.make_tc_tile_storer` (whole 16-byte chunks; rows past ``seqlen`` and head-dim
    padding skipped; ``dst``'s rows whole, aligned chunks: :func:`can_implement`).  The caller frees the staging
    first (its barrier), and meets its warp (``syncwarp``) before staging again.

    In the dK/dV kernel this replaced two 16-bit stores per pair straight from the accumulators: the step went
    from 14 to 2.0 µs a block at D = 128 (4.8 to 1.1 at D = 64), and the backward from 0.81–0.88× cuDNN's to
    0.94–1.03× at N = 1k (H100, ``tc-backward-NVIDIA-H100-80GB-HBM3-2026-12-06-s33-staged.json``,
    ``trace-dkdv-H100-2026-12-06-s33.json``).
    """
    SLICE = cfg.slice_cols
    OUT_PITCH = SLICE + 8
    assert OUT_PITCH <= 2 * cfg.d_smem
    stage = make_pair_stager(cfg.input_kind, OUT_PITCH, 1, SLICE // 8)
    store = make_tc_tile_storer(16, 32, cfg.head_dim, make_padded_offset(OUT_PITCH), slice_cols=SLICE)
    u32 = numba.uint32

    @device_function
    def write(smem, smem32, warp, g, t, lane, acc, sc, dst, b, h, row_first, seqlen, c0):
        stage(smem32, 0, acc, sc, 16 * warp + g, 0, t)
        syncwarp()  # the warp's pairs are in place before its lanes read other lanes' chunks
        store(smem, u32(16 * warp * OUT_PITCH), dst, b, h, row_first, seqlen, lane, c0)

    return write


@functools.cache
def dkdv_wgmma_kernel(cfg: WGBackwardConfig, atomic_dq: bool = False):
    """The compiled dK/dV kernel (step 1) for one configuration (cached); ``atomic_dq`` adds step 1e."""
    if atomic_dq and not takes_atomic(cfg):
        raise ValueError(_atomic_refusal(cfg))
    c = _Consts(cfg, cfg.dkdv_stages)
    BLOCK_M, BLOCK_N, D, THREADS = c.BLOCK_M, c.BLOCK_N, c.D, c.THREADS
    V_OFF, Q_OFF, DO_OFF, STRIDE, STAGES = c.A1, c.S0, c.S1, c.STRIDE, c.DKDV_STAGES
    N_TILES, D_TILES, N_STEPS = c.N_TILES, c.D_TILES, c.N_STEPS
    SLICE, D_SMEM = c.SLICE, c.D_SMEM
    STREAM_PANEL, SMEM_ALIGN = c.STREAM_PANEL, c.SMEM_ALIGN
    ss_prod, rs_prod = c.ss, c.rs
    SW128, SBO = HW.SWIZZLE_128B, 1024
    ZERO = numba.float32(0)
    INF = numba.float32(math.inf)
    u32, u64 = numba.uint32, numba.uint64
    I32 = int if SIMULATOR else numba.int32  # the mask's compares in 32 bits (the simulator: Python ints, faster)
    p_frags = fragment_steps(N_TILES, D_TILES, D, cfg.input_kind).p_frags
    load_own = swizzled_tile_loader(BLOCK_M, THREADS, D, D_SMEM)
    load_stream = swizzled_tile_loader(BLOCK_N, THREADS, D, D_SMEM)
    block_tile = cfg.block_tile(BLOCK_M)

    COLS_F, COL_BUF = c.COLS_F, 2 * BLOCK_N  # lse2 / D buffers: float32 offset, floats per buffer
    # Step 1e (atomic dQ): the shared dSᵀ tile, and which columns of dQ_i each warpgroup computes — half of the
    # block's slice each when that is whole 64-column panels, else all of it by warpgroup 0.
    ATOMIC_DQ, DS_PITCH, DS_LBO, DS_MN = atomic_dq, ds_pitch(cfg), ds_panel_bytes(cfg), cfg.ds_mn_major
    DS_OFF, STAGING, _ = dq_staging(cfg)
    DS_TILE = cfg.block_m * DS_PITCH  # 16-bit elements of one dSᵀ tile
    WARPGROUPS = BLOCK_M // 64
    DQ_N = cfg.dq_cols
    WDQ = SLICE // DQ_N  # warpgroups with a share of dQ_i's columns
    DQ_TILES, DQ_M_CHUNKS, M_STEPS = DQ_N // 8, BLOCK_N // 64, BLOCK_M // 16
    # The 64-query chunks of dQ_i a warpgroup computes: all of them (for its columns), or with
    # ``dq_chunk_split`` (all columns) its own share of them.
    CHUNK_SPLIT = ATOMIC_DQ and cfg.dq_chunk_split
    MY_CHUNKS = DQ_M_CHUNKS // WARPGROUPS if CHUNK_SPLIT else DQ_M_CHUNKS
    # bulk_dq: each warp's part of dQ_i through its own part of the shared staging tile; when a warp stages a
    # chunk, its groups committed since it last staged that one are the tile's other chunks.
    BULK_DQ = ATOMIC_DQ and cfg.bulk_dq
    add_dq_bulk = bt._make_dq_bulk_adder(cfg.dq_tiles, STAGING // 2, MY_CHUNKS - 1)
    OWN_PANEL = c.OWN_PANEL
    dq_prod = mn_major_product(DQ_N, c.kind, M_STEPS) if DS_MN else rs_product(DQ_N, c.kind, M_STEPS)

    # Warp specialisation (``cfg.dkdv_ws``): the consumers are threads 0 .. THREADS - 1, the producer warpgroup
    # follows; its first thread issues every TMA copy.  mbarriers: one per stage ("tile it has landed"), then
    # K_j / V_j's; named barriers EMPTY + s: "every consumer is done with stage s" (the consumers' bar.arrive,
    # the producer's bar.sync before it refills the stage).
    WS = cfg.dkdv_ws
    CONSUMERS, BLOCK_THREADS = THREADS, cfg.dkdv_threads
    ISSUER = CONSUMERS  # the producer's first thread
    SETMAXNREG = cfg.setmaxnreg  # 384 threads start at 168 registers: the producer gives most of its own
    PRODUCER_REGS, CONSUMER_REGS = REGISTERS
    EMPTY, HANDSHAKE = 1, CONSUMERS + HW.WARPGROUP  # named barrier 0 is the block barrier
    DS_READY = EMPTY + STAGES  # ws, step 1e: "every consumer has stored its rows of this tile's dSᵀ"
    # ws, step 1e: dV and dK waited for before it, so that dSᵀ's A registers are free for its dS fragments and
    # accumulators (with them live, 240 registers were too few at D = 128: ptxas serialised the wgmmas, C7512).
    EARLY_WAIT = ATOMIC_DQ and WS and not cfg.dq_overlap and not cfg.dk_last
    # ws, step 1e (dk_last): dQ's product before dK's; dK's waited for with the next tile's Sᵀ, and the stage it
    # read (Q_i) handed back only then.  dk_t crosses tiles in registers.
    DK_LAST = ATOMIC_DQ and cfg.dk_last
    # Each tile's gradient products waited for before its buffers are handed back: with two cp.async buffers, and
    # always with ws (the other consumer warpgroup's products fill the tensor cores meanwhile).  Otherwise (three
    # buffers) they run on across the next tile's barrier, the accumulators crossing tiles in registers.
    EACH_TILE = WS or STAGES == 2
    N_BARS = STAGES + 1
    OWN_BAR = STAGES
    PANELS = D_SMEM // PANEL  # TMA boxes per tile: one per 64-column panel (columns past D arrive as zeros)
    OWN_BYTES = 2 * BLOCK_M * D_SMEM * 2  # K_j and V_j
    STREAM_BYTES = 2 * BLOCK_N * D_SMEM * 2 + 2 * COL_BUF * 2  # Q_i, dO_i, and the box of lse2_i and D_i
    # The last step: dK_j, dV_j staged one at a time over the K_j, V_j tiles.
    write_staged = staged_row_writer(cfg)
    OUT_READY = DS_READY + 1  # ws: "every consumer's products are done" (consumers only)

    @device_function
    def issue_own(smem, maps, bars, b, h, k_start):
        """ws: K_j and V_j by TMA, one box per panel, on the mbarrier ``OWN_BAR``."""
        T.mbarrier_arrive_expect_tx(bars, OWN_BAR, OWN_BYTES)
        for p in range(PANELS):
            T.tma_load_4d(smem, p * BLOCK_M * PANEL, maps[2], PANEL * p, k_start, h, b, bars, OWN_BAR)
            T.tma_load_4d(smem, V_OFF + p * BLOCK_M * PANEL, maps[3], PANEL * p, k_start, h, b, bars, OWN_BAR)

    @device_function
    def issue_stream(smem, maps, bars, b, h, q_start, stage):
        """ws: Q_i, dO_i (one box per panel) and lse2_i, D_i (one box of two rows: the ``[lse2 | D]`` buffer) of
        the query tile at ``q_start`` into ``stage``; one arrival announces all their bytes at ``bars[stage]``."""
        T.mbarrier_arrive_expect_tx(bars, stage, STREAM_BYTES)
        for p in range(PANELS):
            T.tma_load_4d(smem, Q_OFF + stage * STRIDE + p * BLOCK_N * PANEL, maps[0], PANEL * p, q_start, h, b,
                          bars, stage)
            T.tma_load_4d(smem, DO_OFF + stage * STRIDE + p * BLOCK_N * PANEL, maps[1], PANEL * p, q_start, h, b,
                          bars, stage)
        # The float32 pairs as 16-bit words: columns 2·q_start ... of rows 0 (lse2) and 1 (D).
        T.tma_load_4d(smem, 2 * (COLS_F + stage * COL_BUF), maps[4], 2 * q_start, 0, h, b, bars, stage)

    @device_function
    def stage_columns(smem_f, base, lse2, delta, b, h, start, seqlen_q, tid):
        """lse2 and D of query rows ``start .. start + BLOCK_N - 1`` into ``smem_f[base ...]`` (plain loads
        and stores; +inf and 0 past the end, so those columns get P = 0 and dS = 0)."""
        for idx in range(tid, 2 * BLOCK_N, THREADS):
            row = start + idx % BLOCK_N
            if idx < BLOCK_N:
                smem_f[base + idx] = lse2[b, h, row] if row < seqlen_q else INF
            else:
                smem_f[base + idx] = delta[b, h, row] if row < seqlen_q else ZERO

    def make_transposed_p(MASKED):
        """Step 1b on a thread's Sᵀ fragments; ``MASKED``: the tile pair needs the mask (a compile-time choice,
        so the unmasked step has no compare)."""

        @device_function
        def transposed_p(S, smem_f, lse_at, q_col, key, seqlen_q, seqlen_k, causal, scale_log2):
            """``Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_col)`` in place; value i of tile n is key ``key + 8(i >> 1)``
            and query ``q_col + 8n + (i & 1)``, whose lse2 is ``smem_f[lse_at + 8n + (i & 1)]`` (``lse_at``
            unsigned: Numba adds a wraparound test to every signed index).  Masked: pairs past a ragged end or
            above the diagonal get 0."""
            lo = cuda.local.array(2, numba.int32)  # masked: key + 8r is seen by the columns 8n + cc in [lo, hi)
            hi = cuda.local.array(2, numba.int32)
            if MASKED:
                for r in range(2):
                    # The key's columns (masking.key_columns) as 32 bits: each of the 4 · N_TILES tests below is
                    # two 32-bit compares (a 64-bit compare is two ISETP).
                    first, past = d_key_columns(key + 8 * r, q_col, 8 * N_TILES, seqlen_q, seqlen_k, causal)
                    lo[r], hi[r] = I32(first), I32(past)
            for n in range(N_TILES):
                for cc in range(2):
                    lse2_c = smem_f[lse_at + u32(8 * n + cc)]
                    for r in range(2):
                        p = I.ex2_approx(S[n, 2 * r + cc] * scale_log2 - lse2_c)
                        if MASKED and (I32(8 * n + cc) < lo[r]) | (I32(8 * n + cc) >= hi[r]):
                            p = ZERO
                        S[n, 2 * r + cc] = p

        return transposed_p

    transposed_p, transposed_p_masked = make_transposed_p(False), make_transposed_p(True)

    # ws: 384 threads, so ptxas must keep to 65536 / 384 = 168 registers per thread until the roles split
    @kernel(fastmath=True, launch_bounds=(BLOCK_THREADS, 1) if WS else None)
    def flash_backward_dkdv_wgmma(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, scale, causal, maps):
        """One block: dK_j and dV_j for BLOCK_M keys of one (batch, head) (and, atomic route, their share of dQ)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        # The block's keys (the first key tiles have the most causal queries: they start first) and its first
        # gradient column.
        k_start, c0 = block_tile()
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))
        wg = warp_uniform(tid // HW.WARPGROUP)  # keys 64·wg .. 64·wg + 63 of the tile (warp-uniform to ptxas)
        lane = tid % 32
        g = lane // 4  # this thread's keys g and g + 8 of its warp's 16 ...
        t = lane % 4  # ... and columns (queries) 2t, 2t + 1 of every 8-column tile
        key0 = k_start + 16 * (tid // 32)  # the warp's first key
        # One block of dynamic shared memory, seen two ways: 16-bit tiles, float32 lse2 / D.
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem_f = cuda.shared.array(0, numba.float32, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)  # (step 1e: dSᵀ pairs in 32-bit words)
        bars = cuda.shared.array(N_BARS, numba.uint64)  # ws: one mbarrier per stage, then K_j / V_j's

        S = cuda.local.array((N_TILES, 4), numba.float32)  # Sᵀ, then Pᵀ
        dP = cuda.local.array((N_TILES, 4), numba.float32)  # dPᵀ, then dSᵀ
        dK = cuda.local.array((D_TILES, 4), numba.float32)
        dV = cuda.local.array((D_TILES, 4), numba.float32)
        PA = cuda.local.array((N_STEPS, 4), numba.uint32)  # Pᵀ as A fragments
        SA = cuda.local.array((N_STEPS, 4), numba.uint32)  # dSᵀ as A fragments
        DA = cuda.local.array((M_STEPS, 4), numba.uint32)  # step 1e (ldmatrix): dS (queries × keys) as A fragments
        dQ = cuda.local.array((DQ_TILES, 4), numba.float32)  # step 1e: this tile's share of dQ_i
        for n in range(D_TILES):
            for i in range(4):
                dK[n, i] = ZERO
                dV[n, i] = ZERO
        # Step 1e: warpgroup wg adds columns dq_col0 .. dq_col0 + DQ_N - 1 of dQ_i (none when it has no share);
        # its warp v reads queries 16v .. 16v + 15 of each 64-query chunk (the A rows of a wgmma).
        dq_group = 0 if CHUNK_SPLIT else wg  # this warpgroup's group of columns
        dq_share = CHUNK_SPLIT or wg * DQ_N < SLICE  # warp-uniform: this warpgroup has a share of dQ_i
        dq_col0 = c0 + dq_group * DQ_N
        chunk0 = wg * MY_CHUNKS if CHUNK_SPLIT else 0  # its first 64-query chunk
        dq_base = I.global_address(dq_accum, (b, h, 0, 0 if BULK_DQ else 2 * t)) if ATOMIC_DQ else numba.int64(0)
        dq_row_bytes = dq_accum.strides[2]
        bt_row, bt_col = I.d_ldmatrix_x4_bt_address(lane)  # ldmatrix.trans of dSᵀ rows → dS A fragments
        # ds_mn_major: step 1e's dSᵀ tile read MN-major as the A of dS K_j (k = key, 64 queries per 128-byte row)
        ds_desc = HW.d_make_smem_desc(HW.smem_address(smem, DS_OFF), DS_LBO, SBO, SW128)
        ds_row = u64(2048 * (tid // 32) + 128 * g)  # bytes to the row of key 16·warp + g (its atom, its line)
        k_desc_n = HW.d_make_smem_desc(HW.smem_address(smem, (dq_col0 // PANEL) * BLOCK_M * PANEL), OWN_PANEL, SBO,
                                       SW128)  # K_j read N-major (dQ += dS K_j), from this warpgroup's panel
        # 2 stages: dK_j, dV_j live in the arrays between tiles.  3 stages: the products are still running
        # when a tile ends, so the accumulators themselves cross into the next tile (more registers).
        dv_t = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(SLICE))
        dk_t = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(SLICE))
        scale_log2 = numba.float32(qk_scale_log2)

        k_desc = HW.d_make_smem_desc(HW.smem_address(smem, 64 * PANEL * wg), 16, SBO, SW128)
        v_desc = HW.d_make_smem_desc(HW.smem_address(smem, V_OFF + 64 * PANEL * wg), 16, SBO, SW128)
        q_desc = HW.d_make_smem_desc(HW.smem_address(smem, Q_OFF), 16, SBO, SW128)  # K-major (Sᵀ = K Qᵀ)
        do_desc = HW.d_make_smem_desc(HW.smem_address(smem, DO_OFF), 16, SBO, SW128)
        # N-major (dSᵀ Q, Pᵀ dO), from the first panel of the block's slice
        q_desc_n = HW.d_make_smem_desc(HW.smem_address(smem, Q_OFF + (c0 // PANEL) * BLOCK_N * PANEL), STREAM_PANEL,
                                       SBO, SW128)
        do_desc_n = HW.d_make_smem_desc(HW.smem_address(smem, DO_OFF + (c0 // PANEL) * BLOCK_N * PANEL),
                                        STREAM_PANEL, SBO, SW128)

        # Step 1: K_j, V_j and the first Q_i, dO_i, one cp.async group; the first lse2, D to shared.
        q_begin, q_end = d_query_range(k_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        i_first = q_begin // BLOCK_N
        n_tiles = (q_end + BLOCK_N - 1) // BLOCK_N - i_first
        if WS:
            if tid == ISSUER:
                for bar in range(N_BARS):
                    T.mbarrier_init(bars, bar, 1)  # one arrival per phase: the issuer's expect_tx
                T.fence_mbarrier_init()  # ... visible to the TMA unit (the async proxy) too
            cuda.syncthreads()  # the mbarriers are initialised before anyone waits on them
            if wg == WARPGROUPS:
                # The producer: K_j, V_j once, then query tile it into stage it % STAGES as soon as every consumer
                # is done with tile it - STAGES.  Its other threads only join the EMPTY handshakes.
                if SETMAXNREG:
                    HW.setmaxnreg_dec(PRODUCER_REGS)  # a few counters and addresses: the rest go to the consumers
                if tid == ISSUER and n_tiles > 0:
                    issue_own(smem, maps, bars, b, h, k_start)
                for it in range(n_tiles):
                    if it >= STAGES:
                        HW.named_barrier_sync(EMPTY + it % STAGES, HANDSHAKE)
                    if tid == ISSUER:
                        issue_stream(smem, maps, bars, b, h, (i_first + it) * BLOCK_N, it % STAGES)
                # The consumers release every tile; the releases nobody refilled are taken here, so that each
                # named barrier's counts match before the block exits.
                for it in range(max(n_tiles - STAGES, 0), n_tiles):
                    HW.named_barrier_sync(EMPTY + it % STAGES, HANDSHAKE)
                # Done: the thread ends here (ptxas keeps a decreased register count only if no instruction
                # reachable after the decrease needs more).
                return
            if SETMAXNREG:
                HW.setmaxnreg_inc(CONSUMER_REGS)  # a consumer: take the registers the producer gave back
            if n_tiles > 0:
                while not T.mbarrier_try_wait_parity(bars, OWN_BAR, 0):  # K_j, V_j have landed
                    pass
        elif n_tiles > 0:
            load_own(smem, 0, k, b, h, k_start, seqlen_k, tid)
            load_own(smem, V_OFF, v, b, h, k_start, seqlen_k, tid)
            load_stream(smem, Q_OFF, q, b, h, i_first * BLOCK_N, seqlen_q, tid)
            load_stream(smem, DO_OFF, do, b, h, i_first * BLOCK_N, seqlen_q, tid)
            stage_columns(smem_f, COLS_F, lse2, delta, b, h, i_first * BLOCK_N, seqlen_q, tid)
        I.cp_async_commit()

        for it in range(n_tiles):
            q_start = (i_first + it) * BLOCK_N
            buf, nxt = it % STAGES, (it + 1) % STAGES
            lbuf = buf if WS else it % 2  # this tile's lse2 / D buffer
            if WS:
                # Step 1 (ws): the producer's copies of tile it have landed (the (it // STAGES)-th phase of
                # the stage's mbarrier); nothing to start here.
                while not T.mbarrier_try_wait_parity(bars, buf, (it // STAGES) % 2):
                    pass
            else:
                # Step 1 (each tile): Q_i, dO_i have landed (the only group in flight); start Q_{i+1}, dO_{i+1}.
                I.cp_async_wait(0)
                HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores (the async proxy)
                # Everyone's copies and lse2 / D stores are visible; every warpgroup is done with the buffers
                # refilled now: with 2 stages it waited for tile i - 1's products; with 3 the buffer is tile
                # i - 2's, whose products finished before tile i - 1's Sᵀ (step 1b's wait).
                cuda.syncthreads()
                if it + 1 < n_tiles:
                    load_stream(smem, Q_OFF + nxt * STRIDE, q, b, h, q_start + BLOCK_N, seqlen_q, tid)
                    load_stream(smem, DO_OFF + nxt * STRIDE, do, b, h, q_start + BLOCK_N, seqlen_q, tid)
                    I.cp_async_commit()

            # Step 1a: Sᵀ = K_j Q_iᵀ and dPᵀ = V_j dO_iᵀ, the warpgroup's 64 keys × BLOCK_N queries: two
            # groups, so that Pᵀ is computed while dPᵀ is still on the tensor cores.
            buf_off = u64((buf * STRIDE * 2) >> 4)  # descriptor address field: bytes >> 4
            st = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
            dpt = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
            HW.wgmma_fence()
            st = ss_prod(st, k_desc, q_desc + buf_off)
            HW.wgmma_commit_group()
            dpt = ss_prod(dpt, v_desc, do_desc + buf_off)
            HW.wgmma_commit_group()
            # lse2, D of tile i + 1 into the other buffer (read by nobody since the barrier): the loads'
            # latency hides under the products.  (ws: they came with the tile.)
            if not WS and it + 1 < n_tiles:
                stage_columns(smem_f, COLS_F + (1 - lbuf) * COL_BUF, lse2, delta, b, h, q_start + BLOCK_N,
                              seqlen_q, tid)
            # Sᵀ is done, and so is every earlier group (they complete in order: tile i - 1's dV and dK
            # too); dPᵀ may still run.
            HW.wgmma_wait_group(1)
            st = HW.wgmma_fence_operand(st)
            HW.acc_to_array(st, S)
            if DK_LAST and it > 0:
                # dK_j += dSᵀ_{i-1} Q_{i-1}, issued last in tile i - 1, is done too: its stage goes back.
                HW.named_barrier_arrive(EMPTY + (it - 1) % STAGES, HANDSHAKE)

            # Step 1b: Pᵀ = exp2(Sᵀ · scale · log2 e − lse2_col), invisible pairs 0.
            # Value i of tile n: key g + 8(i >> 1), query 8n + 2t + (i & 1).
            cols = u32(COLS_F + lbuf * COL_BUF + 2 * t)  # this thread's first column of lse2 (D: BLOCK_N on)
            if d_tile_needs_mask(q_start, k_start, BLOCK_N, BLOCK_M, seqlen_q, seqlen_k, causal):
                transposed_p_masked(S, smem_f, cols, q_start + 2 * t, key0 + g, seqlen_q, seqlen_k, causal,
                                    scale_log2)
            else:
                transposed_p(S, smem_f, cols, q_start + 2 * t, key0 + g, seqlen_q, seqlen_k, causal, scale_log2)

            # Step 1c: dV_j += Pᵀ dO_i issued (Pᵀ packed from the accumulators, dO_i read N-major) ...
            for kk in range(N_STEPS):
                p_frags(PA, S, kk, kk)
            dv_t = HW.wgmma_fence_operand(HW.acc_from_array(dV, SLICE) if EACH_TILE else dv_t)
            HW.wgmma_fence()
            dv_t = rs_prod(dv_t, PA, do_desc_n + buf_off)
            HW.wgmma_commit_group()
            HW.wgmma_wait_group(1)  # ... dPᵀ is done; the dV product may still run
            dpt = HW.wgmma_fence_operand(dpt)
            HW.acc_to_array(dpt, dP)

            # Step 1d: dSᵀ = Pᵀ ∘ (dPᵀ − D_col), and dK_j += dSᵀ Q_i.
            ds_buf = (it % 2) * DS_TILE if WS else 0  # step 1e's dSᵀ buffer (16-bit elements past DS_OFF)
            for n in range(N_TILES):
                for cc in range(2):
                    delta_c = smem_f[cols + u32(BLOCK_N + 8 * n + cc)]
                    for r in range(2):
                        dP[n, 2 * r + cc] = S[n, 2 * r + cc] * (dP[n, 2 * r + cc] - delta_c)
            # step 1e's dSᵀ: this thread's first 32-bit word of the shared [key][query] tile (unsigned, as above)
            ds_word = u32((DS_OFF + ds_buf + (16 * (tid // 32) + g) * DS_PITCH + 2 * t) // 2)
            for kk in range(N_STEPS):
                p_frags(SA, dP, kk, kk)
                if ATOMIC_DQ and not DS_MN:  # step 1e's dSᵀ: the packed pairs to the shared [key][query]
                    # tile (before the dK product is issued: a wgmma's A registers may not even be read while
                    # it runs)
                    word = ds_word + u32(8 * kk)
                    smem32[word] = SA[kk, 0]
                    smem32[word + u32(4 * DS_PITCH)] = SA[kk, 1]  # 8 keys down: 8 · DS_PITCH / 2 words
                    smem32[word + u32(4)] = SA[kk, 2]  # 8 queries right
                    smem32[word + u32(4 * DS_PITCH + 4)] = SA[kk, 3]
                if ATOMIC_DQ and DS_MN:  # the same in the MN-major layout: pair (key, queries q, q + 1) is 4
                    # bytes of key's swizzled row; keys g and g + 8 are one 8-row atom (1024 bytes) apart,
                    # queries q and q + 8 one 16-byte chunk (before the swizzle).  Each store's 32 lanes hit 32
                    # banks: 8 keys, each its own chunk, × 4 pairs.
                    for half in range(2):
                        q8 = 16 * kk + 8 * half  # the first query of the A fragment's half (+ 2t)
                        word = u64(2 * (DS_OFF + ds_buf) + (q8 // PANEL) * DS_LBO
                                   + 16 * ((((q8 % PANEL) // 8) ^ g) & 7) + 4 * t + ds_row) // 4
                        smem32[word] = SA[kk, 2 * half]
                        smem32[word + 256] = SA[kk, 2 * half + 1]  # key g + 8: 1024 bytes on
            if not DK_LAST:
                dk_t = HW.wgmma_fence_operand(HW.acc_from_array(dK, SLICE) if EACH_TILE else dk_t)
                HW.wgmma_fence()
                dk_t = rs_prod(dk_t, SA, q_desc_n + buf_off)
                HW.wgmma_commit_group()
            if EARLY_WAIT:  # dV, dK done before step 1e: dSᵀ's A registers are free for its own
                HW.wgmma_wait_group(0)
                HW.acc_to_array(HW.wgmma_fence_operand(dv_t), dV)
                HW.acc_to_array(HW.wgmma_fence_operand(dk_t), dK)
                # Every read of stage buf is done (step 1e reads K_j and the dSᵀ tile only): hand it back now.
                HW.named_barrier_arrive(EMPTY + buf, HANDSHAKE)
            if ATOMIC_DQ:
                # Step 1e: dQ_i += dS K_j, added into the float32 accumulator in global memory.  It needs
                # every key of the tile: every warp's rows of dSᵀ are written (ldmatrix reads through the
                # generic proxy; ds_mn_major: the tensor cores read them through the async proxy, so fenced).
                # ws: the consumers only, at a named barrier; the two dSᵀ buffers alternate, and a warpgroup
                # overwrites one only after passing the next tile's barrier, which the other reaches after its
                # reads of this one (its dQ product, waited for below).
                if DS_MN:
                    HW.fence_proxy_async()
                if WS:
                    HW.named_barrier_sync(DS_READY, CONSUMERS)
                else:
                    cuda.syncthreads()
                if DK_LAST:  # dV is done (its A registers free for dS's); dK is not issued yet
                    HW.wgmma_wait_group(0)
                    HW.acc_to_array(HW.wgmma_fence_operand(dv_t), dV)
                if dq_share:
                    for c in range(MY_CHUNKS):
                        mc = chunk0 + c
                        q_row0 = 64 * mc + 16 * (tid // 32 % 4)  # the warp's 16 queries of the chunk
                        if not DS_MN:
                            for kk in range(M_STEPS):  # dS = (dSᵀ)ᵀ: ldmatrix.trans gives the A fragments
                                a = I.ldmatrix_x4_trans(smem, DS_OFF + ds_buf + (16 * kk + bt_row) * DS_PITCH
                                                        + q_row0 + bt_col)
                                for i in range(4):
                                    DA[kk, i] = a[i]
                        dq_t = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(DQ_N))
                        HW.wgmma_fence()
                        if DS_MN:  # dS = (dSᵀ)ᵀ: the chunk's panel of the tile, read MN-major by the wgmma
                            dq_t = dq_prod(dq_t, ds_desc + u64((2 * ds_buf + mc * DS_LBO) >> 4), k_desc_n)
                        else:
                            dq_t = dq_prod(dq_t, DA, k_desc_n)
                        HW.wgmma_commit_group()
                        if DK_LAST:
                            # dK_j += dSᵀ Q_i last, left running under the staging of dQ_i and into the next tile.
                            dk_t = rs_prod(HW.wgmma_fence_operand(dk_t), SA, q_desc_n + buf_off)
                            HW.wgmma_commit_group()
                            HW.wgmma_wait_group(1)  # dQ's product is done
                        else:
                            HW.wgmma_wait_group(0)  # (dV, dK too: groups complete in order)
                        HW.acc_to_array(HW.wgmma_fence_operand(dq_t), dQ)
                        if BULK_DQ:  # the warp's part of the tile: its 16 queries of the chunk × the share's columns
                            add_dq_bulk(dQ, smem_f, dq_base + q_start * dq_row_bytes,
                                        (4 * mc + tid // 32 % 4) * WDQ + dq_group, lane)
                        else:
                            # One reduction per accumulator pair (query g or g + 8, columns 8n + 2t, + 1), with no
                            # bounds test: the accumulator has whole tiles (see launch_backward_wgmma).
                            for r in range(2):
                                addr = dq_base + (q_start + q_row0 + g + 8 * r) * dq_row_bytes + 4 * dq_col0
                                for n in range(DQ_TILES):
                                    I.red_add_f32x2(addr + 32 * n, dQ[n, 2 * r], dQ[n, 2 * r + 1])
                # (the next tile's barrier comes after every warpgroup's dQ product of this dSᵀ; ws: see above)
            if EACH_TILE and not EARLY_WAIT and not DK_LAST:  # both products read Q_i, dO_i, refilled after the
                # next barrier
                HW.wgmma_wait_group(0)
                HW.acc_to_array(HW.wgmma_fence_operand(dv_t), dV)
                HW.acc_to_array(HW.wgmma_fence_operand(dk_t), dK)
            if WS and not EARLY_WAIT and not DK_LAST:  # every read of stage buf is done (the products above, the
                # lse2 / D loads)
                HW.named_barrier_arrive(EMPTY + buf, HANDSHAKE)
            # (3 stages: they run on under the next tile's barrier and Sᵀ, dPᵀ)
            dv_t = HW.wgmma_fence_operand(dv_t)
            dk_t = HW.wgmma_fence_operand(dk_t)

        I.cp_async_wait_all()  # nothing left in flight (also when no query tile sees these keys) ...
        if not EACH_TILE:  # ... nor any product
            HW.wgmma_wait_group(0)
            HW.acc_to_array(HW.wgmma_fence_operand(dv_t), dV)
            HW.acc_to_array(HW.wgmma_fence_operand(dk_t), dK)
        if DK_LAST:  # ... nor the last tile's dK product; then its stage goes back
            HW.wgmma_wait_group(0)
            HW.acc_to_array(HW.wgmma_fence_operand(dk_t), dK)
            if n_tiles > 0:
                HW.named_barrier_arrive(EMPTY + (n_tiles - 1) % STAGES, HANDSHAKE)

        # dK_j · scale and dV_j, written once (head-dim padding and keys past the end not written), staged in
        # shared memory: each warp puts its 16 keys' rows there as 16-bit pairs, then writes whole 16-byte
        # chunks.  The staging is the K_j, V_j tiles, free once every consumer's last product has read them
        # (dQ's product reads all of K_j): the consumers meet first (ws: the producer has left).
        if WS:
            HW.named_barrier_sync(OUT_READY, CONSUMERS)
        else:
            cuda.syncthreads()
        sc = numba.float32(scale)
        write_staged(smem, smem32, tid // 32, g, t, lane, dK, sc, dk, b, h, key0, seqlen_k, c0)
        syncwarp()  # every lane has read its chunks before the rows are overwritten
        write_staged(smem, smem32, tid // 32, g, t, lane, dV, numba.float32(1), dv, b, h, key0, seqlen_k, c0)
        if BULK_DQ and lane == 0:
            # The last dQ reductions' reads of their staging (a region of its own) ran under the stores; once
            # they are done the block's shared memory may go.  The additions need not have landed: the grid's
            # end makes them visible to step 2'.
            HW.bulk_wait_group_read(0)

    return flash_backward_dkdv_wgmma


@functools.cache
def dq_wgmma_kernel(cfg: WGBackwardConfig):
    """The compiled dQ kernel (step 2) for one configuration (cached)."""
    c = _Consts(cfg, cfg.dq_stages)
    BLOCK_M, BLOCK_N, D, THREADS = c.BLOCK_M, c.BLOCK_N, c.D, c.THREADS
    DO_OFF, K_OFF, V_OFF, STRIDE, STAGES = c.A1, c.S0, c.S1, c.STRIDE, c.DQ_STAGES
    N_TILES, D_TILES, N_STEPS = c.N_TILES, c.D_TILES, c.N_STEPS
    SLICE, D_SMEM = c.SLICE, c.D_SMEM
    STREAM_PANEL, SMEM_ALIGN = c.STREAM_PANEL, c.SMEM_ALIGN
    ss_prod, rs_prod = c.ss, c.rs
    SW128, SBO = HW.SWIZZLE_128B, 1024
    ZERO = numba.float32(0)
    u32, u64 = numba.uint32, numba.uint64
    steps = fragment_steps(N_TILES, D_TILES, D, cfg.input_kind)
    mask_scores, p_frags = steps.mask_scores, steps.p_frags
    load_own = swizzled_tile_loader(BLOCK_M, THREADS, D, D_SMEM)
    load_stream = swizzled_tile_loader(BLOCK_N, THREADS, D, D_SMEM)
    block_tile = cfg.block_tile(BLOCK_M, last_first=True)
    write_staged = staged_row_writer(cfg)

    @kernel(fastmath=True)
    def flash_backward_dq_wgmma(q, k, v, do, lse2, delta, dq, qk_scale_log2, scale, causal):
        """One block: dQ_i for BLOCK_M queries of one (batch, head)."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        q_start, c0 = block_tile()  # the block's queries (longest causal rows first) and first dQ column
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        tid = numba.int64(u32(cuda.threadIdx.x))
        wg = warp_uniform(tid // HW.WARPGROUP)  # queries 64·wg .. 64·wg + 63 of the tile (warp-uniform to ptxas)
        lane = tid % 32
        g = lane // 4
        t = lane % 4
        row0 = q_start + 16 * (tid // 32)  # the warp's first query
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        smem32 = cuda.shared.array(0, numba.uint32, alignment=SMEM_ALIGN)  # (the last step: 32-bit pairs)

        S = cuda.local.array((N_TILES, 4), numba.float32)  # S, then P
        dP = cuda.local.array((N_TILES, 4), numba.float32)  # dP, then dS
        dQ = cuda.local.array((D_TILES, 4), numba.float32)  # dQ_i between tiles (2 stages), or the epilogue's copy
        SA = cuda.local.array((N_STEPS, 4), numba.uint32)  # dS as A fragments
        lse2_r = cuda.local.array(2, numba.float32)  # rows g, g + 8: lse2_i ...
        delta_r = cuda.local.array(2, numba.float32)  # ... and D_i
        for r in range(2):
            row = row0 + g + 8 * r
            lse2_r[r] = lse2[b, h, row] if row < seqlen_q else ZERO  # rows past the end are masked anyway
            delta_r[r] = delta[b, h, row] if row < seqlen_q else ZERO
        for n in range(D_TILES):
            for i in range(4):
                dQ[n, i] = ZERO
        dq_t = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(SLICE))  # (3 stages: the accumulator crosses tiles)
        scale_log2 = numba.float32(qk_scale_log2)

        q_desc = HW.d_make_smem_desc(HW.smem_address(smem, 64 * PANEL * wg), 16, SBO, SW128)
        do_desc = HW.d_make_smem_desc(HW.smem_address(smem, DO_OFF + 64 * PANEL * wg), 16, SBO, SW128)
        k_desc = HW.d_make_smem_desc(HW.smem_address(smem, K_OFF), 16, SBO, SW128)  # K-major (S = Q Kᵀ)
        v_desc = HW.d_make_smem_desc(HW.smem_address(smem, V_OFF), 16, SBO, SW128)
        # N-major (dS K), from the first panel of the block's slice
        k_desc_n = HW.d_make_smem_desc(HW.smem_address(smem, K_OFF + (c0 // PANEL) * BLOCK_N * PANEL), STREAM_PANEL,
                                       SBO, SW128)

        # Q_i, dO_i and the first K_j, V_j: one cp.async group.
        _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
        n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        load_own(smem, 0, q, b, h, q_start, seqlen_q, tid)
        load_own(smem, DO_OFF, do, b, h, q_start, seqlen_q, tid)
        if n_tiles > 0:
            load_stream(smem, K_OFF, k, b, h, 0, seqlen_k, tid)
            load_stream(smem, V_OFF, v, b, h, 0, seqlen_k, tid)
        I.cp_async_commit()

        for j in range(n_tiles):
            k_start = j * BLOCK_N
            buf, nxt = j % STAGES, (j + 1) % STAGES
            # K_j, V_j have landed (the only group in flight); start K_{j+1}, V_{j+1}.
            I.cp_async_wait(0)
            HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores
            # Everyone's copies are visible; every warpgroup is done with the buffers refilled now (tile
            # j - 1's with 2 stages; with 3, tile j - 2's, whose dQ product finished before tile j - 1's S).
            cuda.syncthreads()
            if j + 1 < n_tiles:
                load_stream(smem, K_OFF + nxt * STRIDE, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                load_stream(smem, V_OFF + nxt * STRIDE, v, b, h, k_start + BLOCK_N, seqlen_k, tid)
                I.cp_async_commit()

            # S = Q_i K_jᵀ and dP = dO_i V_jᵀ (64 queries × BLOCK_N keys per warpgroup): two groups, so
            # that P is computed while dP is still on the tensor cores.
            buf_off = u64((buf * STRIDE * 2) >> 4)
            s = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
            dp = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
            HW.wgmma_fence()
            s = ss_prod(s, q_desc, k_desc + buf_off)
            HW.wgmma_commit_group()
            dp = ss_prod(dp, do_desc, v_desc + buf_off)
            HW.wgmma_commit_group()
            HW.wgmma_wait_group(1)  # S is done, and every earlier group (tile j - 1's dQ); dP may still run
            s = HW.wgmma_fence_operand(s)
            HW.acc_to_array(s, S)

            # P = exp2(S · scale · log2 e − lse2_row), invisible keys 0 (S = -inf first).
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                mask_scores(S, row0, k_start, seqlen_q, seqlen_k, causal, g, t)
            for r in range(2):
                for n in range(N_TILES):
                    for cc in range(2):
                        S[n, 2 * r + cc] = I.ex2_approx(S[n, 2 * r + cc] * scale_log2 - lse2_r[r])

            # dS = P ∘ (dP − D_row).
            HW.wgmma_wait_group(0)
            dp = HW.wgmma_fence_operand(dp)
            HW.acc_to_array(dp, dP)
            for r in range(2):
                for n in range(N_TILES):
                    for cc in range(2):
                        dP[n, 2 * r + cc] = S[n, 2 * r + cc] * (dP[n, 2 * r + cc] - delta_r[r])

            # dQ_i += dS K_j: dS packed from the accumulators, K_j read N-major.
            for kk in range(N_STEPS):
                p_frags(SA, dP, kk, kk)
            dq_t = HW.wgmma_fence_operand(HW.acc_from_array(dQ, SLICE) if STAGES == 2 else dq_t)
            HW.wgmma_fence()
            dq_t = rs_prod(dq_t, SA, k_desc_n + buf_off)
            HW.wgmma_commit_group()
            if STAGES == 2:  # it reads K_j, refilled after the next barrier: wait here
                HW.wgmma_wait_group(0)
                HW.acc_to_array(HW.wgmma_fence_operand(dq_t), dQ)
            # (3 stages: it runs on under the next tile's barrier and S, dP)
            dq_t = HW.wgmma_fence_operand(dq_t)

        I.cp_async_wait_all()  # no copy left in flight (only Q_i's group when no key tile was visible) ...
        if STAGES == 3:  # ... nor any product
            HW.wgmma_wait_group(0)
            HW.acc_to_array(HW.wgmma_fence_operand(dq_t), dQ)

        # dQ_i · scale, written once (a row that sees no key keeps dQ_i = 0), staged over the Q_i, dO_i tiles
        # (each warp its 16 rows), free once every warpgroup's products are done and every copy has landed: the
        # block meets first.
        cuda.syncthreads()
        write_staged(smem, smem32, tid // 32, g, t, lane, dQ, numba.float32(scale), dq, b, h, row0, seqlen_q, c0)

    return flash_backward_dq_wgmma


# ----------------------------------------------------------------------------
# Configuration and launch
# ----------------------------------------------------------------------------


#: The largest head dim up to which ``backend="auto"`` picks this backward on Hopper (and again above
#: :data:`AUTO_MIN_WIDE_HEAD_DIM`, :func:`auto_takes_head_dim`).  Above it the head dim is cut into slices of 128
#: columns.  At D = 256 (bf16, N = 1k–16k, ``tc-backward-NVIDIA-H200-2026-12-02-wg256.json``) that first measured
#: 75–104 TFLOP/s against 97–167 for the ``mma.sync`` backward: Sᵀ's and dPᵀ's 16 k-steps were a loop that ptxas
#: waited in after every second k-step.  Unrolled (:func:`~nbflash.forward_wgmma.ss_product`, 2026-12-07) it
#: measured 145–188 against 90–121 by the ``mma.sync`` backward's deterministic route and, non-causal, 153–170 by
#: its atomic one (H100, bf16, N = 1k / 4k / 16k, ``tc-backward-NVIDIA-H100-80GB-HBM3-2026-12-07-s43-d256*.json``).
AUTO_MAX_HEAD_DIM = 128
#: From this head dim on the padded width is four panels (two whole slices) and ``auto`` takes this backward
#: again.  A padded width of three panels (D = 136 … 192) runs its second slice half on a zero panel; not timed,
#: so ``auto`` keeps the ``mma.sync`` backward there.
AUTO_MIN_WIDE_HEAD_DIM = 3 * PANEL + 1


def auto_takes_head_dim(head_dim: int) -> bool:
    """Does ``backend="auto"`` pick this backward at this head dim on Hopper (:data:`AUTO_MAX_HEAD_DIM`)?"""
    return takes_head_dim(head_dim) and (head_dim <= AUTO_MAX_HEAD_DIM or head_dim >= AUTO_MIN_WIDE_HEAD_DIM)


def takes_head_dim(head_dim: int) -> bool:
    """Does the wgmma backward take this head dim (a multiple of 8 up to 256; above 128 in slices)?"""
    return 0 < head_dim <= 256 and head_dim % 8 == 0


@functools.cache
def choose_config(head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR,
                  ws: bool = True) -> WGBackwardConfig:
    """The configuration for a head dim (a multiple of 8 up to 256), measured on the H200.

    GPU, D ≤ 128: two computing warpgroups, 128 keys × 64-query streamed tiles, the dQ kernel with three K/V
    buffers (1–3 % ahead of two, ``tc-backward-NVIDIA-H200-2026-11-30-stages.json``), and the dK/dV kernel
    warp-specialised (``dkdv_ws``: a producer warpgroup copying by TMA, 2 stages).  Against the kernels
    without it, in one run (``tc-backward-NVIDIA-H200-2026-12-04-ws2.json``, bf16, N = 1k / 4k / 16k, causal
    and not; geometric means): D = 128 327 TFLOP/s against 280 (128 × 64, cp.async, the previous default);
    D = 64 252 by the atomic dQ route (:func:`prefers_atomic`) against 236 (one warpgroup, 64 × 64, three
    blocks per SM, the previous default).  3 or 4 ws stages measured no faster than 2
    (``…-12-04-ws.json``).  Then dQ added by bulk reductions from shared memory (``bulk_dq``; the route
    :func:`prefers_atomic` takes), at D ≤ 64 its product issued under dV's and dK's (``dq_overlap``): in
    ``…-12-04-bulk-final.json`` (N = 512 … 16k, bf16) D = 128 334.5 against 298.1 for the deterministic ws
    pick, D = 64 263.5 against 232.4 by ``red.global.add``.  At D = 64, N = 1k / 4k / 16k: this pick 287
    (``…-bulk2.json``), 128-query tiles with their chunks split 286; in ``…-bulk.json`` 64-query tiles without
    the overlap 282 and 128-query tiles unsplit 293 — that kernel keeps 16 bytes in local memory (the
    offline check forbids it), and its overlapped version was not timed.  ``ws=False``: the best configuration
    without TMA (128 × 64, or 64 × 64 at D ≤ 64), for arrays whose strides the TMA cannot step
    (:func:`config_for`).
    D > 128 (timed at D = 256 only, where ``auto`` takes it since 2026-12-07, :data:`AUTO_MAX_HEAD_DIM`): one
    warpgroup, 64 × 64, two slices of 128 gradient columns (193 KB of shared memory at D = 256; a padded D of
    192 takes a zero panel), dQ by its own kernel only (:func:`takes_atomic`).
    Simulator: one warpgroup and 16-row streamed tiles (D > 128: the same slices), without ws (the tests run
    the ws kernel explicitly: a producer warpgroup doubles the simulated threads).
    """
    if not takes_head_dim(head_dim):
        raise ValueError(f"the wgmma backward takes head dims that are multiples of 8 up to 256, got {head_dim}")
    d_slice = 2 * PANEL if head_dim > 2 * PANEL else 0
    if simulator:
        return WGBackwardConfig(64, 16, head_dim, input_kind, d_slice=d_slice)
    if d_slice:
        return WGBackwardConfig(64, 64, head_dim, input_kind, d_slice=d_slice)
    if ws:  # dQ by bulk reductions (the route prefers_atomic takes); at D <= 64 its product under dV's and dK's
        return WGBackwardConfig(128, 64, head_dim, input_kind, dq_stages=3, dkdv_ws=True, bulk_dq=True,
                                dq_overlap=head_dim <= PANEL)
    if head_dim <= 64:
        return WGBackwardConfig(64, 64, head_dim, input_kind)
    return WGBackwardConfig(128, 64, head_dim, input_kind, dq_stages=3)


#: At a padded D of 64, causal calls with fewer keys than this keep the configuration without TMA (one warpgroup,
#: 64 × 64, three blocks per SM, the deterministic route): at 512 keys 127 / 126 TFLOP/s (bf16 / fp16) against
#: 123 / 123 for the ws kernel with bulk dQ, which leads from 1k (183 against 174;
#: ``tc-backward-NVIDIA-H200-2026-12-04-bulk-final.json``).
WS_MIN_CAUSAL_KEYS_D64 = 1024


def config_for(head_dim: int, input_kind: str, do, q, k, v, o, causal: bool = False) -> WGBackwardConfig:
    """:func:`choose_config`'s pick for these arrays (canonical ``(B, H, N, D)`` views or descriptors): the
    configuration without TMA where the TMA cannot step along ``do``, ``q``, ``k`` or ``v`` (a stride that is not
    a positive multiple of 16 bytes, as for k and v broadcast over heads), and for short causal calls at a
    padded D of 64 (:data:`WS_MIN_CAUSAL_KEYS_D64`)."""
    cfg = choose_config(head_dim, input_kind)
    short = causal and cfg.d_pad <= PANEL and k.shape[2] < WS_MIN_CAUSAL_KEYS_D64
    if cfg.dkdv_ws and (short or not can_implement(cfg, do, q, k, v, o)[0]):
        cfg = choose_config(head_dim, input_kind, ws=False)
    return cfg


def prefers_atomic(cfg: WGBackwardConfig) -> bool:
    """Does ``deterministic=None`` take the atomic dQ route for ``cfg``?  Where the warp-specialised dK/dV
    kernel adds dQ by bulk reductions (``bulk_dq``, the GPU defaults up to D = 128): 5 products where the two
    kernels do 7 (the dQ kernel recomputes S and dP).  bf16, N = 1k / 4k / 16k, causal and not, geometric
    means: D = 128 362–365 TFLOP/s against 327 deterministic; D = 64 282–287 against 236 deterministic and 252
    by ``red.global.add`` (``tc-backward-NVIDIA-H200-2026-12-04-bulk*.json``, ``…-ws2.json``)."""
    return cfg.dkdv_ws and cfg.bulk_dq and takes_atomic(cfg)


def can_implement(cfg: WGBackwardConfig, *arrays, atomic: bool = False) -> tuple[bool, str]:
    """Will this configuration run on these arrays (do, q, k, v, o, ...) on this device (``atomic``: by the
    atomic dQ route)?  ``(ok, reason)``."""
    ok, why = supported_device()
    if not ok:
        return False, why
    if atomic and not takes_atomic(cfg):
        return False, _atomic_refusal(cfg)
    need = shared_bytes(cfg, "dkdv_atomic") if atomic else max(shared_bytes(cfg, "dkdv"), shared_bytes(cfg, "dq"))
    limit = max_shared_per_block()
    if need > limit:
        return False, f"needs {need} bytes of shared memory per block, the device allows {limit}"
    # do, q, k, v are copied by cp.async; o is read by the SIMT preprocess; the gradients are written in
    # 16-byte chunks (the kernels' last step)
    why = tile_rows_problem(cfg.head_dim, ("do", "q", "k", "v", "o", "dq", "dk", "dv"), arrays, copied=4,
                            written=("dq", "dk", "dv"))
    if not why and cfg.dkdv_ws:  # the dK/dV kernel copies them by TMA: strides of whole 16-byte units
        why = next(filter(None, (T.stride_problem(name, a) for name, a in zip(("do", "q", "k", "v"), arrays,
                                                                              strict=False))), "")
    return not why, why


def takes_atomic(cfg: WGBackwardConfig) -> bool:
    """Can ``cfg`` run the atomic dQ route (step 1e: its wgmma's M is 64 queries of the streamed tile)?

    Not with slices (D > 128): beside the slice's dK and dV, the dQ product's accumulator left ptxas too
    few registers for the wgmma pipeline, and it serialised every wgmma of the kernel (its C7512), with
    dQ products of 128 columns and of 64 alike."""
    return cfg.block_n % 64 == 0 and cfg.slices == 1


def _atomic_refusal(cfg: WGBackwardConfig) -> str:
    if cfg.slices > 1:
        return (f"the atomic dQ route takes one slice of the head dim (D ≤ 128; ptxas serialises its wgmmas "
                f"beside a slice's dK and dV), got {cfg.slices} slices")
    return f"the atomic dQ route needs block_n a multiple of 64 (the M of its wgmma), got {cfg.block_n}"


def launch_backward_wgmma(cfg: WGBackwardConfig, do, q, k, v, o, lse, dq, dk, dv, scale: float, causal: bool,
                          stream=0, empty=None, check: bool = True, deterministic: bool = True):
    """Run the steps on canonical ``(B, H, N, D)`` views (float16, or bfloat16 as uint16), writing dq, dk, dv.

    ``deterministic=True``: steps 0, 1, 2 (dQ by its own kernel; the same bits on every run).  ``False``:
    steps 0, 1 with 1e (dQ added by float32 atomics into a cleared accumulator), 2' (the SIMT conversion of
    :mod:`nbflash.backward`); ``cfg`` must then :func:`takes_atomic`.  ``empty(shape, dtype)`` allocates the
    scratch (default: the array module of ``q``); ``check=False`` skips :func:`can_implement` for a caller
    that has just run it.
    """
    ok, why = can_implement(cfg, do, q, k, v, o, dq, dk, dv, atomic=not deterministic) if check else (True, "")
    if not ok:
        raise ValueError(f"wgmma backward configuration {cfg} cannot run: {why}")
    if empty is None:
        empty = array_module(q).empty
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    simt = bw.choose_config(head_dim, cfg.input_kind, simulator=SIMULATOR).dq  # steps 0 and 2'
    # lse2 and D side by side, ``[b, h, 0 | 1, row]``, rows padded to whole 16 bytes: with ``dkdv_ws`` the TMA
    # brings a query tile's lse2 and D as one box (its 16-bit view ``columns``: zeros past the last query).
    pitch = -(-seqlen_q // 4) * 4
    both = empty((batch, heads, 2, pitch), np.float32)
    lse2, delta = (_view(both, (batch, heads, seqlen_q), both.strides[:2] + (4,), np.float32, 4 * pitch * i)
                   for i in (0, 1))
    columns = _view(both, (batch, heads, 2, 2 * seqlen_q), both.strides[:3] + (2,), np.uint16)
    # The atomic route's accumulator has whole query tiles and whole panels: step 1e adds every row and column
    # of its share without a bounds test (a branch there makes ptxas serialise the wgmmas); rows past the end
    # get zeros (dS is 0 there).  Step 0 clears all of it (its grid covers the padded rows), step 2' reads
    # the first seqlen_q rows and head_dim columns.
    # With ``bulk_dq`` each query tile is in fragment order (``cfg.dq_tiles``).
    rows = -(-seqlen_q // cfg.block_n) * cfg.block_n
    shape = (1, 1, 1, 1) if deterministic else (batch, heads, rows, cfg.d_smem)  # unused when deterministic
    dq_accum = empty(shape, np.float32)
    bw.launch_preprocess(simt, o, do, lse, delta, lse2, dq_accum, not deterministic, stream,
                         rows=seqlen_q if deterministic else rows)
    qk_scale_log2, sc = float(scale * LOG2E), float(scale)
    maps = tensor_maps(cfg, do, q, k, v, columns) if cfg.dkdv_ws else no_maps()
    launch(dkdv_wgmma_kernel(cfg, not deterministic), (-(-seqlen_k // cfg.block_m) * cfg.slices, heads, batch),
           (cfg.dkdv_threads, 1, 1), stream, shared_bytes(cfg, "dkdv" if deterministic else "dkdv_atomic"),
           *(q, k, v, do, lse2, delta, dk, dv, dq_accum, qk_scale_log2, sc, bool(causal), maps))
    if deterministic:
        launch(dq_wgmma_kernel(cfg), (-(-seqlen_q // cfg.block_m) * cfg.slices, heads, batch), (cfg.threads, 1, 1),
               stream, shared_bytes(cfg, "dq"), *(q, k, v, do, lse2, delta, dq, qk_scale_log2, sc, bool(causal)))
    elif cfg.bulk_dq:
        launch(bt.dq_tile_convert_kernel(cfg.dq_tiles), (rows // cfg.block_n, heads, batch), (cfg.threads, 1, 1),
               stream, 0, dq_accum, dq, sc)
    else:
        bw.launch_dq_convert(simt, dq_accum, dq, sc, stream)


def _view(a, shape, strides, dtype, offset: int = 0):
    """``a``'s memory from byte ``offset`` on, seen with ``shape``, ``strides`` (bytes) and ``dtype``: a NumPy or
    CuPy array (``a`` C-contiguous, as ``empty`` makes it), or a kernel argument descriptor (a recorded call's
    scratch, :class:`nbflash._launch.ArrayArg`)."""
    dtype, shape, strides = np.dtype(dtype), tuple(shape), tuple(strides)
    xp = array_module(a)
    if xp is None:  # a descriptor
        return a._replace(ptr=a.ptr + offset, shape=shape, strides=strides, dtype=dtype)
    if xp is np:
        return np.ndarray(shape, dtype, buffer=a, offset=offset, strides=strides)
    return xp.ndarray(shape, dtype, memptr=a.data + offset, strides=strides)


def tensor_maps(cfg: WGBackwardConfig, do, q, k, v, columns):
    """The dK/dV kernel's ``maps`` with ``cfg.dkdv_ws``: the TMA tensor maps of q, do (boxes of ``block_n`` rows),
    k, v (``block_m`` rows), 64 columns each, 128-byte swizzled, and of ``columns`` (lse2 and D as 16-bit words,
    ``(B, H, 2, 2·N_q)``: boxes of both rows × ``2·block_n`` words, unswizzled) — made for each launch's own
    arrays on the GPU (:func:`nbflash.tma.launch_maps`)."""
    sw = (PANEL, HW.SWIZZLE_128B)
    return T.launch_maps((q, do, k, v, columns), [(cfg.block_n, *sw), (cfg.block_n, *sw), (cfg.block_m, *sw),
                                                  (cfg.block_m, *sw), (2, 2 * cfg.block_n, HW.SWIZZLE_NONE)])


def kernel_signature(cfg: WGBackwardConfig, name: str):
    """The Numba argument types of kernel ``name`` ("dkdv", "dkdv_atomic" or "dq") for ``cfg`` (any strides);
    the dK/dV kernel's last argument is its tensor maps (:func:`tensor_maps`)."""
    from numba import types

    elem = types.float16 if cfg.input_kind == "float16" else types.uint16
    t4 = types.Array(elem, 4, "A")
    f3, f4 = types.Array(types.float32, 3, "A"), types.Array(types.float32, 4, "A")  # lse2, delta; dq_accum
    if name.startswith("dkdv"):
        return (t4, t4, t4, t4, f3, f3, t4, t4, f4, types.float64, types.float64, types.boolean,
                types.Array(types.uint8, 2, "C"))
    return (t4, t4, t4, t4, f3, f3, t4, types.float64, types.float64, types.boolean)


def compile_targets():
    """``(name, cfg, kernel, signature, fastmath)`` for the GPU configurations (the PTX check, sm_90a): the defaults
    in bfloat16 at every head dim and in float16 at D = 128 (the kinds differ only in the wgmma's input type and
    the packing of P and dS; the simulator runs both everywhere), in bfloat16 at D = 64 and 128 the
    configurations without TMA (:func:`config_for`'s fallback)."""
    rows = []
    cfgs = [choose_config(d, kind, simulator=False) for d in (40, 64, 96, 128, 256) for kind in ("float16", "bfloat16")
            if kind == "bfloat16" or d == 128]
    cfgs += [choose_config(d, "bfloat16", simulator=False, ws=False) for d in (64, 128)]
    for cfg in cfgs:
        rows.append(("flash_backward_dkdv_wgmma", cfg, dkdv_wgmma_kernel(cfg), kernel_signature(cfg, "dkdv"), True))
        if takes_atomic(cfg):
            rows.append(("flash_backward_dkdv_wgmma_atomic", cfg, dkdv_wgmma_kernel(cfg, True),
                         kernel_signature(cfg, "dkdv_atomic"), True))
        rows.append(("flash_backward_dq_wgmma", cfg, dq_wgmma_kernel(cfg), kernel_signature(cfg, "dq"), True))
    return rows
