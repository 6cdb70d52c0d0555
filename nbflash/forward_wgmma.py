"""The FlashAttention forward pass on Hopper's warpgroup tensor cores: ``wgmma.mma_async``.

The algorithm of :mod:`nbflash.forward_tc` (read that one first), with both
matrix products issued by a whole *warpgroup* (4 warps, 128 threads) as
``wgmma.mma_async`` (:mod:`nbflash.hopper`) instead of per-warp ``mma.sync``:

* ``S = Q_i K_jᵀ`` reads **both operands from shared memory** through matrix
  descriptors: no ``ldmatrix``, no fragment registers for Q or K;
* ``O += P V_j`` takes **P from registers** (the S accumulators, packed to 16
  bits: the accumulator layout of a wgmma is, warp by warp, the A-fragment
  layout, FlashAttention's register reuse as in FlashAttention-2/3) and V from
  shared memory, read *N-major* (``imm-trans-b = 1``) so V_j is stored as it
  arrives, row by row, with no transpose.

Shapes (every tensor indexed ``[batch, head, row, d]``; ``bshd`` arrives as a strided view)::

    q   (B, H, N_q, D)      k, v  (B, H, N_k, D)      float16, or bfloat16 as raw uint16 bits
    o   (B, H, N_q, D)      like q                     lse  (B, H, N_q)  float32

Grid: one block per (query tile, head, batch), ``BLOCK_M = 64 · warpgroups``
queries; warpgroup w owns rows 64w..64w+63 of the tile, and inside it warp
v owns 16 rows, exactly as in the ``mma.sync`` kernel: the softmax, masking
and epilogue are the same device functions (:func:`nbflash.forward_tc.fragment_steps`).

Shared memory: Q_i, K_j and V_j in the **128-byte-swizzled** layout that
wgmma reads without bank conflicts (:func:`nbflash.hopper.kmajor_sw128_offset`):
the head dim cut into panels of 64 columns (128 bytes; D padded to a multiple
of 64 with zeros), each row of a panel one 128-byte line whose 16-byte chunk c
is stored at chunk ``c ^ (row % 8)``.  The same bytes are a K-major operand
(rows of Q or K, k = d) and an N-major one (V: k = key, n = d)::

    Q_i  panel 0 | panel 1 ...     BLOCK_M × 128 bytes each      (A of S, K-major)
    K_j  panel 0 | panel 1 ...     BLOCK_N × 128 bytes each      (B of S, K-major)
    V_j  panel 0 | panel 1 ...     BLOCK_N × 128 bytes each      (B of P V, N-major; LBO = panel size)

Five schedules of the same steps, a compile-time choice (``WGConfig.pipeline``);
the kernel has one loop per schedule, each under its flag.

``"plain"`` (one K and one V buffer, FlashAttention-2's split ``cp.async``
pipeline, two barriers per key tile, every product waited for at once):

1. ``cp.async`` Q_i and K_0 into shared memory (one group).
2. For each visible key tile j (causal tiles above the diagonal skipped):

   a. wait for K_j, ``fence.proxy.async`` (cp.async writes through the generic
      proxy, the tensor cores read through the async one), barrier; start the
      copy of V_j;
   b. ``S = Q_i K_jᵀ``: D/16 wgmmas of ``m64n{BLOCK_N}k16`` over the k-steps
      (each a descriptor 32 bytes further along the swizzled line, or the next
      panel), one commit, wait;
   c. mask (ragged tail, causal diagonal) where the tile needs it;
      wait for V_j, fence, barrier; start the copy of K_{j+1};
   d. online softmax in registers (:func:`~nbflash.forward_tc.fragment_steps`):
      P = 2^(S·scale·log2 e − m), O rescaled;
   e. ``O += P V_j``: BLOCK_N/16 register-A wgmmas of ``m64n{D_pad}k16``, one
      commit, wait.

3. ``O_i = acc / l_i``, ``lse_i = m_i + log l_i`` written once.

Every wgmma group is waited for (``wgmma.wait_group 0``) before its warpgroup
goes on, so by the barrier of step 2a every warpgroup has finished reading
V_{j-1}, and by that of step 2c it has finished reading K_j; only then are
those buffers refilled.

``"pingpong"`` (two warpgroups, two K and two V buffers, one barrier per tile):
the warpgroups *take turns* on the tensor cores, FlashAttention-3's ping-pong
schedule.  After the tile's barrier (K_j, V_j landed; K_{j+1}, V_{j+1} start
loading), warpgroup 1 issues its S only once warpgroup 0 has issued its own
(named barrier ``TURN_1``), so warpgroup 0's S finishes first and its softmax
runs while the tensor cores compute warpgroup 1's S; warpgroup 0 then issues
its O += P V once warpgroup 1's S is queued (``TURN_0``), and warpgroup 1's
softmax runs under it::

    tensor cores:  S(wg0) | S(wg1)        | PV(wg0)       | PV(wg1) | barrier, next tile
    warpgroup 0:   issue  | softmax       | issue, wait   |  wait   |
    warpgroup 1:   wait   | issue, wait   | softmax       |  issue  |

``"overlap"`` (any number of warpgroups, two K and two V buffers): each
warpgroup overlaps its own work: S_j = Q K_jᵀ and O += P_{j-1} V_{j-1} are
issued together, the softmax of S_j runs while the second product is still on
the tensor cores, and O is rescaled after it (``softmax_rows`` then
``rescale_rows``).  P_{j-1}'s registers are read by the in-flight wgmma, so
P_j is packed only after its wait.  Tile 0 (no P V yet) is its own step, and
the tiles after it run in two branch-free loops, unmasked then masked
(:func:`~nbflash.masking.first_masked_tile`), as in ws-overlap below: a
conditional P V made ptxas close an empty group with a dummy ``HGMMA`` and
wait for both products at once.  At D = 256 the S product's 16 k-steps stay a
loop in NVVM's output, whose back edge still brings a dummy group (unrolled in
Python, ptxas spilled 184 bytes; offline sm_90a, 2026-12-06).  On an H100 the
peel measured +4 % to +9 % at D = 256 and level at D = 176
(``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-06-d256-peel.json`` against
``…-d256-head.json``, the tree before it).

``"ws"`` (warp specialisation: two computing warpgroups and a *producer*
warpgroup, ``stages`` K/V buffers, no block-wide barrier in the loop): the
producer only copies, with ``cp.async``; each stage is handed over through
two named barriers, ``FULL + s`` (the producer's ``bar.arrive`` after its
wait and proxy fence; the consumers' ``bar.sync``) and ``EMPTY + s`` (the
consumers' ``bar.arrive`` once their last wgmma reading the stage has
finished; the producer's ``bar.sync`` before it refills it).  The consumers
take turns on the tensor cores as in ping-pong, but strictly alternating one
product at a time, so neither waits for the other at a tile boundary::

    producer:     copy j+1 ─ wait ─ FULL(j+1) ─ EMPTY(j) ─ copy j+2 ...
    tensor cores: S(wg0) | S(wg1) | PV(wg0) | PV(wg1) | S(wg0) of j+1 ...
    warpgroup 0:  issue  | softmax| issue   |  wait   | issue
    warpgroup 1:  wait   | issue  | softmax | issue   | softmax ...

The producer issues no wgmma, so the kernel's branch on the warpgroup is on
:func:`~nbflash._device.warp_uniform` (lane 0's value): ptxas otherwise
treats it as divergent and serialises the wgmmas behind it.  384 threads
leave 168 registers per thread; the producer needs few.  With
``setmaxnreg=True`` it gives them back as soon as the roles split
(:func:`~nbflash.hopper.setmaxnreg_dec` to 24) and each consumer takes 240
(:func:`~nbflash.hopper.setmaxnreg_inc`).  ptxas honours this only in a
whole-program compile (numba-cuda's default link-time optimisation; PTX
assembled for linking ignores it, C7504) and only if no instruction reached
after the decrease needs more: so the producer's branch ends with ``return``
instead of running on past the consumers' loops (else C7507).

With ``copies="tma"`` (:mod:`nbflash.tma`; the default up to D = 128) the
producer's first thread copies instead: per tile one ``arrive.expect_tx`` on the stage's mbarrier
announcing all the tile's bytes, then one TMA box per 64-column panel of K
and of V (and of Q with the first tile) — 4 instructions for a 128 × 128
K/V tile at D = 128 where ``cp.async`` needs 4096 spread over 128 threads.
The boxes land already swizzled and through the async proxy (no proxy
fence); the FULL handshake becomes the consumers' wait on the mbarrier's
phase parity ((j // stages) % 2), the EMPTY one stays a named barrier::

    producer thread 0:  expect_tx(s) ─ TMA K_j, V_j panels ─ ... EMPTY(j) ─ expect_tx ─ TMA j+stages ...
    consumers:          try_wait(full[s], parity) ─ S, softmax, P V ─ EMPTY(j)

The tensor maps hold q's, k's and v's addresses, so the kernel's ``maps``
argument is made for each launch's own arrays (:func:`tensor_maps`: a
:class:`nbflash._launch.Derived` argument, cached by address).

``"ws-overlap"`` (ws, 3 or 4 stages): each consumer also overlaps its own
softmax with its P V, as in ``"overlap"``: its turn issues S_j and
O += P_{j-1} V_{j-1} together.  Tile j - 1 is released only after that P V,
hence a third stage.  It needs about 200 registers per thread, so it takes
``setmaxnreg`` (without it, 168 registers: spills, and ptxas serialises the
wgmmas).  The default with TMA up to D = 128: 128 × 128 tiles, and at
D <= 64 for long sequences 128 × 192 (causal) or, with three consumers,
192 × 128 (non-causal; below).

What makes the overlap real is the shape of the code, not only the order of
the calls.  ptxas waits for every wgmma in flight at the first basic-block
boundary, and its scheduler pulls a ``wgmma.wait_group`` up to just before
the first instruction that reads the awaited accumulators or overwrites the
A registers they were issued with, interleaving the rest around it.  Until
2026-12-05 the step had a conditional P V (none at tile 0: ptxas closed the
empty group with a dummy ``HGMMA.64x8x16`` and the wait for S waited for
P V too), a mask test and a branch around the rescale factor's exponential,
and the softmax ran after P V had landed.  Now (SASS checked offline):

* tile 0 of an item is its own step (S_0 alone, waited for), so every later
  step issues both products unconditionally;
* the steps that need no mask (all but the last tiles of a row,
  :func:`~nbflash.masking.first_masked_tile`) are a separate loop whose body
  has no branch from the first commit to the last wait;
* the rescale factor's exponential is taken unconditionally.

These three pay on the H100, against the kernel before them in the same
call (``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-06-overlap.json`` and
``…-base.json``, bf16): +0 % to +18 % at D = 128 (N = 512 … 16k, growing
with N) and +2 % to +7 % at D = 64 (128 × 192 tiles, N ≥ 2k).  ptxas still
pulls the wait for P_{j-1} V_{j-1} up into the softmax of S_j.  ``pin_softmax=True`` keeps it out: O's rescale and the
packing of P_j take their inputs through :func:`~nbflash.intrinsics.f32_after`
the row sums, the softmax's last results, and a ``syncwarp`` (a NOP in SASS)
before the wait holds the wait there, so every exponential of the tile is
issued between the two waits.  It measured slower (0–10 % at D = 128, 2–11 %
at D = 64, 128 × 128 tiles, in the same run), so
it is off: the ptxas schedule, which starts P_j V_j earlier, wins.  The
masked steps (a row's last tiles) wait first either way.

``split_kv`` (ws with TMA; FlashAttention-3's separate K and V pipelines):
K_j and V_j land on their own mbarriers and are released on their own named
barriers: K_j once the consumers' S_j has landed (``EMPTY + s``), V_j once
their P_j V_j has (``VEMPTY + s``).  The producer issues K_j, then V_j, each
after its own release, and a consumer waits for V_j only just before the
product that reads it.  In ws-overlap, K_{j+1} then no longer waits for
P_{j-1} V_{j-1}, so 2 stages do what 3 did: 160 KB instead of 224 KB at
D = 128, room for wider 128 × 176 tiles (208 KB)::

    producer:   … EMPTY(K_{j-1}) ─ K_{j+1} ─ VEMPTY(V_{j-1}) ─ V_{j+1} …
    consumers:  S_j, P_{j-1}V_{j-1} issued ─ S_j landed: release K_j ─ softmax ─ P V landed: release V_{j-1}

The same 2 split stages make room for D > 128 in ws-overlap with TMA: at
D = 256, Q_i's 64 KB and two stages of 128 × 64 K/V tiles take 192 KB.
Two things are different there (built 2026-12-07; the pick above D = 128
since the forty-third session, :func:`choose_config`).  S's 16 k-steps are
unrolled in Python (:func:`ss_product`), since the ``range`` loop NVVM keeps
makes ptxas wait for each pair of k-steps.  And
the producer keeps 56 registers, each consumer 224
(:data:`WIDE_REGISTER_SPLIT`): with 24 the producer's code spilled.  O then
holds 128 of a consumer's registers.  Offline (sm_90a) this gives no local
memory at D = 256 with 128 × 64 tiles or at D = 192 with 128 × 96;
128 × 80 and 128 × 112 spill.  On an H100 these kernels, persistent, run
1.5–2.1× the ``overlap`` kernel they replace, at 0.87–0.94× cuDNN with 1k
keys, 0.97–1.06× with 4k and 1.00–1.12× with 16k (D = 176 and 256, bf16).

**Three consumers** (``block_m=192``, ws pipelines; FlashAttention-3's
shape at D = 64).  Three warpgroups of 64 query rows take turns in a ring:
warpgroup w waits at named barrier ``TURN_0 + w`` and hands on at the next
one's, the last warpgroup's first arrival gives warpgroup 0 the first turn,
and warpgroup 0 takes the last hand-over at the end.  Each barrier counts
the warpgroup that waits and the one that hands on (256 threads), whatever
the ring's size.  Each K/V tile now serves 192 queries rather than 128, and
between two of a warpgroup's turns the tensor cores run two other
warpgroups' products instead of one, so its softmax has longer to hide under
them.  The price is registers: 512 threads leave 128 each, and the producer
gives all but 32 to the consumers, 160 each (``setmaxnreg``).  At D = 64 a
consumer then holds O (32), S_j (N / 2) and P_{j-1} (N / 4): N = 128 keys
fits, 192 does not::

    tensor cores: S(wg0) PV(wg0) | S(wg1) PV(wg1) | S(wg2) PV(wg2) | S(wg0) …
    warpgroup 0:  issue          | softmax of S_j                  | issue …

On an H100 it is the pick for long non-causal calls at D <= 64
(:func:`choose_config`), in persistent blocks fed by the dynamic scheduler
below (at every length since the fortieth session).  Persistent blocks with
a static share of the chunks made the same kernel 13–19 % slower at 2k–4k
keys than one block per work item.  Per-item timestamps
(``benchmarks/trace_forward.py``, H200, 2026-12-06) found why: an item of
this kernel takes one of two times, about 25 % apart (at 2k keys 25 or
31 µs; about 9 % of the items are slow at 2k, 5 % at 4k), and a persistent
block keeps its mode for all of its ~21 items.  The other blocks finished
at 544 µs (median), the slow ones at up to 728: the launch waited for them.
With one block per item the hardware hands a slow block's successor to
whichever multiprocessor frees first, so the slow items spread out.  The
dynamic scheduler below does the same for persistent blocks.  (What puts a
block into the slow mode is not measured; the two-consumer kernels do not
show it.)

**Work items and persistent blocks** (the ws pipelines).  Their grid is
1-D: a *work item* is one query tile of one (batch, head)
(:func:`work_item`), items run head by head, and a block takes *chunks* of
them in turn: ``chunk = blockIdx.x, blockIdx.x + gridDim.x, …``.  With TMA
a causal chunk is two items of complementary lengths (the longest query tile
of a head with its shortest, and so on), so chunks cost about the same; a
non-causal chunk is one item, and so is a causal one with
``causal_pairs=False``, longest first within a head (with the dynamic
scheduler the launch then ends on the shortest items, the longest-processing-
time-first rule; measured on the H100 6 % slower than pairs at 2k-16k keys
without the seam step, level with pairs with it).  With ``persistent=True`` the grid has one
block per multiprocessor (FlashAttention-3's persistent kernel); otherwise
one block per chunk, each running one chunk.  The compiled kernel is the same.

**The dynamic scheduler** (``dynamic=True``, persistent blocks).  A block
still starts with chunk ``blockIdx.x``, but then takes the next chunk nobody
has taken: ``gridDim.x + atomicAdd(sched[0], 1)``, so a block that runs
slower takes fewer chunks (FlashAttention-3's dynamic persistent scheduler).
The producer's first thread fetches a chunk one chunk ahead (the atomic's
latency falls under the copies) and publishes it in one of two shared slots,
on an mbarrier (``SFULL + r``: one arrival, a release); each consumer waits
there, reads the slot and arrives at ``SEMPTY + r`` (all consumers), which
the producer waits for before it writes the slot again two chunks later.  A
chunk past the last one ends everyone's loop.  Only the producer's first
warp stays (its lanes wait together and read the slot after a ``syncwarp``;
the other three warps leave at once, and the handshakes count 32 producer
threads): with the issuing thread alone in spin loops that the other lanes
did not share, ptxas spilled 528 bytes offline.  The counter is zero before
each launch: the last block to finish taking chunks (a second counter,
``sched[1]``, after a fence) sets both back; each stream has its own pair
(:func:`work_counter`)::

    producer (1 thread):  fetch c1 ─ K/V of chunk c0 … ─ publish c1, fetch c2 ─ K/V of c1 … ─ publish c2 …
    consumers:            chunk c0 (blockIdx.x) …      ─ read c1 ─ chunk c1 …             ─ read c2 …

A persistent block pays its set-up once (mbarrier initialisation, the
register move, the first copies' latency), and the producer runs ahead
across items.  Its tile counter ``c`` runs over all the block's items, so
tile c goes into stage c % STAGES once tile c - STAGES is released, even when
the two belong to different items.  Q_i has its own mbarrier (``QBAR``) and
its own release (the named barrier ``QEMPTY``, after each consumer's last
S of the item).  So the next item's first K/V tiles land while the
consumers still compute this one, and its Q_i lands while they finish the
last P V and write O::

    producer:     … K/V c-1 ─ K/V c (next item) ─ QEMPTY ─ Q_next ─ K/V c+1 …
    consumers:    … S_last ─ QEMPTY ─ softmax, last P V ─ write O_i, lse_i ─ wait Q_next, K/V c ─ S …

The turns run on across items too.  Every stage and every Q_i is released
whether or not it is refilled, and the producer takes the releases nobody
refilled before it exits, so that every named barrier's counts match.
Warpgroup 0 takes back the turn that the last warpgroup hands on at the very end.
The cp.async producer keeps one item per block.

**Two Q_i buffers and the seam step** (options; the causal pick at D <= 64
from 2k to 8k keys, :func:`config_for`).  With
``q_buffers=2`` the block's n-th item takes Q buffer n % 2, with its own
mbarrier (``QBAR + u``) and release (``QEMPTY + u``), and the producer copies
it as soon as it reaches the item, before the item's first K/V tile: about
STAGES tiles before the consumers finish the item before.  With one buffer
an item starts with a lone S_0 (no P V to pair it with) and ends with a lone
last P V, each a turn of its own.  ``seam=True`` (ws-overlap) pairs the two
in one turn, like any later step: the previous item's last P V goes with
the new item's S_0, the new item's first softmax runs under the P V, and
the previous item's O and lse are written after it, while the tensor cores
run the other warpgroups' products::

    one Q buffer:  … S_{n-1}, PV_{n-2} │ PV_{n-1} │ write O │ wait Q' │ S'_0 │ S'_1, PV'_0 …
    seam:          … S_{n-1}, PV_{n-2} │ S'_0, PV_{n-1} │ softmax S'_0, write O │ S'_1, PV'_0 …

The previous item's m_i and l_i are set aside (``m_prev``, ``l_prev``) for
its write; its coordinates are found again from its index.  Measured
(H100, bf16, 2026-12-06, ``tc-forward-…-s36-seam-d64.json``): two buffers
alone were within 1.3 % of one but at one point (−3 %), at D = 64 and at
D = 128 with 2 split stages, the only depth that fits beside them.  The seam
gained the two-consumer kernels 1.5–3 % on causal calls at D = 64 with
2k–4k keys, nothing on non-causal ones there (±0.5 %) or at D = 128
(−1 … +1 %), and lost them 1–4 % at 16k keys.  So both stayed off until
the 32-bit tile arithmetic (fortieth session, H100): then the seam gained
the causal 128 × 192 pick 2 % at 4k keys (three runs, bf16 and fp16), −1 … +3 %
at 2k, nothing at 8k, and lost 1–3 % at 16k, so it runs below
:data:`SEAM_MAX_KEYS` keys.

**Exponentials on two units** (``poly_exp2``, an option, off by default).
The softmax takes one ``MUFU.EX2`` per score, and the special-function unit
does 16 a clock per multiprocessor.  At D = 64 a 64 × 192 tile's products
(Q Kᵀ and P V, 3.1 MFLOP) take the tensor cores 768 clocks at their peak
(4096 FLOP a clock), and its 12288 exponentials take the special-function
unit 768 clocks too, so a warpgroup's softmax cannot be shorter than the
products it should hide under (at D = 128 the products take twice as long).
With ``poly_exp2 = k``, k of every 8 values of a thread's row are computed
by :func:`~nbflash.intrinsics.ex2_poly` instead: a degree-4 polynomial and
an exponent-field add, 11 instructions on the FMA and integer units (128
lanes a clock), relative error below 3e-6.  FlashAttention-4 splits its
exponentials this way on Blackwell.  A masked score (-inf) still gives
P = 0 exactly.  Measured on the H100 it is 5-6 % slower for each eighth
moved (D = 64, bf16, causal and not): Nsight Compute found the special-
function pipe 46 % busy, so that unit is not what bounds the softmax;
issue slots and the softmax's dependency chain are, and the polynomial
adds to both.

Requires sm_90a.  Constraints (:func:`can_implement`) as for the ``mma.sync``
kernel: D a multiple of 8 up to 256; rows whole, 16-byte-aligned chunks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import types
from dataclasses import dataclass

import numpy as np

from . import hopper as HW
from . import intrinsics as I
from . import tma as T
from ._device import (
    SIMULATOR,
    compute_capability,
    cuda,
    device_function,
    kernel,
    launch,
    max_shared_per_block,
    multiprocessor_count,
    numba,
    syncwarp,
    warp_uniform,
)
from ._tiles import LOG2E, make_tc_tile_copier
from ._validate import tile_rows_problem
from .forward_tc import fragment_steps
from .forward_tc import kernel_signature as tc_kernel_signature
from .masking import d_first_masked_tile, d_key_range, d_tile_needs_mask

__all__ = [
    "WGConfig",
    "can_implement",
    "choose_config",
    "config_for",
    "forward_wgmma_kernel",
    "kernel_signature",
    "launch_forward_wgmma",
    "shared_bytes",
]

PANEL = 64  # head-dim columns per 128-byte swizzled line
PIPELINES = ("plain", "overlap", "pingpong", "ws", "ws-overlap")
PRODUCER_THREADS = 128  # the ws pipeline's copying warpgroup
COPIES = ("cp.async", "tma")  # the ws producer's copy instructions
#: ws with ``setmaxnreg``: registers per thread of the producer and of each consumer warpgroup after the move,
#: by the number of consumer warpgroups (FlashAttention-3's splits: 128 · 24 + 256 · 240 = 64512 of the SM's 65536
#: with two, 128 · 32 + 384 · 160 = 65536 with three).
REGISTER_SPLITS = {2: (24, 240), 3: (32, 160)}
#: ... with two consumers and D > 128 (padded): the producer's work for four 64-column panels a tile does not fit
#: 24 registers.  Offline (sm_90a, D = 256, 128 × 64 ws-overlap tiles): 284 bytes of local memory with 24 / 240, all
#: in the producer's code and in values kept from before the split; 84 with 40 / 232; none with 56 / 224, where O
#: takes 128 of a consumer's registers.  Both counts use the whole 384 × 168 the launch holds.
WIDE_REGISTER_SPLIT = (56, 224)
REGISTERS = REGISTER_SPLITS[2]  # two consumers (the backward's dK/dV kernel)
#: Named barriers a block may use (ids 0 … 15; 0 is ``syncthreads``'s).
NAMED_BARRIERS = 16


def padded_head_dim(head_dim: int) -> int:
    """The head dim rounded up to whole 64-column panels (:data:`PANEL`), as the tiles hold it in shared memory."""
    return -(-head_dim // PANEL) * PANEL


@dataclass(frozen=True)
class WGConfig:
    """Compile-time constants of the wgmma forward kernel.

    ``block_m`` query rows per block, 64 per warpgroup; ``block_n`` keys per
    K/V tile (the N of the ``S = Q Kᵀ`` wgmma).
    """

    block_m: int  # 64 per warpgroup, 1 to 3 warpgroups
    block_n: int  # keys per K/V tile: a wgmma N (16 ... 256)
    head_dim: int  # D, a multiple of 8 up to 256 (padded to a multiple of 64 inside)
    input_kind: str  # "float16" or "bfloat16"
    pipeline: str = "overlap"  # one of PIPELINES: the schedules of the module docstring
    stages: int = 2  # K/V buffers of the warp-specialised pipelines ("ws": 2 to 4, "ws-overlap": 3 or 4)
    copies: str = "cp.async"  # how the ws producer copies: "cp.async" (16 bytes per thread) or "tma" (one box each)
    setmaxnreg: bool = False  # ws: the producer gives registers to the consumers (REGISTER_SPLITS, per thread)
    # True: O rescaled only when a row's max moves by > 2^8 (forward_tc.fragment_steps); off by default: every tile
    # rescaled measured 1–2 % faster at D = 128 (tc-forward-NVIDIA-H200-2026-12-03-lazy*.json).
    lazy_rescale: bool = False
    # ws with TMA: one block per multiprocessor, each taking work items (query tiles) in turn; the producer copies
    # the next item's tiles while the consumers finish this one (FlashAttention-3's persistent kernel).
    persistent: bool = False
    # ws with TMA: K_j and V_j each have their own mbarrier and their own release, K_j freed once S_j has landed and
    # V_j once P_j V_j has (FlashAttention-3's two pipelines); so ws-overlap runs on 2 stages.
    split_kv: bool = False
    # ws-overlap: keep ptxas from scheduling the wait for P_{j-1} V_{j-1} amid the softmax of S_j (the rescale
    # factors and P_j taken through intrinsics.f32_after the row sums, a syncwarp before the wait; see
    # ``pv_landed``).  Off by default: with ptxas placing the wait where it likes the kernel measured 3-17 % faster
    # on the H100 (docs/performance.md, sessions 27-29).
    pin_softmax: bool = False
    # ws with TMA: Q_i buffers.  Two: the producer copies the next item's Q_i while the consumers still read this
    # one's (a persistent block's items, a causal pair), so no consumer waits for Q_i between items.
    q_buffers: int = 1
    # ws-overlap with two Q_i buffers: an item's last O += P V goes with the next item's first S in one turn (the
    # "seam" step), and its O is written while the tensor cores run the other warpgroups' products; so a block's
    # items are one unbroken run of overlapped steps instead of each starting and ending with a lone product.
    seam: bool = False
    # persistent: blocks take chunks off a global counter as they finish (FlashAttention-3's dynamic scheduler)
    # instead of chunk blockIdx.x + k · gridDim.x; so a block that runs slower takes fewer items.
    dynamic: bool = False
    # Of every 8 consecutive values of a thread's row of S, this many are exponentiated by a polynomial on the FMA
    # units instead of the special-function unit (MUFU.EX2, 16 a clock per multiprocessor: at D = 64 as many
    # clocks as the tensor cores spend on the tile; forward_tc.fragment_steps, intrinsics.ex2_poly).  Off: measured
    # 5-6 % slower per eighth on the H100 (the softmax is bound by issue, not by that unit; the module docstring).
    poly_exp2: int = 0
    # ws with TMA, causal: a chunk is two work items of complementary lengths (True: a static persistent block's
    # chunks then cost alike), or one item, the longest of a head first (False: with the dynamic scheduler the last
    # items handed out are the shortest, so blocks end within one short item of each other, not one pair).
    causal_pairs: bool = True

    def __post_init__(self):
        if self.block_m not in (64, 128, 192):
            raise ValueError(f"block_m must be 64, 128 or 192 (64 rows per warpgroup), got {self.block_m}")
        if self.block_n not in HW.WGMMA_N or self.block_n % 16:
            raise ValueError(f"block_n must be a multiple of 16 up to 256 (a wgmma N, 16 keys per k-step of P V), "
                             f"got {self.block_n}")
        if self.head_dim <= 0 or self.head_dim % 8 or self.head_dim > 256:
            raise ValueError(f"head_dim must be a multiple of 8 up to 256, got {self.head_dim}")
        if self.input_kind not in ("float16", "bfloat16"):
            raise ValueError(f"input_kind must be 'float16' or 'bfloat16', got {self.input_kind!r}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        if self.pipeline == "pingpong" and self.block_m != 128:
            raise ValueError(f"the pingpong pipeline takes turns between two warpgroups: block_m must be 128, got "
                             f"{self.block_m}")
        if self.pipeline in ("ws", "ws-overlap") and self.block_m not in (128, 192):
            raise ValueError(f"the {self.pipeline} pipeline takes turns among two or three consumer warpgroups: "
                             f"block_m must be 128 or 192, got {self.block_m}")
        if self.pipeline == "ws" and self.stages not in (2, 3, 4):
            raise ValueError(f"the ws pipeline has 2 to 4 K/V stages, got stages={self.stages}")
        if self.pipeline == "ws-overlap" and self.stages not in ((2, 3, 4) if self.split_kv else (3, 4)):
            raise ValueError(f"the ws-overlap pipeline has 3 or 4 K/V stages (a tile is released only after the "
                             f"next tile's S is computed; 2 with split_kv), got stages={self.stages}")
        if self.split_kv and not (self.warp_specialized and self.copies == "tma"):
            raise ValueError(f"split_kv gives K and V their own mbarriers in a ws pipeline copying with TMA, not in "
                             f"the {self.pipeline} pipeline with copies={self.copies!r}")
        if self.pin_softmax and self.pipeline != "ws-overlap":
            raise ValueError(f"pin_softmax orders the softmax against the ws-overlap pipeline's waits; the "
                             f"{self.pipeline} pipeline has no such wait")
        if self.copies not in COPIES:
            raise ValueError(f"copies must be one of {COPIES}, got {self.copies!r}")
        if self.copies == "tma" and not self.warp_specialized:
            raise ValueError(f"TMA copies are issued by the producer of a ws pipeline, not by the {self.pipeline} "
                             "pipeline")
        if self.setmaxnreg and not self.warp_specialized:
            raise ValueError(f"setmaxnreg moves registers from a ws pipeline's producer to its consumers; the "
                             f"{self.pipeline} pipeline has no producer")
        if self.persistent and not (self.warp_specialized and self.copies == "tma"):
            raise ValueError(f"persistent blocks take work items in turn in a ws pipeline copying with TMA, not in "
                             f"the {self.pipeline} pipeline with copies={self.copies!r}")
        if self.q_buffers not in (1, 2):
            raise ValueError(f"q_buffers must be 1 or 2, got {self.q_buffers}")
        if self.q_buffers == 2 and not (self.warp_specialized and self.copies == "tma"):
            raise ValueError(f"two Q_i buffers are filled by the TMA producer of a ws pipeline, not in the "
                             f"{self.pipeline} pipeline with copies={self.copies!r}")
        if self.seam and not (self.pipeline == "ws-overlap" and self.q_buffers == 2):
            raise ValueError(f"the seam step issues the next item's first S with this item's last P V: it needs the "
                             f"ws-overlap pipeline and q_buffers=2, got the {self.pipeline} pipeline with "
                             f"q_buffers={self.q_buffers}")
        if not 0 <= self.poly_exp2 <= 8:
            raise ValueError(f"poly_exp2 counts values of every 8 exponentiated by the polynomial: 0 to 8, got "
                             f"{self.poly_exp2}")
        if not self.causal_pairs and not (self.warp_specialized and self.copies == "tma"):
            raise ValueError(f"causal_pairs=False takes causal items one at a time where a ws pipeline copying with "
                             f"TMA pairs them; the {self.pipeline} pipeline with copies={self.copies!r} has no pairs")
        if self.dynamic and not self.persistent:
            raise ValueError("dynamic scheduling hands a persistent block its next chunk: it needs persistent=True")
        if not self.warp_specialized and self.stages != 2:
            raise ValueError(f"stages applies to the ws pipeline only (the {self.pipeline} pipeline fixes its "
                             f"buffers), got stages={self.stages}")
        if self.named_barriers > NAMED_BARRIERS:
            raise ValueError(f"{self.warpgroups} consumer warpgroups with {self.stages} stages"
                             f"{' and split_kv' if self.split_kv else ''}"
                             f"{' and two Q_i buffers' if self.q_buffers == 2 else ''} need {self.named_barriers} "
                             f"named barriers, a block has {NAMED_BARRIERS}: take fewer stages")

    @property
    def kv_buffers(self) -> int:
        """Buffers of K (and of V): one for the plain pipeline, ``stages`` for ws, two for the others."""
        return self.stages if self.warp_specialized else 1 if self.pipeline == "plain" else 2

    @property
    def paired_causal_items(self) -> bool:
        """A causal chunk of work is two items of complementary lengths (TMA copies and ``causal_pairs``), else one
        item; the one rule for :func:`work_grid` and the kernel."""
        return self.copies == "tma" and self.causal_pairs

    @property
    def warp_specialized(self) -> bool:
        """A producer warpgroup copies, the others compute ("ws", "ws-overlap")."""
        return self.pipeline.startswith("ws")

    @property
    def warpgroups(self) -> int:
        """The warpgroups that compute (64 query rows each); ws adds a producer warpgroup."""
        return self.block_m // 64

    @property
    def threads(self) -> int:
        return HW.WARPGROUP * self.warpgroups + (PRODUCER_THREADS if self.warp_specialized else 0)

    @property
    def turns(self) -> int:
        """Named barriers of the turn-taking schedules, one per warpgroup that takes turns ("warpgroup w may
        issue"): every consumer in ws, two otherwise (pingpong; the others do not wait for turns)."""
        return self.warpgroups if self.warp_specialized else 2

    @property
    def named_barriers(self) -> int:
        """Named barrier ids the kernel uses, 0 (``syncthreads``) included: the turns, then in ws FULL + s and
        EMPTY + s per stage, QEMPTY + u per Q_i buffer, and with ``split_kv`` VEMPTY + s per stage
        (:func:`forward_wgmma_kernel`)."""
        if not self.warp_specialized:
            return 1 + self.turns
        return 1 + self.turns + 2 * self.stages + self.q_buffers + (self.stages if self.split_kv else 0)

    @property
    def register_split(self) -> tuple[int, int]:
        """``setmaxnreg``: registers per thread of the producer and of each consumer (:data:`REGISTER_SPLITS`;
        :data:`WIDE_REGISTER_SPLIT` with two consumers at D > 128)."""
        if self.warpgroups == 2 and self.d_pad > 2 * PANEL:
            return WIDE_REGISTER_SPLIT
        return REGISTER_SPLITS[self.warpgroups]

    @property
    def d_pad(self) -> int:
        """D rounded up to whole 64-column panels; the padding is zero in shared memory."""
        return padded_head_dim(self.head_dim)


def shared_offsets(cfg: WGConfig) -> tuple[int, int, int]:
    """Element offsets of the K buffers and of the V buffers (Q_i's buffers start at 0), and the end; every tile
    starts 1024-byte aligned."""
    k_off = cfg.q_buffers * cfg.block_m * cfg.d_pad
    v_off = k_off + cfg.kv_buffers * cfg.block_n * cfg.d_pad
    return k_off, v_off, v_off + cfg.kv_buffers * cfg.block_n * cfg.d_pad


def _work_item(item, n_qt, heads, causal, paired):
    """Work item ``item`` of a ws launch: ``(query tile, head, batch)``.

    Items run head by head (``n_qt`` query tiles each), so the blocks at work
    at one time share a few heads' K and V in L2.  Within a head, non-causal
    tiles come in order.  Causal tiles see more keys the later they are:
    ``paired`` orders them longest, shortest, second longest, second shortest
    …, so that each pair of items (a block's chunk, with TMA) costs about
    the same; otherwise longest first, as the hardware hands out blocks.

    The divisions are ``_divmod``: Python's on the host, 32-bit
    :func:`~nbflash.intrinsics.divmod_u32` in the kernel (a 64-bit division
    would make ptxas serialise every wgmma; the launch keeps the item count
    below 2^31).
    """
    bh, u = _divmod(item, n_qt)
    b, h = _divmod(bh, heads)
    qt = int(u)
    if causal:
        qt = n_qt - 1 - u
        if paired:
            qt = n_qt - 1 - u // 2 if u % 2 == 0 else u // 2
    return int(qt), int(h), int(b)


_divmod = divmod
work_item = _work_item  # the host version (tests); the kernel calls the device one
d_work_item = device_function(
    types.FunctionType(_work_item.__code__, {**globals(), "_divmod": I.divmod_u32}, "_work_item"))


def work_grid(cfg: WGConfig, batch: int, heads: int, seqlen_q: int, causal: bool) -> tuple[int, int, int]:
    """The launch grid.  ws: 1-D, one block per chunk of work items (two causal items with TMA and
    ``causal_pairs``, else one), at most one per multiprocessor when ``cfg.persistent``.  The other pipelines:
    (query tiles, heads, batch)."""
    n_qt = -(-seqlen_q // cfg.block_m)
    if not cfg.warp_specialized:
        return n_qt, heads, batch
    chunk = 2 if causal and cfg.paired_causal_items else 1
    items = n_qt * heads * batch
    if items >= 2**31:  # the kernel counts items in 32 bits (and a grid has at most 2^31 - 1 blocks along x)
        raise ValueError(f"wgmma forward: {items} query tiles (batch × heads × ceil(seqlen_q / {cfg.block_m})) "
                         f"exceed the 2^31 - 1 work items a launch takes")
    chunks = -(-items // chunk)
    return max(1, min(chunks, multiprocessor_count()) if cfg.persistent else chunks), 1, 1


@functools.cache
def shared_bytes(cfg: WGConfig) -> int:
    """Dynamic shared memory of one block (bytes)."""
    return shared_offsets(cfg)[-1] * 2


@functools.cache
def swizzled_tile_loader(ROWS: int, THREADS: int, D: int, COLS: int | None = None):
    """``load_tile(smem, offset, src, b, h, start, seqlen, tid)``: cp.async rows ``[start, start + ROWS)``
    of ``src[b, h]`` into the swizzled tile at ``smem[offset]``; rows past ``seqlen`` and the head-dim
    padding are zero-filled (a copy of 0 source bytes).  ``COLS``: the tile's columns, whole panels
    (default: D rounded up to a panel; more for the sliced backward of :mod:`nbflash.backward_wgmma`).

    Consecutive threads copy consecutive 16-byte chunks of a row (coalesced reads); the eight chunks of
    one 128-byte line land on eight different chunk slots (``c ^ (row % 8)``), so the writes do not
    conflict either.

    ``THREADS`` threads share the work; ``D`` is the head dim (the tile's
    rows are padded to whole 64-column panels).  Used for Q, K, V (and, in the
    backward, dO) tiles alike.
    """
    D_PAD = COLS or padded_head_dim(D)
    U_PANEL = np.uint64(ROWS * PANEL)  # elements of one 64-column panel of the tile
    u64 = numba.uint64

    def swizzled_offset(offset, r, chunk):
        """Chunk ``chunk`` of tile row ``r``: panel ``chunk // 8``, line ``r``, slot ``chunk ^ (r % 8)``."""
        swizzled = ((chunk & u64(7)) ^ (r & u64(7))) << u64(3)
        return u64(offset) + (chunk >> u64(3)) * U_PANEL + r * u64(PANEL) + swizzled

    return make_tc_tile_copier(ROWS, THREADS, D, D_PAD // 8, device_function(swizzled_offset))


#: LLVM unrolls ``ss_product``'s ``range`` loop up to this many k-steps (D = 128): there both forms give the same
#: SASS (the D = 128 and the three-consumer D = 64 picks compared line by line, 2026-12-07).
LLVM_UNROLLED_K_STEPS = 8


def _k_step_offset(kk, panel):
    """A K-major descriptor's address step for k-step ``kk`` of a tile of 64-column panels (``panel`` bytes each):
    32 bytes per k-step along the 128-byte lines (kk % 4), in panel kk // 4, in the field's 16-byte units."""
    return ((kk // 4) * panel + 32 * (kk % 4)) >> 4


d_k_step_offset = device_function(_k_step_offset)


@functools.cache
def ss_product(n: int, kind: str, k_steps: int, a_panel: int, b_panel: int, unrolled: bool = False):
    """``acc = product(acc, a_desc, b_desc)``: issue A·Bᵀ (64 × n) over ``k_steps`` k-steps of 16, both operands
    K-major swizzled tiles of 64-column panels (``a_panel``, ``b_panel``: bytes per panel of each tile).

    k-step kk's descriptors step by :func:`_k_step_offset`.  The first
    k-step ignores ``acc`` (``scale_d = 0``).  Issue only: the caller
    fences before and commits / waits after.

    ``unrolled``: where the ``range`` loop would stay a loop (more than
    :data:`LLVM_UNROLLED_K_STEPS` k-steps), unroll it in Python instead: one
    device function per k-step, its offsets constants, chained as
    :func:`~nbflash.backward_tc._make_tile_product` chains its k-steps (inlined
    by NVVM).  At D = 256 the loop's back edge makes ptxas wait for every
    wgmma in flight: each pair of k-steps of S then runs alone (offline,
    sm_90a: a dummy ``HGMMA`` and a ``gsb0`` wait per iteration).  Unrolled,
    the ``overlap`` pipeline at D = 256 (255 registers, no ``setmaxnreg``)
    spills 184 bytes, so the forward asks for it in its ws kernels only
    (their consumers take 224 registers there), and the backward always
    (:mod:`nbflash.backward_wgmma`: 245 and 156 registers at D = 256, no
    local memory, the dummy groups gone).
    """
    wgmma_ss = HW.wgmma(n, kind)
    u64 = numba.uint64

    if not (unrolled and k_steps > LLVM_UNROLLED_K_STEPS):
        def product(acc, a_desc, b_desc):
            for kk in range(k_steps):
                a_step, b_step = u64(d_k_step_offset(kk, a_panel)), u64(d_k_step_offset(kk, b_panel))
                acc = wgmma_ss(a_desc + a_step, b_desc + b_step, acc, kk > 0)
            return acc

        return device_function(product)

    def k_step(kk):
        a_step, b_step, accumulate = _k_step_offset(kk, a_panel), _k_step_offset(kk, b_panel), kk > 0

        def one_step(acc, a_desc, b_desc):
            return wgmma_ss(a_desc + u64(a_step), b_desc + u64(b_step), acc, accumulate)

        return device_function(one_step, nvvm_inline=True)

    def then(first, second):
        def both(acc, a_desc, b_desc):
            return second(first(acc, a_desc, b_desc), a_desc, b_desc)

        return device_function(both, nvvm_inline=True)

    return functools.reduce(then, (k_step(kk) for kk in range(k_steps)))


@functools.cache
def rs_product(n: int, kind: str, k_steps: int):
    """``acc = product(acc, A, b_desc)``: issue acc += A·B (64 × n), A from registers (``A[kk, 0..3]``, the
    fragments of k-step kk) and B an N-major swizzled tile whose rows are the k index (16 rows of 128 bytes,
    2048 bytes, per k-step).  Issue only, as :func:`ss_product`."""
    wgmma_rs = HW.wgmma_rs(n, kind, trans_b=True)
    u64 = numba.uint64

    def product(acc, A, b_desc):
        for kk in range(k_steps):
            acc = wgmma_rs(A[kk, 0], A[kk, 1], A[kk, 2], A[kk, 3], b_desc + u64((2048 * kk) >> 4), acc, 1)
        return acc

    return device_function(product)


def forward_wgmma_kernel(cfg: WGConfig):
    """The compiled wgmma forward kernel for one configuration (cached).  Persistent or not, a ws kernel is the
    same code (only the grid differs, :func:`work_grid`), so both share one; a dynamic scheduler is other code."""
    return _forward_wgmma_kernel(cfg if cfg.dynamic else dataclasses.replace(cfg, persistent=False))


@functools.cache
def _forward_wgmma_kernel(cfg: WGConfig):
    BLOCK_M, BLOCK_N, D, D_PAD = cfg.block_m, cfg.block_n, cfg.head_dim, cfg.d_pad
    THREADS = cfg.threads
    K_OFF, V_OFF, _ = shared_offsets(cfg)
    N_TILES = BLOCK_N // 8  # 8-key column tiles of S (per warp, the mma.m16n8 accumulator layout)
    D_TILES = D_PAD // 8  # 8-wide column tiles of O
    K_STEPS = D_PAD // 16  # k-steps of Q K^T
    PV_STEPS = BLOCK_N // 16  # k-steps of P V
    Q_PANEL, KV_PANEL = BLOCK_M * PANEL * 2, BLOCK_N * PANEL * 2  # bytes of one 64-column panel of a tile
    SW128, SBO = HW.SWIZZLE_128B, 1024  # 8 swizzled 128-byte lines per atom, atoms stacked densely
    kind = "f16" if cfg.input_kind == "float16" else "bf16"
    # S = Q K^T: shared × shared, K-major (the ws kernels unroll its k-steps, all of them in flight at once)
    qk_product = ss_product(BLOCK_N, kind, K_STEPS, Q_PANEL, KV_PANEL, unrolled=cfg.warp_specialized)
    pv_product = rs_product(D_PAD, kind, PV_STEPS)  # O += P V: P in registers, V N-major
    u32, u64 = numba.uint32, numba.uint64
    SMEM_ALIGN = None if SIMULATOR else 1024  # a 128-byte-swizzle atom must start 1024-byte aligned
    OVERLAP = cfg.pipeline == "overlap"
    PINGPONG = cfg.pipeline == "pingpong"
    PLAIN = cfg.pipeline == "plain"
    WS = cfg.warp_specialized  # "ws" or "ws-overlap": a producer warpgroup, named-barrier handshakes
    WSO = cfg.pipeline == "ws-overlap"
    # Named barriers TURN_0 + w: "warpgroup w may issue"; the warpgroup that waits and the one that hands on count.
    TURN_0, PAIR, TURNS = 1, 2 * HW.WARPGROUP, cfg.turns
    STAGES = cfg.kv_buffers
    WARPGROUPS = cfg.warpgroups
    CONSUMERS = HW.WARPGROUP * WARPGROUPS  # threads that compute; in ws the producer warpgroup comes after them
    # ws: named barriers FULL + s ("stage s has landed") and EMPTY + s ("... is free"), after the turns'
    FULL = TURN_0 + TURNS
    EMPTY = FULL + STAGES
    # ws: both sides count at FULL and EMPTY (dynamic: only the producer's first warp stays, see below)
    HANDSHAKE = CONSUMERS + (32 if cfg.dynamic else PRODUCER_THREADS)
    KV_STRIDE = BLOCK_N * D_PAD  # elements from one K (or V) buffer to the other
    steps = fragment_steps(N_TILES, D_TILES, D, cfg.input_kind, cfg.lazy_rescale, cfg.poly_exp2)
    init_rows, mask_scores, online_softmax = steps.init_rows, steps.mask_scores, steps.online_softmax
    p_frags, write_rows, softmax_rows = steps.p_frags, steps.write_rows, steps.softmax_rows
    rescale_rows = steps.rescale_rows

    LOAD_THREADS = PRODUCER_THREADS if WS else THREADS  # ws: only the producer warpgroup copies
    TMA = cfg.copies == "tma"  # ws: the producer's first thread copies whole boxes, mbarriers count the bytes
    SETMAXNREG = cfg.setmaxnreg  # ws: registers move from the producer to the consumers once the roles split
    PRODUCER_REGS, CONSUMER_REGS = cfg.register_split if SETMAXNREG else REGISTERS
    PANELS = D_PAD // PANEL  # TMA boxes per tile: one per 64-column panel (columns past D arrive as zeros)
    Q_BYTES, TILE_BYTES = BLOCK_M * D_PAD * 2, BLOCK_N * D_PAD * 2  # bytes of Q_i, of K_j (or of V_j)
    PIN = cfg.pin_softmax  # ws-overlap: the softmax of S_j pinned between the waits for S_j and for P V
    SPLIT = cfg.split_kv  # TMA: K_j and V_j on their own mbarriers, released on their own named barriers
    NEG_INF, ZERO = numba.float32(-math.inf), numba.float32(0)
    Q_BUFS = cfg.q_buffers  # TMA: Q_i of the block's n-th item (with key tiles) goes into buffer n % Q_BUFS
    SEAM = cfg.seam  # ws-overlap: an item's last P V and the next item's first S issued in one turn
    VBAR = STAGES if SPLIT else 0  # TMA: V of stage s lands on bars[VBAR + s] (split), else with its K on bars[s]
    # TMA: the mbarrier of Q buffer u is bars[QBAR + u], after the stages' ("Q_i has landed"; its phase n: the n-th
    # item to use the buffer)
    QBAR = (2 if SPLIT else 1) * STAGES
    PAIRS = cfg.paired_causal_items  # causal: a chunk is a pair of items (else one item, longest first)
    DYNAMIC = cfg.dynamic  # persistent blocks take their chunks off the counter sched[0]
    # dynamic: the block's chunk u + 1 (its first is blockIdx.x) is published in slot u % 2; bars[SFULL + r]: "slot
    # r holds the next chunk" (the issuing thread arrives), bars[SEMPTY + r]: "every consumer has read it"
    SFULL = QBAR + Q_BUFS
    SEMPTY = SFULL + 2
    N_MBARS = SFULL + (4 if DYNAMIC else 0)  # TMA: the stages' mbarriers (K's, then V's if split), Q's, the slots'
    SLOT = N_MBARS  # dynamic: the two slots are bars[SLOT], bars[SLOT + 1] (plain 64-bit words, no mbarriers)
    N_BARS = N_MBARS + (2 if DYNAMIC else 0)
    # TMA: named barrier QEMPTY + u, "every consumer is done with the Q_i of buffer u" (their item's last S)
    QEMPTY = EMPTY + STAGES
    # Named barriers "the V of stage s is free" (split: QEMPTY + Q_BUFS + s; with two consumers, one Q buffer and
    # 4 stages the last is 15, the last there is: WGConfig.named_barriers); else V is freed with its K at EMPTY + s.
    VEMPTY = QEMPTY + Q_BUFS if SPLIT else EMPTY

    @device_function
    def issue_tile(smem, maps, bars, b, h, tile, stage, kv, expect):
        """TMA: K_tile (``kv = 1``) or V_tile (``kv = 2``) into ``stage``, one box per 64-column panel, landing on
        the mbarrier of the stage's K (``bars[stage]``) or V (``bars[VBAR + stage]``: the same one unless split).
        First one arrival there announcing ``expect`` bytes (0: none, the bytes are announced with K's), whose
        phase completes when the last announced byte lands."""
        bar = stage + (VBAR if kv == 2 else 0)
        if expect > 0:
            T.mbarrier_arrive_expect_tx(bars, bar, expect)
        offset = (K_OFF if kv == 1 else V_OFF) + stage * KV_STRIDE
        for p in range(PANELS):
            T.tma_load_4d(smem, offset + p * BLOCK_N * PANEL, maps[kv], PANEL * p, tile * BLOCK_N, h, b, bars, bar)

    @device_function
    def issue_q(smem, maps, bars, b, h, q_start, u):
        """TMA: Q_i (rows ``q_start ...``) into Q buffer ``u``, on that buffer's mbarrier ``bars[QBAR + u]``."""
        T.mbarrier_arrive_expect_tx(bars, QBAR + u, Q_BYTES)
        for p in range(PANELS):
            T.tma_load_4d(smem, u * BLOCK_M * D_PAD + p * BLOCK_M * PANEL, maps[0], PANEL * p, q_start, h, b, bars,
                          QBAR + u)

    @device_function
    def item_tiles(item, n_qt, heads, seqlen_q, seqlen_k, causal, paired):
        """ws: work item ``item``'s first query row, head, batch and number of visible key tiles."""
        qt, h, b = d_work_item(item, n_qt, heads, causal, paired)
        _, k_end = d_key_range(qt * BLOCK_M, BLOCK_M, seqlen_q, seqlen_k, causal)
        # A 32-bit division (k_end < 2^31): ptxas recomputes the count in the steps that test for an item's last
        # tile, and a 64-bit division by BLOCK_N there is a dozen uniform-datapath instructions.
        return qt * BLOCK_M, h, b, numba.int64(I.divmod_u32(k_end + BLOCK_N - 1, BLOCK_N)[0])

    @device_function
    def fetch_chunk(sched):
        """dynamic: the next chunk nobody has taken (every block's first is its blockIdx.x, so the counter starts
        at gridDim.x)."""
        return numba.int64(cuda.gridDim.x) + numba.int64(cuda.atomic.add(sched, 0, 1))

    @device_function
    def publish_chunk(bars, kc, ch, issuer):
        """dynamic, the producer's first warp together: chunk ``ch`` (the issuing thread's) as the block's kc-th
        (kc >= 1), in slot (kc - 1) % 2 once every consumer has read the chunk kc - 2 there; returns it to every
        lane."""
        u = kc - 1
        if u >= 2:
            while not T.mbarrier_try_wait_parity(bars, SEMPTY + u % 2, ((u - 2) // 2) % 2):
                pass
        if issuer:
            bars[SLOT + u % 2] = numba.uint64(ch)
            T.mbarrier_arrive(bars, SFULL + u % 2)  # a release: a consumer that passes the phase sees the slot
        syncwarp()  # ... and so does every lane of this warp
        return numba.int64(bars[SLOT + u % 2])

    @device_function
    def read_chunk(bars, kc):
        """dynamic, a consumer: the block's kc-th chunk (kc >= 1), once published; then my arrival at the slot's
        release."""
        u = kc - 1
        while not T.mbarrier_try_wait_parity(bars, SFULL + u % 2, (u // 2) % 2):
            pass
        ch = numba.int64(bars[SLOT + u % 2])
        T.mbarrier_arrive(bars, SEMPTY + u % 2)
        return ch

    @device_function
    def stage_of(n):
        """The stage of the block's tile n, n % STAGES, in 32 bits.  Tile counters are 64-bit integers in Numba,
        and a signed 64-bit division by a constant is some twenty uniform-datapath instructions; the overlapped
        step needs three (its tile's stage and use, the previous tile's stage) in every warp.  Unsigned 32-bit it
        is a multiply-high and a shift (:func:`can_implement` keeps a launch's key tiles below 2^32)."""
        return I.divmod_u32(n, STAGES)[1]

    @device_function
    def use_parity(n):
        """The parity of the block's tile n's use of its stage, (n // STAGES) % 2: the phase of the stage's
        mbarrier that tile n completes (0, 1, 0, ...); 32-bit, as :func:`stage_of`."""
        return I.divmod_u32(n, STAGES)[0] & 1

    @device_function
    def wait_full(bars, j):
        """ws, a consumer: wait until stage j % STAGES holds the block's tile j (counted over all its work items:
        K_j, and V_j unless split; with cp.async, Q_i too with tile 0)."""
        if TMA:
            # The (j // STAGES)-th use of the stage: phases 0, 1, 0, ... of its mbarrier.
            while not T.mbarrier_try_wait_parity(bars, stage_of(j), use_parity(j)):
                pass
        else:
            HW.named_barrier_sync(FULL + stage_of(j), HANDSHAKE)

    @device_function
    def wait_v(bars, j):
        """ws with split_kv, a consumer: wait until V_j of the block's tile j has landed (its own mbarrier).
        Without split_kv nothing: V_j landed with K_j."""
        if SPLIT:
            while not T.mbarrier_try_wait_parity(bars, VBAR + stage_of(j), use_parity(j)):
                pass
    load_q = swizzled_tile_loader(BLOCK_M, LOAD_THREADS, D)
    load_kv = swizzled_tile_loader(BLOCK_N, LOAD_THREADS, D)

    @device_function
    def s_in_turn(S, q_desc, k_desc_j, wait_turn, my_turn, hand_turn, other_turn):
        """S = Q_i K_jᵀ into ``S``, issued in my turn: (if ``wait_turn``) wait at named barrier ``my_turn``, issue,
        (if ``hand_turn``) hand the tensor cores on at ``other_turn`` before waiting for the product."""
        if wait_turn:
            HW.named_barrier_sync(my_turn, PAIR)
        s = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
        HW.wgmma_fence()
        s = qk_product(s, q_desc, k_desc_j)
        HW.wgmma_commit_group()
        if hand_turn:
            HW.named_barrier_arrive(other_turn, PAIR)
        HW.wgmma_wait_group(0)
        s = HW.wgmma_fence_operand(s)
        HW.acc_to_array(s, S)

    @device_function
    def pv_in_turn(acc, P, S, v_desc_j, my_turn, hand_turn, other_turn):
        """O += P V_j (P packed from ``S``), issued in my turn: wait at ``my_turn``, issue, (if ``hand_turn``) hand
        on at ``other_turn``, wait for the product."""
        HW.named_barrier_sync(my_turn, PAIR)
        o_t = HW.wgmma_fence_operand(HW.acc_from_array(acc, D_PAD))
        HW.wgmma_fence()  # the rescaled accumulators are written before the wgmma reads them
        for kk in range(PV_STEPS):
            p_frags(P, S, kk, kk)
        o_t = pv_product(o_t, P, v_desc_j)
        HW.wgmma_commit_group()
        if hand_turn:
            HW.named_barrier_arrive(other_turn, PAIR)
        HW.wgmma_wait_group(0)
        o_t = HW.wgmma_fence_operand(o_t)
        HW.acc_to_array(o_t, acc)

    @device_function
    def issue_pair(acc, P, q_desc, k_desc_j, v_desc_prev):
        """Overlapped schedules: issue S_j = Q_i K_jᵀ, then O += P_{j-1} V_{j-1}, as two groups, neither waited
        for; returns their accumulators ``(s, o_t)``."""
        s = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
        o_t = HW.wgmma_fence_operand(HW.acc_from_array(acc, D_PAD))
        HW.wgmma_fence()  # the accumulators (rescaled after tile j - 1) are written before wgmma reads them
        s = qk_product(s, q_desc, k_desc_j)
        HW.wgmma_commit_group()
        o_t = pv_product(o_t, P, v_desc_prev)
        HW.wgmma_commit_group()
        return s, o_t

    @device_function
    def s_landed(s, S):
        """Overlapped schedules: wait for S_j (the older of the two groups in flight) and store it into ``S``; the
        O += P_{j-1} V_{j-1} issued after it may still run."""
        HW.wgmma_wait_group(1)
        s = HW.wgmma_fence_operand(s)
        HW.acc_to_array(s, S)

    @device_function
    def pv_landed(o_t, acc, alpha, l_i, P, S):
        """Overlapped schedules: wait for O += P_{j-1} V_{j-1}, rescale O by the newest tile's ``alpha``, and only
        now overwrite P_{j-1}'s registers (the in-flight wgmma read them) with P_j, packed from ``S``.

        ptxas puts the wait right before the first instruction that reads O or overwrites P_{j-1}; left to
        itself it would schedule the rescale and the packing of P_j, and so the wait, amid the exponentials of
        the softmax this product should run under.  So the factors, and one value of each packed pair, are
        taken through :func:`~nbflash.intrinsics.f32_after` the row sums ``l_i`` (the last result of the
        softmax): 2 + BLOCK_N / 4 FFMAs a thread.  The ``syncwarp`` before the wait (a NOP in SASS, the
        warp is converged) is a point the wait does not rise above: without it the wait still rose above the
        exponentials (offline SASS, D = 128); with it alone, the exponentials sank below the wait."""
        if PIN:  # (cfg.pin_softmax)
            for r in range(2):
                alpha[r] = I.f32_after(alpha[r], l_i[r])
                for n in range(N_TILES):
                    S[n, 2 * r] = I.f32_after(S[n, 2 * r], l_i[r])  # packed with S[n, 2r + 1] (p_frags)
            syncwarp()
        HW.wgmma_wait_group(0)
        o_t = HW.wgmma_fence_operand(o_t)
        HW.acc_to_array(o_t, acc)
        rescale_rows(acc, alpha)
        for kk in range(PV_STEPS):
            p_frags(P, S, kk, kk)

    def make_overlapped_tile(MASKED):
        """ws-overlap's step for key tile j >= 1 of an item; ``MASKED``: the tile needs a mask (a compile-time
        choice, so the unmasked step has no mask code)."""

        @device_function
        def overlapped_tile(S, P, acc, m_i, l_i, alpha, bars, q_desc, k_desc, v_desc, c, j, n_tiles, row0,
                            seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other, q_empty):
            """Key tile j >= 1 of an item (the block's tile c + j; Q_i released at ``q_empty``): in my turn
            S_j = Q_i K_jᵀ and
            O += P_{j-1} V_{j-1} (two groups), the softmax of S_j while P V still runs, then O rescaled and P_j
            packed.  From the first commit to the last wait the code is one basic block: ptxas waits for every
            wgmma in flight at the first block boundary, so a branch there (a mask test, a conditional product)
            would put the whole softmax behind P V."""
            stage = stage_of(c + j)
            prev = stage_of(c + j - 1)
            wait_full(bars, c + j)  # K_j (unless split, V_j; with cp.async and tile 0, Q_i) has landed
            wait_v(bars, c + j - 1)  # split: V_{j-1} has landed (checked before the turn: a loop ends a block)
            # In my turn: both products, then the other warpgroup's pair follows.
            HW.named_barrier_sync(mine, PAIR)
            s, o_t = issue_pair(acc, P, q_desc, k_desc + u64((stage * KV_STRIDE * 2) >> 4),
                                v_desc + u64((prev * KV_STRIDE * 2) >> 4))
            HW.named_barrier_arrive(other, PAIR)

            # S_j is done (P_{j-1} V_{j-1} may still run): mask and softmax under the tensor cores' work.
            s_landed(s, S)
            if SPLIT:
                HW.named_barrier_arrive(EMPTY + stage, HANDSHAKE)  # K_j is read: it may be refilled
            if TMA and j == n_tiles - 1:
                HW.named_barrier_arrive(q_empty, HANDSHAKE)  # my last S of the item: Q_i may be refilled
            if MASKED:
                mask_scores(S, row0, j * BLOCK_N, seqlen_q, seqlen_k, causal, g, t)
            softmax_rows(S, m_i, l_i, scale_log2, alpha)  # S becomes P_j; O must be scaled by alpha
            pv_landed(o_t, acc, alpha, l_i, P, S)
            # V_{j-1} is free now, read by the product just waited for (without split_kv the whole tile j - 1:
            # its K was read by S_{j-1}).
            HW.named_barrier_arrive(VEMPTY + prev, HANDSHAKE)

        return overlapped_tile

    overlapped_tile, overlapped_masked_tile = make_overlapped_tile(False), make_overlapped_tile(True)

    @device_function
    def write_item(o, lse, acc, m_i, l_i, item, n_qt, heads, seqlen_q, causal, paired, warp_row, g, t):
        """Step 3 of work item ``item`` (seam: written after the next item has started): O = acc / l and
        lse = m + log l for the warp's rows, ``warp_row`` … of the item's query tile."""
        qt, h, b = d_work_item(item, n_qt, heads, causal, paired)
        write_rows(o, lse, acc, m_i, l_i, b, h, qt * BLOCK_M + warp_row, seqlen_q, g, t)

    @device_function
    def zero_rows(acc):
        """seam: the new item's O accumulators start at zero (its m_i, l_i are set by the seam step)."""
        for dt in range(D_TILES):
            for i in range(4):
                acc[dt, i] = ZERO

    def make_seam_tile(MASKED):
        """ws-overlap's seam step (``cfg.seam``); ``MASKED``: the new item's key tile 0 needs a mask.

        The step takes 24 arguments and leaves the write of the previous item's O to its caller: CPython compiles
        a call with more than 30 positional arguments as a call with ``*args``, which Numba's inliner refuses
        ("Calling a closure with *args is unsupported"; the simulator, running Python, does not mind)."""

        @device_function
        def seam_tile(S, P, acc, m_i, l_i, alpha, m_prev, l_prev, bars, q_desc, k_desc, v_desc, c, n_tiles, row0,
                      seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other, q_empty):
            """The seam between two items: the previous item's last O += P V (its tile c - 1) and the new item's
            S_0 = Q_i K_0ᵀ (the block's tile c) in one turn, as an overlapped step's pair.  Under the P V: the
            previous item's row statistics set aside in ``m_prev``, ``l_prev``, the new item's first softmax (its
            O is zero: nothing to rescale).  Then P_0 packed; ``acc`` holds the previous item's finished O, for
            the caller to write (:func:`write_item`) and zero.  From the first commit to the wait for P V the code
            is one basic block, as in ``overlapped_tile``."""
            stage = stage_of(c)
            prev = stage_of(c - 1)
            # The same issue as overlapped_tile's (written out again, not shared: a shared helper changed the
            # default kernels' cubins, offline, and those are the ones measured and sanitized).
            wait_full(bars, c)  # K_0 (unless split, V_0) of the new item has landed
            wait_v(bars, c - 1)  # split: the previous item's last V has landed
            HW.named_barrier_sync(mine, PAIR)
            s, o_t = issue_pair(acc, P, q_desc, k_desc + u64((stage * KV_STRIDE * 2) >> 4),
                                v_desc + u64((prev * KV_STRIDE * 2) >> 4))
            HW.named_barrier_arrive(other, PAIR)

            s_landed(s, S)
            if SPLIT:
                HW.named_barrier_arrive(EMPTY + stage, HANDSHAKE)  # K_0 is read: it may be refilled
            if n_tiles == 1:
                HW.named_barrier_arrive(q_empty, HANDSHAKE)  # my last S of the item: Q_i may be refilled
            for r in range(2):  # the previous item's rows: their statistics set aside, the new item's start
                m_prev[r] = m_i[r]
                l_prev[r] = l_i[r]
                m_i[r] = NEG_INF
                l_i[r] = ZERO
            if MASKED:
                mask_scores(S, row0, 0, seqlen_q, seqlen_k, causal, g, t)
            softmax_rows(S, m_i, l_i, scale_log2, alpha)  # S becomes P_0 (alpha: 0, unused)
            HW.wgmma_wait_group(0)  # the previous item's last P V
            o_t = HW.wgmma_fence_operand(o_t)
            HW.acc_to_array(o_t, acc)
            HW.named_barrier_arrive(VEMPTY + prev, HANDSHAKE)  # its V (its tile) is free
            for kk in range(PV_STEPS):
                p_frags(P, S, kk, kk)

        return seam_tile

    seam_tile, seam_masked_tile = make_seam_tile(False), make_seam_tile(True)

    @device_function
    def last_pv_in_turn(acc, P, S, bars, v_desc, c, mine, other):
        """ws-overlap: an item's last O += P V (its last tile is the block's tile c - 1), in one more turn of its
        own; P is packed again from S.  Then that tile's V (without split_kv, the whole tile) is free."""
        wait_v(bars, c - 1)  # split: V has landed
        last = stage_of(c - 1)
        pv_in_turn(acc, P, S, v_desc + u64((last * KV_STRIDE * 2) >> 4), mine, True, other)
        HW.named_barrier_arrive(VEMPTY + last, HANDSHAKE)

    @device_function
    def overlap_refill(smem, k, v, b, h, j, n_tiles, seqlen_k, tid):
        """overlap, step 2a of key tile j: K_j and V_{j-1} have landed (the only group in flight); then K_{j+1}
        and V_j start, one group."""
        I.cp_async_wait(0)
        HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores (the async proxy)
        # Everyone's copies are visible; and every warpgroup has finished step j - 1, whose wgmmas read K_{j-1} and
        # V_{j-2}: the very buffers refilled now.
        cuda.syncthreads()
        if j + 1 < n_tiles:
            load_kv(smem, K_OFF + ((j + 1) % 2) * KV_STRIDE, k, b, h, (j + 1) * BLOCK_N, seqlen_k, tid)
        load_kv(smem, V_OFF + (j % 2) * KV_STRIDE, v, b, h, j * BLOCK_N, seqlen_k, tid)
        I.cp_async_commit()

    def make_overlap_tile(MASKED):
        """overlap's step for key tile j >= 1; ``MASKED``: the tile needs a mask (a compile-time choice)."""

        @device_function
        def overlap_tile(S, P, acc, m_i, l_i, alpha, smem, k, v, q_desc, k_desc, v_desc, b, h, j, n_tiles, row0,
                         seqlen_q, seqlen_k, causal, g, t, scale_log2, tid):
            """Key tile j >= 1: step 2a, then S_j and O += P_{j-1} V_{j-1} issued as two groups, the softmax of
            S_j under the second, O rescaled and P_j packed after its wait.  From the first commit to the last
            wait the code is one basic block (as in ws-overlap's step: ptxas waits for every wgmma in flight at
            the first block boundary)."""
            overlap_refill(smem, k, v, b, h, j, n_tiles, seqlen_k, tid)
            # Step 2b: issue S_j = Q_i K_jᵀ, then O += P_{j-1} V_{j-1}, as two groups; neither is waited for yet.
            s, o_t = issue_pair(acc, P, q_desc, k_desc + u64(((j % 2) * KV_STRIDE * 2) >> 4),
                                v_desc + u64((((j - 1) % 2) * KV_STRIDE * 2) >> 4))
            # Step 2c: S_j is done (P_{j-1} V_{j-1} may still run); mask and softmax while the tensor cores work.
            s_landed(s, S)
            if MASKED:
                mask_scores(S, row0, j * BLOCK_N, seqlen_q, seqlen_k, causal, g, t)
            softmax_rows(S, m_i, l_i, scale_log2, alpha)  # S becomes P_j; O must be scaled by alpha
            # Step 2d: O += P_{j-1} V_{j-1} is done: rescale O, then P_j replaces P_{j-1} in the A registers.
            pv_landed(o_t, acc, alpha, l_i, P, S)

        return overlap_tile

    overlap_tile, overlap_masked_tile = make_overlap_tile(False), make_overlap_tile(True)

    # ws: 384 threads (512 with three consumers), so ptxas must keep to 65536 / 384 = 168 (128) registers per thread
    # (the launch bounds), and setmaxnreg moves them between the roles
    @kernel(fastmath=True, launch_bounds=(THREADS, 1) if WS else None)
    def flash_forward_wgmma(q, k, v, o, lse, qk_scale_log2, causal, maps, sched):
        """One block: O_i and lse_i for BLOCK_M queries of one (batch, head); in ws, for each work item (a query
        tile of some head and batch, :func:`work_item`) that falls to the block."""
        seqlen_q = q.shape[2]
        seqlen_k = k.shape[2]
        heads = q.shape[1]
        tid = numba.int64(u32(cuda.threadIdx.x))
        # This thread's warpgroup (rows 64·wg .. 64·wg + 63 of the tile; in ws, the last one copies), known to
        # the compiler as the same in every lane of a warp.
        wg = warp_uniform(tid // HW.WARPGROUP)
        # Turn-taking schedules: the named barrier at which I wait for my turn, and the one I hand it on at (the
        # next warpgroup's, in a ring: 0 → 1 → 0 with two, 0 → 1 → 2 → 0 with three).
        mine = TURN_0 + wg
        other = mine + 1 if wg + 1 < TURNS else TURN_0
        lane = tid % 32
        g = lane // 4  # this thread's rows g and g + 8 of its warp's 16 ...
        t = lane % 4  # ... and columns 2t, 2t + 1 of every 8-column tile
        smem = cuda.shared.array(0, numba.uint16, alignment=SMEM_ALIGN)
        # TMA: one mbarrier per K/V stage ("its tile has landed"), then Q_i's.
        bars = cuda.shared.array(N_BARS, numba.uint64)

        S = cuda.local.array((N_TILES, 4), numba.float32)  # S (then P), this thread's part
        m_prev = cuda.local.array(2, numba.float32)  # seam: the previous item's m_i ...
        l_prev = cuda.local.array(2, numba.float32)  # ... and l_i, while the next item's first softmax runs
        acc = cuda.local.array((D_TILES, 4), numba.float32)  # O accumulators
        P = cuda.local.array((PV_STEPS, 4), numba.uint32)  # P's A fragments, one row per k-step
        alpha = cuda.local.array(2, numba.float32)  # rows g, g + 8: rescaling of O by the newest tile
        m_i = cuda.local.array(2, numba.float32)  # rows g, g + 8: running max (base-2 scaled) ...
        l_i = cuda.local.array(2, numba.float32)  # ... and this lane's share of the running sum
        init_rows(m_i, l_i, acc)
        scale_log2 = numba.float32(qk_scale_log2)

        # The descriptors of the k-step-0 operands; a later k-step adds its byte offset >> 4 to the address field.
        q_desc = HW.d_make_smem_desc(HW.smem_address(smem, 64 * PANEL * wg), 16, SBO, SW128)
        k_desc = HW.d_make_smem_desc(HW.smem_address(smem, K_OFF), 16, SBO, SW128)
        v_desc = HW.d_make_smem_desc(HW.smem_address(smem, V_OFF), KV_PANEL, SBO, SW128)

        # The block's work.  ws: work items off a 1-D grid, chunks of ``chunk`` items per block in turn (TMA:
        # several chunks per block when the launch is persistent, causal items in pairs of complementary lengths;
        # cp.async: one item per block).  The other pipelines: one query tile of the 3-D grid, longest causal rows
        # first.  q_start, h, b, n_tiles are the block's (first) item's; the ws loops below take each item's own.
        n_qt = (seqlen_q + BLOCK_M - 1) // BLOCK_M
        n_items = n_qt * heads * q.shape[0]
        chunk = 2 if causal and PAIRS else 1
        n_chunks = n_items if chunk == 1 else (n_items + 1) // 2  # no division by a run-time value (see work_item)
        if WS:
            q_start, h, b, n_tiles = item_tiles(numba.int64(cuda.blockIdx.x) * chunk, n_qt, heads, seqlen_q, seqlen_k,
                                                causal, chunk == 2)
        else:
            q_start = numba.int64(cuda.gridDim.x - 1 - cuda.blockIdx.x) * BLOCK_M
            h = numba.int64(cuda.blockIdx.y)
            b = numba.int64(cuda.blockIdx.z)
            _, k_end = d_key_range(q_start, BLOCK_M, seqlen_q, seqlen_k, causal)
            n_tiles = (k_end + BLOCK_N - 1) // BLOCK_N
        row0 = q_start + 16 * (tid // 32)  # the warp's first row
        # overlap: the block's first key tile that needs a mask (masking.first_masked_tile); ws-overlap: per item.
        first_masked = d_first_masked_tile(q_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal) if OVERLAP else 0

        # Step 1: Q_i and K_0, one cp.async group.
        producer = WS and wg == WARPGROUPS  # ws: the copying warpgroup (threads CONSUMERS ..)
        if not WS:
            load_q(smem, 0, q, b, h, q_start, seqlen_q, tid)
            if n_tiles > 0:
                load_kv(smem, K_OFF, k, b, h, 0, seqlen_k, tid)
                if PINGPONG:
                    load_kv(smem, V_OFF, v, b, h, 0, seqlen_k, tid)
            I.cp_async_commit()

        if TMA:
            if tid == CONSUMERS:  # the producer's first thread issues every copy; one arrival per phase
                for bar in range(N_MBARS):
                    # one arrival per phase; a slot's release waits for every consumer
                    T.mbarrier_init(bars, bar, CONSUMERS if DYNAMIC and bar >= SEMPTY else 1)
                T.fence_mbarrier_init()  # ... visible to the TMA unit (the async proxy) too
            cuda.syncthreads()  # the barriers are initialised before any thread waits on them

        if producer and TMA:
            # ws with TMA: the producer's first thread issues one box per panel of each tile, its other threads
            # only join the handshakes.  It runs ahead over the block's items: the block's tile c (counted over
            # all its items) goes into stage c % STAGES once tile c - STAGES is released, so the next item's first
            # tiles are copied while the consumers still work on this one; its Q_i once they are done with this Q_i.
            if SETMAXNREG:
                HW.setmaxnreg_dec(PRODUCER_REGS)  # a few counters and addresses: the rest go to the consumers
            if DYNAMIC and tid >= CONSUMERS + 32:
                return  # dynamic: the first warp alone joins the handshakes (HANDSHAKE counts it), and takes chunks
            issuer = tid == CONSUMERS
            c = 0  # the block's tiles issued so far
            nq = 0  # the block's items with at least one key tile so far (one Q_i each)
            ch = numba.int64(cuda.blockIdx.x)  # a while loop: range() with a run-time step divides (see work_item)
            kc = 0  # dynamic: the block's chunks so far
            nxt = ch  # dynamic, the issuer: the block's next chunk, fetched one chunk ahead (its latency hidden)
            if DYNAMIC and issuer:
                nxt = fetch_chunk(sched)
            while ch < n_chunks:
                for item in range(ch * chunk, min(ch * chunk + chunk, n_items)):
                    i_start, ih, ib, i_tiles = item_tiles(item, n_qt, heads, seqlen_q, seqlen_k, causal, chunk == 2)
                    for j in range(i_tiles):
                        if j == 0 and nq == 0 and issuer:
                            issue_q(smem, maps, bars, ib, ih, i_start, 0)  # the block's first Q_i: a free buffer
                        if j == 0 and nq > 0 and Q_BUFS == 2:
                            # Two Q buffers: this item's Q_i goes into the one the item before last used, once
                            # every consumer has waited for its last S there; ahead of the item's K_0, and about
                            # STAGES tiles before the consumers finish the previous item.
                            if nq >= 2:
                                HW.named_barrier_sync(QEMPTY + nq % 2, HANDSHAKE)
                            if issuer:
                                issue_q(smem, maps, bars, ib, ih, i_start, nq % 2)
                        if c >= STAGES:
                            # Both warpgroups have waited for their last wgmma reading tile c - STAGES (split: for
                            # their S of it, the last to read its K).
                            HW.named_barrier_sync(EMPTY + stage_of(c), HANDSHAKE)
                        if issuer:  # K_j, and V_j with it unless split (the arrival announces both then)
                            issue_tile(smem, maps, bars, ib, ih, j, stage_of(c), 1, TILE_BYTES * (1 if SPLIT else 2))
                            if not SPLIT:
                                issue_tile(smem, maps, bars, ib, ih, j, stage_of(c), 2, 0)
                        if j == 0 and nq > 0 and Q_BUFS == 1:
                            # Every consumer has waited for the previous item's last S: its Q_i is not read any more.
                            HW.named_barrier_sync(QEMPTY, HANDSHAKE)
                            if issuer:
                                issue_q(smem, maps, bars, ib, ih, i_start, 0)
                        if SPLIT:
                            if c >= STAGES:
                                # Both warpgroups have waited for their P V of tile c - STAGES, the last to read its V.
                                HW.named_barrier_sync(VEMPTY + stage_of(c), HANDSHAKE)
                            if issuer:
                                issue_tile(smem, maps, bars, ib, ih, j, stage_of(c), 2, TILE_BYTES)
                        c += 1
                    if i_tiles > 0:
                        nq += 1
                if DYNAMIC:
                    kc += 1
                    ch = publish_chunk(bars, kc, nxt, issuer)  # past the last chunk: the end, for everyone
                    if issuer and ch < n_chunks:
                        nxt = fetch_chunk(sched)
                else:
                    ch += cuda.gridDim.x
            if DYNAMIC and issuer:
                # The block has taken its last chunk.  The last block here sets the counter back to zero for the
                # next launch (every block's last fetch is ordered before its count here by the fence).
                cuda.threadfence()
                if cuda.atomic.add(sched, 1, 1) == cuda.gridDim.x - 1:
                    cuda.threadfence()
                    sched[0] = 0
                    sched[1] = 0
            # The consumers release every tile and every Q_i; the releases nobody refilled are taken here, so that
            # each named barrier's counts match before the block exits.
            for cc in range(max(c - STAGES, 0), c):
                HW.named_barrier_sync(EMPTY + stage_of(cc), HANDSHAKE)
                if SPLIT:
                    HW.named_barrier_sync(VEMPTY + stage_of(cc), HANDSHAKE)
            for u in range(max(nq - Q_BUFS, 0), nq):
                HW.named_barrier_sync(QEMPTY + u % Q_BUFS, HANDSHAKE)
            # Done.  The thread ends here rather than running past the consumers' code: ptxas keeps a decreased
            # register count only if no instruction reachable after it needs more.
            return

        if producer and not TMA:
            # ws, the producer warpgroup only copies (the block's one item).  Tiles 0 .. STAGES - 2 first (Q_i with
            # tile 0), one group each.
            if SETMAXNREG:
                HW.setmaxnreg_dec(PRODUCER_REGS)
            ptid = tid - CONSUMERS
            if n_tiles > 0:
                load_q(smem, 0, q, b, h, q_start, seqlen_q, ptid)
            for tile in range(STAGES - 1):
                if tile < n_tiles:
                    load_kv(smem, K_OFF + tile * KV_STRIDE, k, b, h, tile * BLOCK_N, seqlen_k, ptid)
                    load_kv(smem, V_OFF + tile * KV_STRIDE, v, b, h, tile * BLOCK_N, seqlen_k, ptid)
                I.cp_async_commit()  # possibly empty: one group per tile keeps the wait count below constant
            for j in range(n_tiles):
                # Tile j has landed once at most STAGES - 2 groups (tiles j + 1 ...) are still in flight.
                if STAGES == 2:
                    I.cp_async_wait(0)
                elif STAGES == 3:
                    I.cp_async_wait(1)
                else:
                    I.cp_async_wait(2)
                HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores (the async proxy)
                # Release stage j % STAGES to the consumers: bar.arrive orders my writes before their bar.sync.
                HW.named_barrier_arrive(FULL + stage_of(j), HANDSHAKE)
                tile = j + STAGES - 1  # the tile that goes into the stage tile j - 1 occupied
                if tile < n_tiles:
                    if j > 0:
                        # Both warpgroups have waited for their last wgmma reading tile j - 1 (K_{j-1}, V_{j-1}).
                        HW.named_barrier_sync(EMPTY + stage_of(j - 1), HANDSHAKE)
                    load_kv(smem, K_OFF + stage_of(tile) * KV_STRIDE, k, b, h, tile * BLOCK_N, seqlen_k, ptid)
                    load_kv(smem, V_OFF + stage_of(tile) * KV_STRIDE, v, b, h, tile * BLOCK_N, seqlen_k, ptid)
                I.cp_async_commit()
            for cc in range(max(n_tiles - STAGES, 0), n_tiles):  # the releases nobody refilled, as above
                HW.named_barrier_sync(EMPTY + stage_of(cc), HANDSHAKE)
            I.cp_async_wait_all()  # only empty groups are left; the thread ends here, as the TMA producer's does
            return

        if SETMAXNREG:
            HW.setmaxnreg_inc(CONSUMER_REGS)  # a consumer: take the registers the producer gave back
        if WS and wg == WARPGROUPS - 1:
            # ws: the last warpgroup hands warpgroup 0 the first turn (warpgroup 0 takes the last hand-over at the end)
            HW.named_barrier_arrive(TURN_0, PAIR)

        # ws, a consumer warpgroup: the block's items in turn; the turns and the stages run on across items.
        c = 0  # the block's tiles before this item
        nq = 0  # its items with at least one key tile before this one
        pending = False  # seam: an item whose last O += P V is still to issue (its P_{n-1} in P, its O in acc)
        prev_item = numba.int64(0)  # ... and its index (its rows found again when they are written)
        ch = numba.int64(cuda.blockIdx.x)
        kc = 0  # dynamic: the block's chunks so far (its first, blockIdx.x, taken without the slots)
        while WS and not producer and ch < n_chunks:  # WS first: the loop is gone from the other pipelines' code
            for item in range(ch * chunk, min(ch * chunk + chunk, n_items)):
                q_start, h, b, n_tiles = item_tiles(item, n_qt, heads, seqlen_q, seqlen_k, causal, chunk == 2)
                row0 = q_start + 16 * (tid // 32)
                # ws-overlap: the item's first key tile that needs a mask.  (Not computed in ws: though unused there,
                # it kept one more value live and made the cp.async ws kernel at D = 96 spill, offline ptxas.)
                masked_from = d_first_masked_tile(q_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal) if WSO else 0
                qb = nq % Q_BUFS  # the item's Q_i buffer, its descriptor and its release
                q_desc_i = HW.d_make_smem_desc(HW.smem_address(smem, qb * (BLOCK_M * D_PAD) + 64 * PANEL * wg), 16, SBO,
                                               SW128)
                q_empty = QEMPTY + qb
                if TMA and n_tiles > 0:
                    # Q_i has landed: the (nq // Q_BUFS)-th phase of its buffer's mbarrier
                    while not T.mbarrier_try_wait_parity(bars, QBAR + qb, (nq // Q_BUFS) % 2):
                        pass

                if SEAM and pending and n_tiles > 0:
                    # The previous item's last P V with this item's S_0, in one turn; its O written under the
                    # others' products.
                    if masked_from == 0:
                        seam_masked_tile(S, P, acc, m_i, l_i, alpha, m_prev, l_prev, bars, q_desc_i, k_desc, v_desc,
                                         c, n_tiles, row0, seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other,
                                         q_empty)
                    else:
                        seam_tile(S, P, acc, m_i, l_i, alpha, m_prev, l_prev, bars, q_desc_i, k_desc, v_desc, c,
                                  n_tiles, row0, seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other, q_empty)
                    # Step 3 of the previous item (O = acc / l, lse = m + log l), then the new item's O from zero.
                    write_item(o, lse, acc, m_prev, l_prev, prev_item, n_qt, heads, seqlen_q, causal, chunk == 2,
                               16 * (tid // 32), g, t)
                    zero_rows(acc)
                    pending = False
                else:
                    if SEAM and pending:
                        # An item that sees no key follows: the previous item's last P V alone, then its O.
                        last_pv_in_turn(acc, P, S, bars, v_desc, c, mine, other)
                        write_item(o, lse, acc, m_i, l_i, prev_item, n_qt, heads, seqlen_q, causal, chunk == 2,
                                   16 * (tid // 32), g, t)
                        pending = False
                    init_rows(m_i, l_i, acc)

                    for j in range(n_tiles if not WSO else 0):
                        k_start = j * BLOCK_N
                        stage = stage_of(c + j)
                        # The producer has released stage (c + j) % STAGES (K_j, V_j; with cp.async Q_i with tile 0).
                        wait_full(bars, c + j)

                        # S = Q_i K_jᵀ in my turn.  The turns alternate strictly, one product each: S(wg0), S(wg1),
                        # PV(wg0), PV(wg1), S(wg0) of the next tile ...; so one warpgroup's softmax runs under the
                        # other's product.
                        s_in_turn(S, q_desc_i, k_desc + u64((stage * KV_STRIDE * 2) >> 4), True, mine, True, other)
                        if TMA and j == n_tiles - 1:
                            HW.named_barrier_arrive(q_empty, HANDSHAKE)  # my last S of the item: Q_i may be refilled
                        if SPLIT:
                            HW.named_barrier_arrive(EMPTY + stage, HANDSHAKE)  # K_j is read: it may be refilled
                        if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                            mask_scores(S, row0, k_start, seqlen_q, seqlen_k, causal, g, t)
                        online_softmax(S, acc, m_i, l_i, scale_log2)
                        # O += P V_j in my next turn (split: once V_j has landed).
                        wait_v(bars, c + j)
                        pv_in_turn(acc, P, S, v_desc + u64((stage * KV_STRIDE * 2) >> 4), mine, True, other)
                        # The producer may refill this stage (split: its V; else K and V).
                        HW.named_barrier_arrive(VEMPTY + stage, HANDSHAKE)

                    if WSO and n_tiles > 0:
                        # The item's key tile 0: S_0 alone in my turn (no P V yet), waited for; then P_0.
                        wait_full(bars, c)  # K_0 (with cp.async, Q_i too) has landed
                        s_in_turn(S, q_desc_i, k_desc + u64((stage_of(c) * KV_STRIDE * 2) >> 4), True, mine, True,
                                  other)
                        if SPLIT:
                            HW.named_barrier_arrive(EMPTY + stage_of(c), HANDSHAKE)  # K_0 is read: it may be refilled
                        if TMA and n_tiles == 1:
                            HW.named_barrier_arrive(q_empty, HANDSHAKE)  # my last S of the item: Q_i may be refilled
                        if masked_from == 0:
                            mask_scores(S, row0, 0, seqlen_q, seqlen_k, causal, g, t)
                        softmax_rows(S, m_i, l_i, scale_log2, alpha)  # O is still zero: nothing to rescale
                        for kk in range(PV_STEPS):
                            p_frags(P, S, kk, kk)
                # Key tiles 1 ...: S_j and P_{j-1} V_{j-1} overlapped, in two loops of straight-line steps: the tiles
                # that need no mask, then those that do (the last ones, masking.first_masked_tile).
                for j in range(1, max(1, min(masked_from, n_tiles)) if WSO else 1):
                    overlapped_tile(S, P, acc, m_i, l_i, alpha, bars, q_desc_i, k_desc, v_desc, c, j, n_tiles, row0,
                                    seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other, q_empty)
                for j in range(max(1, min(masked_from, n_tiles)), n_tiles if WSO else 1):
                    overlapped_masked_tile(S, P, acc, m_i, l_i, alpha, bars, q_desc_i, k_desc, v_desc, c, j, n_tiles,
                                           row0, seqlen_q, seqlen_k, causal, g, t, scale_log2, mine, other, q_empty)

                if SEAM and n_tiles > 0:
                    # The item's last P V waits for the next item's S_0 (or for the block's end).
                    pending = True
                    prev_item = item
                else:
                    if WSO and n_tiles > 0:
                        # The item's last O += P V, in one more turn.
                        last_pv_in_turn(acc, P, S, bars, v_desc, c + n_tiles, mine, other)
                    # Step 3 of the item: O_i = acc / l_i, lse_i = m_i + log l_i.
                    write_rows(o, lse, acc, m_i, l_i, b, h, row0, seqlen_q, g, t)
                c += n_tiles
                if n_tiles > 0:
                    nq += 1
            if DYNAMIC:
                kc += 1
                ch = read_chunk(bars, kc)
            else:
                ch += cuda.gridDim.x
        if SEAM and pending:
            # The block's last item: its last P V alone, then its O.
            last_pv_in_turn(acc, P, S, bars, v_desc, c, mine, other)
            write_item(o, lse, acc, m_i, l_i, prev_item, n_qt, heads, seqlen_q, causal, chunk == 2, 16 * (tid // 32),
                       g, t)
        if WS and wg == 0 and not producer:
            HW.named_barrier_sync(TURN_0, PAIR)  # the last warpgroup's last hand-over (its first, if no tile came)

        for j in range(n_tiles if PINGPONG else 0):
            k_start = j * BLOCK_N
            buf = j % 2
            # Step 2a (pingpong): K_j and V_j have landed (the only group in flight); start K_{j+1} and V_{j+1}.
            I.cp_async_wait(0)
            HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores (the async proxy)
            # Everyone's copies are visible; and both warpgroups have finished tile j - 1, whose buffers are
            # refilled now.
            cuda.syncthreads()
            if j + 1 < n_tiles:
                load_kv(smem, K_OFF + (1 - buf) * KV_STRIDE, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                load_kv(smem, V_OFF + (1 - buf) * KV_STRIDE, v, b, h, k_start + BLOCK_N, seqlen_k, tid)
                I.cp_async_commit()

            # Step 2b: S = Q_i K_jᵀ, warpgroup 0's products queued before warpgroup 1's: so warpgroup 0's S is
            # done first, and its softmax runs while the tensor cores work on warpgroup 1's.
            # (Warpgroup 1 waits until warpgroup 0 has issued its S; both then hand the turn to the other.)
            s_in_turn(S, q_desc, k_desc + u64((buf * KV_STRIDE * 2) >> 4), wg == 1, mine, True, other)

            # Step 2c: mask and online softmax (the O accumulators are not in flight: rescaled at once).
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                mask_scores(S, row0, k_start, seqlen_q, seqlen_k, causal, g, t)
            online_softmax(S, acc, m_i, l_i, scale_log2)

            # Step 2d: O += P V_j, again warpgroup 0 first (it waits until warpgroup 1 has issued its S); only
            # warpgroup 0 hands the turn on (to warpgroup 1's O += P V), the block barrier starts the next tile.
            pv_in_turn(acc, P, S, v_desc + u64((buf * KV_STRIDE * 2) >> 4), mine, wg == 0, other)

        if OVERLAP and n_tiles > 0:
            # Key tile 0 (step 2a as below; no P V yet): S_0 alone, waited for; then P_0 (O is still zero).
            overlap_refill(smem, k, v, b, h, 0, n_tiles, seqlen_k, tid)
            s_in_turn(S, q_desc, k_desc, False, mine, False, other)
            if first_masked == 0:
                mask_scores(S, row0, 0, seqlen_q, seqlen_k, causal, g, t)
            softmax_rows(S, m_i, l_i, scale_log2, alpha)
            for kk in range(PV_STEPS):
                p_frags(P, S, kk, kk)
        # Key tiles 1 ...: two loops of straight-line steps, the tiles that need no mask, then the last ones that do.
        for j in range(1 if OVERLAP else 0, max(1, min(first_masked, n_tiles)) if OVERLAP else 0):
            overlap_tile(S, P, acc, m_i, l_i, alpha, smem, k, v, q_desc, k_desc, v_desc, b, h, j, n_tiles, row0,
                         seqlen_q, seqlen_k, causal, g, t, scale_log2, tid)
        for j in range(max(1, min(first_masked, n_tiles)) if OVERLAP else 0, n_tiles if OVERLAP else 0):
            overlap_masked_tile(S, P, acc, m_i, l_i, alpha, smem, k, v, q_desc, k_desc, v_desc, b, h, j, n_tiles,
                                row0, seqlen_q, seqlen_k, causal, g, t, scale_log2, tid)

        if OVERLAP and n_tiles > 0:
            # Step 2e: the last O += P V, once V_{n-1} has landed.
            I.cp_async_wait(0)
            HW.fence_proxy_async()
            cuda.syncthreads()  # everyone's copies of V_{n-1} are visible
            o_t = HW.wgmma_fence_operand(HW.acc_from_array(acc, D_PAD))
            HW.wgmma_fence()
            v_desc_j = v_desc + u64((((n_tiles - 1) % 2) * KV_STRIDE * 2) >> 4)
            o_t = pv_product(o_t, P, v_desc_j)
            HW.wgmma_commit_group()
            HW.wgmma_wait_group(0)
            o_t = HW.wgmma_fence_operand(o_t)
            HW.acc_to_array(o_t, acc)

        for j in range(n_tiles if PLAIN else 0):
            k_start = j * BLOCK_N
            # Step 2a: wait for K_j (and Q_i), start V_j.
            I.cp_async_wait(0)  # K_j's group is the only one in flight
            HW.fence_proxy_async()  # my cp.async writes → visible to the tensor cores (the async proxy)
            # Everyone's copies of K_j are visible; and every warpgroup has waited for its O += P V_{j-1}, so the
            # V buffer may be refilled.
            cuda.syncthreads()
            load_kv(smem, V_OFF, v, b, h, k_start, seqlen_k, tid)
            I.cp_async_commit()

            # Step 2b: S = Q_i K_jᵀ, the warpgroup's 64 rows × BLOCK_N keys.
            s = HW.wgmma_fence_operand(HW.wgmma_acc_zeros(BLOCK_N))
            HW.wgmma_fence()
            s = qk_product(s, q_desc, k_desc)
            HW.wgmma_commit_group()
            HW.wgmma_wait_group(0)
            s = HW.wgmma_fence_operand(s)
            HW.acc_to_array(s, S)

            # Step 2c: mask; wait for V_j, start K_{j+1}.
            if d_tile_needs_mask(q_start, k_start, BLOCK_M, BLOCK_N, seqlen_q, seqlen_k, causal):
                mask_scores(S, row0, k_start, seqlen_q, seqlen_k, causal, g, t)
            I.cp_async_wait(0)  # V_j's group is the only one in flight
            HW.fence_proxy_async()  # my cp.async writes of V_j → visible to the tensor cores
            # Everyone's copies of V_j are visible; and every warpgroup has waited for its S = Q K_jᵀ, so the K
            # buffer may be refilled.
            cuda.syncthreads()
            if j + 1 < n_tiles:
                load_kv(smem, K_OFF, k, b, h, k_start + BLOCK_N, seqlen_k, tid)
                I.cp_async_commit()

            # Step 2d: online softmax (S becomes P, O is rescaled).
            online_softmax(S, acc, m_i, l_i, scale_log2)

            # Step 2e: O += P V_j, P from registers (the S accumulators packed to 16 bits).
            o_t = HW.wgmma_fence_operand(HW.acc_from_array(acc, D_PAD))
            HW.wgmma_fence()  # the rescaled accumulators are written before the wgmma reads them
            for kk in range(PV_STEPS):
                p_frags(P, S, kk, kk)
            o_t = pv_product(o_t, P, v_desc)
            HW.wgmma_commit_group()
            HW.wgmma_wait_group(0)
            o_t = HW.wgmma_fence_operand(o_t)
            HW.acc_to_array(o_t, acc)

        I.cp_async_wait_all()  # nothing left in flight (only Q's group when no key tile was visible)

        # Step 3: O_i = acc / l_i, lse_i = m_i + log l_i (ws: written per item above).
        if not WS:
            write_rows(o, lse, acc, m_i, l_i, b, h, row0, seqlen_q, g, t)

    return flash_forward_wgmma


# ----------------------------------------------------------------------------
# Configuration and launch
# ----------------------------------------------------------------------------


@functools.cache
def choose_config(
    head_dim: int, input_kind: str, *, simulator: bool = SIMULATOR, copies: str = "tma", long_keys: bool = False,
    persistent: bool = True, causal: bool = True, seam: bool = False,
) -> WGConfig:
    """The configuration for a head dim (any multiple of 8 up to 256), chosen by the H200 sweeps.

    ``long_keys``: at least :data:`WSO_MIN_KEYS_D64` keys (it matters at D <= 64 only).  ``persistent``: the
    pipelines that copy with TMA get persistent blocks (:func:`config_for` turns them off for long non-causal
    calls, :data:`PERSISTENT_MAX_KEYS`, except on the three-consumer kernel and above D = 128).  ``causal=False``
    (it matters at D <= 64 with ``long_keys`` only): the pick for non-causal calls.  ``seam`` (it matters for the
    causal pick at D <= 64 with ``long_keys`` only): two Q_i buffers and the seam step (:func:`config_for`: below
    :data:`SEAM_MAX_KEYS` keys).

    Since 2026-12-07 (forty-third session, H100, bf16; each checked against
    float64 first, worst 0.60–0.78 of the naive error in bf16 and fp16;
    compute-sanitizer memcheck, racecheck and synccheck clean) the head dims
    above 128 take ws-overlap with TMA too: 2 stages with K and V on their own
    mbarriers (``split_kv``; 3 do not fit beside Q_i), ``setmaxnreg``
    (:data:`WIDE_REGISTER_SPLIT`), 128 × 96 tiles at a padded 192 and 128 × 64
    at 256, persistent at every length (:func:`config_for`).  TFLOP/s at N =
    1k / 4k / 16k against the ``overlap`` kernel picked before and cuDNN in the
    same run (``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-07-s43-wide.json``):

    ======  ======  ===================  ===================  ===================
    D       causal  this pick            ``overlap``          cuDNN
    ======  ======  ===================  ===================  ===================
    176     no      495 / 634 / 675      300 / 352 / 354      526 / 622 / 645
    176     yes     338 / 529 / 607      229 / 309 / 338      390 / 535 / 585
    256     no      541 / 696 / 739      307 / 363 / 353      610 / 717 / 741
    256     yes     398 / 634 / 723      231 / 308 / 376      445 / 596 / 647
    ======  ======  ===================  ===================  ===================

    With one block per item the same kernels ran 1–7 % slower (at 16k keys
    too: 693 against 739 at D = 256 non-causal), hence persistent blocks at
    every length; the ws pipeline without the overlap (D = 256, persistent)
    7–18 % slower.

    Since 2026-12-07 (fortieth session, H100; the thirty-ninth session's
    32-bit stage, phase and tile-count arithmetic and int32 mask compares,
    timed against the tree before them in one run, +2 … +6 % on every pick:
    ``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-07-s40-new.json`` against
    ``…-s40-old.json``), two rules
    moved.  The three-consumer kernel keeps persistent blocks with the
    dynamic scheduler at every length: at 16k keys 523 / 531 / 535 TFLOP/s
    against 521 / 501 / 487 with one block per item (bf16, bf16, fp16; two
    runs), even at 32k (511 / 509 against 514 / 507).  And causal calls at
    D <= 64 from :data:`WSO_MIN_KEYS_D64` to :data:`SEAM_MAX_KEYS` keys take
    the seam step: bf16 at 4k 432 / 430 / 435 against 424 / 422 / 425 (three
    runs), fp16 432 against 424, cuDNN 429–432; at 2k 369 / 368 / 367 against
    360 / 359 / 371 (fp16 368 against 360); at 8k even, at 16k 1–3 % behind
    (``…-s40-seam-d64.json``).

    Since 2026-12-06 (thirty-seventh session, H100; checked against float64
    first, worst 0.75 bf16 / 0.63 fp16 of the naive error; compute-sanitizer
    clean) the three-consumer kernel below runs persistent blocks with the
    dynamic scheduler (``dynamic=True``, module docstring) below
    :data:`PERSISTENT_MAX_KEYS` keys: bf16 473 / 499 TFLOP/s at N = 2k / 4k
    against 436 / 478 with one block per item and 464 / 478 for cuDNN in the
    same run (fp16 at 2k: 472 against 440 and 466); at 16k it was 1 % behind
    one block per item (505 against 511; cuDNN 479), which stays the pick
    there.  At 1k it led too (396 against 391 for the 128 × 128 pick) but
    cuDNN's 437 was far ahead, and the pick there is unchanged.  Causal calls,
    where the static pairs already balance the blocks, gained nothing (336 /
    411 / 488 at 2k / 4k / 16k against 344 / 407 / 479 for the 128 × 192
    pick), nor did D = 128 beyond noise (+1 % non-causal bf16, −4 … +1 %
    fp16): both are unchanged (``tc-forward-…-s37-dyn-*.json``).

    Since 2026-12-06 (thirty-fifth session, H100, bf16; checked against
    float64 first), non-causal calls at D <= 64 from :data:`WSO_MIN_KEYS_D64`
    keys take three consumer warpgroups, 192 × 128 tiles (ws-overlap, 3
    stages, TMA, ``setmaxnreg`` 32 / 160), then one block per work item: 442 / 480
    / 504 TFLOP/s at N = 2k / 4k / 16k against 437 / 464 / 477 for the
    persistent 128 × 192 kernel in the same run, and 467 / 484 / 492 for
    cuDNN (``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-06-s35-wg3-shapes.json``;
    the same at batch 1 with 256 / 128 heads).  Persistent, the same kernel
    was 13–19 % slower at 2k–4k (381 / 389) though 1 % faster at 16k (510).
    Causal it was 6 % / 2 % slower at 2k / 4k (321 / 400 against 342 / 408),
    so causal calls keep the 128 × 192 tiles.  Wider tiles (192 × 160 and up)
    spill at 160 registers (offline, sm_90a); at D = 128, 192 × 64 tiles
    measured 10–52 % slower than 128 × 128 (``…-s35-wg3.json``).

    Since the ws-overlap step was restructured (2026-12-05, module docstring),
    the 128 × 128 ws-overlap kernel also leads at D <= 64 below
    :data:`WSO_MIN_KEYS_D64` keys: on the H200 (session 28, ``docs/performance.md``;
    bf16, N = 512 / 1k / 2k) 324 / 384 / 423 non-causal and 195 / 277 / 348
    causal, against 284 / 322 / 344 and 188 / 250 / 297 for the 128 × 128 ws
    kernel picked before (fp16 within 1 %).  The 128 × 192 tiles stay ahead
    from 2k keys on.  Re-measured on an H100 with files
    (``tc-forward-NVIDIA-H100-80GB-HBM3-2026-12-06-overlap.json`` and
    ``…-base.json``, bf16, N = 512 / 1k): 322 / 383 non-causal and 194 / 279
    causal against 285 / 329 and 189 / 255 for the ws kernel; at 2k the
    128 × 192 and 128 × 128 tiles are level (436 / 423 and 344 / 345).

    ``tc-forward-NVIDIA-H200-2026-12-03-persistent.json`` (bf16, N = 1k / 2k /
    4k / 16k, each pick beside itself with one block per work chunk): persistent
    blocks add 13 / 7 / 2 / −3 % at D = 128 non-causal and 9 / 5 / 3 / 3 %
    causal; at D = 64 (128 × 128 ws) 14 / 7 / 3 / −1 % and 11 / 6 / 4 / 0 %.
    The second run (``…-persistent-all.json``, bf16 and fp16, N = 512 … 16k)
    gave the thresholds:

    * at 8k keys persistent blocks are still 0–3 % ahead non-causal, at 16k
      −3 … +1 % (hence :data:`PERSISTENT_MAX_KEYS`);
    * at D = 64 the persistent 128 × 128 ws kernel is 13–19 % ahead of the
      plain 128 × 64 one at 512 and 1k keys, so TMA now runs at every length;
    * the 128 × 192 ws-overlap kernel at D = 64, persistent, is ahead of the
      128 × 128 ws one from 2k keys on (402 against 379 at 2k non-causal, even
      causal), hence :data:`WSO_MIN_KEYS_D64`.

    Since ``tc-forward-NVIDIA-H200-2026-12-01-setmaxnreg.json`` (bf16, N = 1k /
    4k / 16k; the ws pipeline before in the same run): the producer gives its
    registers to the consumers (``setmaxnreg``, 24 and 240), so the
    ws-overlap pipeline no longer spills.

    * 64 < D <= 128: ws-overlap, 128 × 128, 3 stages, TMA: 373 / 517 / 555
      non-causal and 221 / 406 / 564 causal, against 351 / 482 / 548 and
      218 / 388 / 484 (+1 % to +16 %).
    * D <= 64 from :data:`WSO_MIN_KEYS_D64` keys: ws-overlap, 128 × 192, 3
      stages, TMA: 386 / 425 non-causal and 335 / 410 causal at 4k / 16k,
      against 363 / 395 and 330 / 377 (+2 % to +9 %); at 1k it is 4–12 %
      slower and at 2k even (``…-setmaxnreg-default.json``, bf16 and fp16),
      so shorter sequences kept the ws pipeline (and the plain kernel below
      1025 keys, until persistent blocks).

    The second run (``…-setmaxnreg-default.json``, bf16 and fp16, N = 512 …
    16k) put the D = 128 default at −6 % to +19 % of the ws pipeline: ahead at
    16 of its 20 points, and by 5–13 % at N = 16k.

    Before that:

    ``benchmarks/results/tc-forward-NVIDIA-H200-2026-11-30-wgmma-*.json``
    (bf16, batch·N = 16k, heads·D = 2048; TFLOP/s at N = 1k / 4k / 16k,
    non-causal; runs differ by up to 8 % from one another):

    Up to D = 128: the ws pipeline, 128 × 128 tiles, 2 stages, copying with
    TMA (``tc-forward-…-tma.json``, f563588, bf16, N = 1k / 4k / 16k in one
    run).  ``copies="cp.async"`` gives the best configuration without TMA
    (:func:`config_for` falls back to it for strides the TMA cannot step).
    ``tc-forward-…-12-01-tma-default.json`` (bf16 and fp16, N = 512 … 16k)
    has both side by side with SDPA flash and cuDNN.  The earlier run:

    * D = 128, 128 × 128, 2 stages: 418 / 517 / 545 non-causal and 287 / 460 /
      542 causal, against 391 / 455 / 489 and 276 / 424 / 448 for the same
      pipeline copying with cp.async (+4 % to +21 %); 3 stages within 2 %.
    * D ≤ 64, 128 × 128, 2 stages: 303 / 364 / 386 non-causal and 216 / 326 /
      384 causal, against 289 / 345 / 371 and 214 / 304 / 342 for the plain
      128 × 64 default before (+1 % to +12 %).

    The sweeps before TMA:

    * D ≤ 64: 128 × 64, plain pipeline: 259–266 / 325–327 / 348–353 (SDPA
      flash 272–277 / 300 / 306); ws 128 × 128 (session 7) 233–234 / 301–309 /
      332–333 against 237–242 / 311–320 / 346–353 plain in the same runs.  128 × 128 plain gives 227 / 298 / 325;
      overlapped 259–263 / 312 / 331; pingpong 222 / 262 / 283 (98 registers
      plain, 106 overlapped, 130 pingpong: at two blocks per SM the blocks
      already overlap each other).
    * D = 128: 128 × 128, ws with 2 stages (``-ws-wg`` and ``-wso`` runs,
      session 7): 300–301 / 398–409 / 431–444 against pingpong's 298–299 /
      363–365 / 415–417 in the same runs (causal 213–216 / 348–353 /
      430–440 against 215–217 / 339–341 / 389–406); 3 stages 287 / 379 /
      402 (its 224 KB leave the L1 little room), 128 × 64 tiles 336–376 at
      N ≥ 4k; ws-overlap 220 / 263 / 279: it needs ~200 registers and gets 168
      (384 threads), so it spills.  Session 6: pingpong 315 / 408 / 439 against
      305 / 369 / 423 plain (SDPA flash 322 / 354 / 351); overlapped 298 /
      395 / 417.
    * D > 128 (not timed then): 128 × 64, overlapped (234 registers at D = 256,
      no spill); checked on the H200 by the tests.  Today the pick without
      TMA (``copies="cp.async"``).

    cuDNN reaches 414–477 (D = 64) and 575–662 (D = 128) in the same runs.
    Nsight Compute on the D = 128 pingpong kernel at N = 16k: tensor pipes
    46 % busy, one instruction issued every 2.6 cycles per scheduler (two
    warps each), a third of the warps' time at barriers; L2 22 %, DRAM 1 %.

    In the simulator, one warpgroup and 16-key tiles keep the Python threads
    few while small sequences still cross tile edges.
    """
    if simulator:
        return WGConfig(64, 16, head_dim, input_kind)
    d_pad = padded_head_dim(head_dim)
    if three_consumers(head_dim, long_keys, causal) and copies == "tma":
        # Three consumer warpgroups (192 query rows); persistent blocks only with the dynamic scheduler: see above.
        return WGConfig(192, 128, head_dim, input_kind, "ws-overlap", stages=3, copies="tma", setmaxnreg=True,
                        persistent=persistent, dynamic=persistent)
    if d_pad <= 128 and copies == "tma":
        wide = d_pad <= 64 and long_keys  # 128 × 192 tiles
        return WGConfig(128, 192 if wide else 128, head_dim, input_kind, "ws-overlap", stages=3, copies="tma",
                        setmaxnreg=True, persistent=persistent,
                        **({"q_buffers": 2, "seam": True} if wide and causal and seam else {}))
    if copies == "tma":  # D > 128: 2 split stages beside Q_i; the widest tiles without local memory
        return WGConfig(128, 96 if d_pad <= 3 * PANEL else 64, head_dim, input_kind, "ws-overlap", stages=2,
                        copies="tma", setmaxnreg=True, persistent=persistent, split_kv=True)
    if d_pad <= 64:
        return WGConfig(128, 64, head_dim, input_kind, "plain")
    if d_pad <= 128:
        return WGConfig(128, 128, head_dim, input_kind, "ws", stages=2)
    return WGConfig(128, 64, head_dim, input_kind, "overlap")


def three_consumers(head_dim: int, long_keys: bool, causal: bool) -> bool:
    """Does :func:`choose_config` (copying with TMA) pick the three-consumer kernel, 192 × 128 tiles?  Non-causal
    calls at a padded D <= 64 from :data:`WSO_MIN_KEYS_D64` keys (``long_keys``)."""
    return padded_head_dim(head_dim) <= 64 and long_keys and not causal


#: At D <= 64 the 128 × 192 ws-overlap kernel pays from this many keys on (persistent, both kinds of kernel:
#: ``tc-forward-…-12-03-persistent.json``, +6 % at 2k non-causal and even causal, +6–15 % from 4k on; slower at 1k).
WSO_MIN_KEYS_D64 = 2048
#: Causal calls at D <= 64 from WSO_MIN_KEYS_D64 keys up to (not including) this many take the seam step between
#: work items (``WGConfig.seam``, two Q_i buffers): 2 % ahead at 4k keys, −1 … +3 % at 2k, even at 8k, behind at 16k
#: (:func:`choose_config`).
SEAM_MAX_KEYS = 8192
#: Non-causal calls with at least this many keys run one block per work chunk rather than persistent blocks (the
#: three-consumer kernel excepted: its dynamic scheduler evens out the blocks, :func:`choose_config`): at 16k
#: keys the persistent grid was −3 … +1 % (D = 128, bf16 / fp16), at 8k still 1–3 % ahead (``…-persistent-all.json``).
#: A likely cause (measured for the three-consumer kernel, whose blocks keep a slow mode: the module docstring): a
#: static share of equal items cannot even out blocks that run slower, as the hardware's block scheduler does.
PERSISTENT_MAX_KEYS = 16384


def config_for(head_dim: int, input_kind: str, q, k, v, causal: bool = False) -> WGConfig:
    """:func:`choose_config`'s pick for these arrays (canonical ``(B, H, N, D)`` views or descriptors).

    ``long_keys`` is set from k's length (at D <= 64, from :data:`WSO_MIN_KEYS_D64`
    keys on, the 128 × 192 ws-overlap kernel runs causal calls, below
    :data:`SEAM_MAX_KEYS` keys with the seam step, and the 192 × 128 one with
    three consumers non-causal ones, its persistent blocks with the dynamic
    scheduler at every length); persistent blocks unless the call is
    non-causal with :data:`PERSISTENT_MAX_KEYS` keys or more on another kernel
    with at most 128 (padded) head-dim columns.

    Where it copies with TMA, the best configuration that copies with
    ``cp.async`` instead when the TMA one cannot run on the arrays
    (:func:`can_implement`: e.g. a stride that is not a positive multiple of
    16 bytes, as for k and v broadcast over heads).
    """
    n_k, causal = k.shape[2], bool(causal)
    long_keys = n_k >= WSO_MIN_KEYS_D64
    persistent = (causal or n_k < PERSISTENT_MAX_KEYS or three_consumers(head_dim, long_keys, causal)
                  or padded_head_dim(head_dim) > 2 * PANEL)
    cfg = choose_config(head_dim, input_kind, long_keys=long_keys, persistent=persistent, causal=causal,
                        seam=n_k < SEAM_MAX_KEYS)
    if cfg.copies == "tma" and not can_implement(cfg, q, k, v)[0]:
        cfg = choose_config(head_dim, input_kind, copies="cp.async")
    return cfg


def supported_device() -> tuple[bool, str]:
    """Can this device run wgmma?  ``(ok, reason)``: sm_90 (Hopper), or the simulator's emulation."""
    cc = compute_capability()
    if cc is None:
        return True, ""
    if cc[0] != 9:
        return False, f"wgmma needs compute capability 9.x (Hopper), the device has {cc[0]}.{cc[1]}"
    return True, ""


def can_implement(cfg: WGConfig, *arrays) -> tuple[bool, str]:
    """Will this configuration launch on these arrays (q, k, v, o) on this device?  ``(ok, reason)``."""
    ok, why = supported_device()
    if not ok:
        return False, why
    need = shared_bytes(cfg)
    limit = max_shared_per_block()
    if need > limit:
        return False, f"needs {need} bytes of shared memory per block, the device allows {limit}"
    if cfg.warp_specialized and len(arrays) >= 2:
        # The ws kernels count a block's key tiles (over its items) in 32 bits (stage_of, use_parity).
        (batch, heads, seqlen_q, _), seqlen_k = arrays[0].shape, arrays[1].shape[2]
        tiles = batch * heads * -(-seqlen_q // cfg.block_m) * -(-seqlen_k // cfg.block_n)
        if tiles >= 2**32:
            return False, (f"{tiles} (query tile, key tile) pairs exceed the 2^32 - 1 that the {cfg.pipeline} "
                           f"pipeline counts")
    # o too: the epilogue writes each pair of outputs with one 32-bit store (aligned rows, as for the copies)
    why = tile_rows_problem(cfg.head_dim, "qkvo", arrays, copied=4)
    if not why and cfg.copies == "tma":  # a tensor map's strides (rows, heads, batches) are whole 16-byte units
        why = next(filter(None, (T.stride_problem(name, a) for name, a in zip("qkv", arrays, strict=False))), "")
    return not why, why


def launch_forward_wgmma(cfg: WGConfig, q, k, v, o, lse, scale: float, causal: bool, stream=0, check: bool = True):
    """Launch the wgmma forward on canonical ``(B, H, N, D)`` views (float16, or bfloat16 as uint16).

    ``check=False`` skips :func:`can_implement` for a caller that has just run it (nbflash.api's plan).
    """
    if not scale > 0:
        raise ValueError(f"wgmma forward: scale must be positive (the row max is taken before scaling), got {scale}")
    ok, why = can_implement(cfg, q, k, v, o) if check else (True, "")
    if not ok:
        raise ValueError(f"wgmma forward configuration {cfg} cannot run: {why}")
    batch, heads, seqlen_q, _ = q.shape
    grid = work_grid(cfg, batch, heads, seqlen_q, causal)
    args = (q, k, v, o, lse, float(scale * LOG2E), bool(causal), tensor_maps(cfg, q, k, v), work_counter(cfg))
    launch(forward_wgmma_kernel(cfg), grid, (cfg.threads, 1, 1), stream, shared_bytes(cfg), *args)


def kernel_signature(cfg: WGConfig):
    """The Numba argument types of the kernel: the ``mma.sync`` kernel's (q, k, v, o, lse, scale, causal), then
    the tensor maps of q, k, v (:func:`tensor_maps`) and the work counter (:func:`work_counter`)."""
    from numba import types

    return (*tc_kernel_signature(cfg), types.Array(types.uint8, 2, "C"), types.Array(types.int32, 1, "C"))


#: Work counters handed out per device before another pool is allocated.
COUNTER_POOL = 256
_counters: dict = {}  # (device, stream) -> its pair
_counter_pools: dict = {}  # device -> [pairs (CuPy, COUNTER_POOL × 2 int32), pairs handed out]
_counter_lock = threading.Lock()


def work_counter(cfg: WGConfig):
    """The kernel's ``sched`` argument: two int32, zero before every launch — the next chunk to hand out (less the
    grid) and the blocks that have finished taking chunks; the last of them sets both back to zero.

    Only ``cfg.dynamic`` reads it (the other kernels get the same argument, unread).  On the GPU each stream has its
    own pair (launches on one stream run one after the other; launches on two may overlap), found when the launch
    is made (:class:`nbflash._launch.Derived`, so a recorded call finds its replay's stream's pair); in the
    simulator a fresh pair.
    """
    if SIMULATOR:
        return np.zeros(2, np.int32)
    from . import _launch

    return _launch.Derived(_stream_counter, (), _launch.ArrayArg(0, (2,), (4,), np.dtype(np.int32)))


def _stream_counter(sources, stream: int, device: int):
    """The work counter of ``stream`` on ``device``: a pair from the device's pool, zeroed once when the pool is
    allocated (never inside a CUDA graph capture) and kept at zero between launches by the kernel."""
    counter = _counters.get((device, stream))
    if counter is not None:
        return counter
    import cupy as cp

    with _counter_lock, cp.cuda.Device(device):
        counter = _counters.get((device, stream))
        if counter is None:
            pool = _counter_pools.get(device)
            if pool is None or pool[1] == COUNTER_POOL:
                if cp.cuda.runtime.streamIsCapturing(stream):
                    raise RuntimeError("nbflash: the wgmma forward's work counters are allocated outside CUDA graph "
                                       "captures; run the call once before capturing it")
                pool = [cp.zeros((COUNTER_POOL, 2), np.int32), 0]
                cp.cuda.get_current_stream().synchronize()  # zero before any stream's kernel reads them
                _counter_pools[device] = pool
            counter = pool[0][pool[1]]
            pool[1] += 1
            _counters[(device, stream)] = counter
    return counter


@functools.cache
def _no_maps(device: int):
    """The ``maps`` argument of the configurations that copy with cp.async: 3 × 128 bytes, never read."""
    if SIMULATOR:
        return np.zeros((3, T.TENSOR_MAP_BYTES), np.uint8)
    import cupy as cp

    with cp.cuda.Device(device):
        return cp.zeros((3, T.TENSOR_MAP_BYTES), np.uint8)


def no_maps():
    """The ``maps`` argument of a kernel that copies with cp.async (the current device's placeholder)."""
    return _no_maps(0 if SIMULATOR else __import__("cupy").cuda.Device().id)


def tensor_maps(cfg: WGConfig, q, k, v):
    """The kernel's ``maps``: TMA tensor maps of q (boxes of block_m rows), k and v (block_n rows) × 64 columns,
    128-byte swizzled, when ``cfg.copies == "tma"`` (:func:`nbflash.tma.launch_maps`: on the GPU made for each
    launch's own arrays); else a placeholder."""
    if cfg.copies != "tma":
        return no_maps()
    box = (PANEL, HW.SWIZZLE_128B)
    return T.launch_maps((q, k, v), [(cfg.block_m, *box), (cfg.block_n, *box), (cfg.block_n, *box)])


def compile_targets():
    """``(name, cfg, kernel, signature, fastmath)`` for the GPU configurations (the PTX check, sm_90a): bfloat16 at
    every head dim, with TMA and without (above D = 128 the ws-overlap pick with split stages and the overlap
    kernel), float16 at D = 128 with TMA (the two kinds differ only in the wgmma's input type and the
    packing of P; a warp-specialised kernel takes one to two minutes on one of CI's cores, and the simulator runs
    both kinds everywhere); the long-key picks from D = 64 up (D = 40's are D = 64's tiles on the same padded
    width); and the D = 128 pick with ``pin_softmax``, whose schedule the check also reads, the D = 64 causal pick
    with ``poly_exp2``, whose exponentials it counts, and with the seam step (its pick below
    :data:`SEAM_MAX_KEYS` keys)."""
    dims = (40, 64, 96, 128, 176, 256)
    cfgs = list(dict.fromkeys(choose_config(d, kind, simulator=False, copies=copies, long_keys=long_keys,
                                            causal=causal)
                              for long_keys in (False, True) for causal in (True, False)
                              for d in dims if d > 40 or not long_keys
                              for kind in ("float16", "bfloat16") for copies in COPIES
                              if kind == "bfloat16" or (d == 128 and copies == "tma")))
    cfgs.append(dataclasses.replace(choose_config(128, "bfloat16", simulator=False), pin_softmax=True))
    cfgs.append(dataclasses.replace(choose_config(64, "bfloat16", simulator=False, long_keys=True), poly_exp2=3))
    cfgs.append(choose_config(64, "bfloat16", simulator=False, long_keys=True, seam=True))
    return [("flash_forward_wgmma", cfg, forward_wgmma_kernel(cfg), kernel_signature(cfg), True) for cfg in cfgs]

