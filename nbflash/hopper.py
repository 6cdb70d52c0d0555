"""Hopper (sm_90a) tensor-core building blocks: ``wgmma.mma_async`` and its shared-memory descriptors.

The pattern is that of :mod:`nbflash.intrinsics`: every instruction is an
``@intrinsic`` emitting inline PTX, with a Python implementation of the
hardware's semantics chosen in Numba's CUDA simulator; layout helpers are
written once (host functions, plus ``d_`` device versions) and used by kernels,
by the simulator and by the tests.

The instructions
================

``wgmma.mma_async`` (:func:`wgmma_m64n64k16_f16` and friends)
    D (64×N, float32) = A (64×16) · Bᵀ (B is N×16) + D, computed by the four
    warps of a *warpgroup* (128 consecutive threads, the first warp's index a
    multiple of 4) together.  A and B are *not* in registers: each is described
    by a 64-bit **matrix descriptor** (:func:`make_smem_desc`) naming where in
    shared memory the tile lies and how it is laid out, and the tensor cores
    read it themselves.  Only D lives in registers, N/2 float32 per thread.  The
    instruction is *asynchronous*: it returns at once, and the accumulators may
    be neither read nor written until a :func:`wgmma_wait_group` covers it.
    Here both A and B come from shared memory (the "SS" form), K-major by
    default (``imm-trans-a = imm-trans-b = 0``: a row of A, and a row of B, is
    16 consecutive k) or either one MN-major (:func:`wgmma` with ``trans_a`` /
    ``trans_b``: 16 consecutive bytes hold 8 rows of one k, so a tile stored
    transposed is read as it is), ``imm-scale-a = imm-scale-b = 1``.
    ``scale_d`` is a runtime predicate: 0 computes D = A·Bᵀ, ignoring the old D
    (the first k-step).
Register-A form (:func:`wgmma_rs`)
    The same product with A (64×16) in registers: four 32-bit registers per
    thread, laid out per warp as the A fragment of ``mma.m16n8k16`` — which is
    what an accumulator tile becomes once packed to 16 bits, so P (or dS) feeds
    the next product without touching shared memory.  B may be K-major or
    N-major (``imm-trans-b = 1``: 8 consecutive n of one k in 16 bytes), so a V
    tile stored row by row (keys × D) is a B operand as it is.  The registers
    of A, like the accumulators, may not change until the wait.
``bar.sync`` / ``bar.arrive`` on named barriers (:func:`named_barrier_sync`, :func:`named_barrier_arrive`)
    Barriers 1–15 over a subset of the block's warps: two warpgroups take
    turns with them (FlashAttention-3's ping-pong) while ``syncthreads``
    (barrier 0) stays the whole block's.
``wgmma.fence.sync.aligned`` (:func:`wgmma_fence`)
    Orders this warp's earlier *register* accesses before the following
    wgmma's: required before the first ``wgmma.mma_async`` of a batch and
    whenever the accumulators were touched by ordinary instructions in between
    (say, rescaled by the online softmax).
``wgmma.commit_group`` / ``wgmma.wait_group N`` (:func:`wgmma_commit_group`, :func:`wgmma_wait_group`)
    Close the wgmmas issued since the last commit into a group; wait until at
    most N groups are still running (N an immediate: a compile-time constant).
    Only after the wait may the accumulators be used.
``fence.proxy.async.shared::cta`` (:func:`fence_proxy_async`)
    The tensor cores read shared memory through the *async proxy*; ordinary
    ``st.shared`` (and ``cp.async``) writes go through the *generic proxy*, and
    the two are not ordered with each other.  A thread that wrote a tile with
    normal stores must execute this fence *before* the barrier that precedes
    the wgmma reading it.  (TMA writes through the async proxy and needs none.)
``cp.reduce.async.bulk .add.f32`` and its groups (:func:`bulk_reduce_add_f32`, :func:`bulk_reduce_add_f32_where`,
:func:`bulk_commit_group`, ...)
    The bulk copy engine (TMA's, no tensor map needed) adds a contiguous run
    of float32 from shared memory into global memory, element by element
    atomically — one instruction per row instead of one ``red.global`` per
    register pair.  The registers are free as soon as the values are stored to
    shared memory; the reduction runs in the background.  Its rules: both
    addresses 16-byte aligned, a multiple of 16 bytes; ordinary stores to the
    source must be fenced (:func:`fence_proxy_async`) by the thread that made
    them, before the (warp or block) barrier after which another thread issues
    the reduction; the issuing thread closes its reductions into a group
    (``cp.async.bulk.commit_group``) and must wait for the group's *reads*
    (``cp.async.bulk.wait_group.read N``, :func:`bulk_wait_group_read`) before
    the source is written again (or, at the latest, before the block exits and its shared memory goes),
    and for its completion (``cp.async.bulk.wait_group N``, :func:`bulk_wait_group`) before the kernel
    itself reads the destination; the grid's end makes the sums visible to later kernels.
``setmaxnreg.inc`` / ``setmaxnreg.dec`` (:func:`setmaxnreg_inc`, :func:`setmaxnreg_dec`)
    Give this warpgroup's registers back to the block's pool, or take more
    from it, per thread (a multiple of 8, 24 … 256).  A warp-specialised
    kernel starts every thread at the count its launch bounds allow (384
    threads: 168) and then moves them from the copying warpgroup to the
    computing ones (FlashAttention-3: 24 and 240).  ptxas honours it only when
    it sees the whole program (Numba's default link-time optimisation does;
    PTX assembled for linking ignores it, its C7504) and when no code reached
    after a decrease needs more than the new count: the producer's branch
    must end the thread, not fall through into the consumers' code (else
    C7507).

The protocol, per k-loop iteration::

    (write A, B tiles to shared memory with st.shared / cp.async + cp_async_wait)
    fence_proxy_async()                  # my generic-proxy writes → visible to the async proxy
    cuda.syncthreads()                   # ... and everybody's writes are done
    acc = wgmma_fence_operand(acc)       # (after rescaling acc:) the compiler finishes those writes here
    wgmma_fence()                        # my register writes (acc) are done before wgmma reads them
    acc = wgmma_m64n64k16_f16(da, db, acc, scale_d)   # may be issued several times
    wgmma_commit_group()
    wgmma_wait_group(0)                  # the accumulators are final now
    acc = wgmma_fence_operand(acc)       # ... and the compiler may not use them any earlier

:func:`wgmma_fence_operand` is CUTLASS's ``warpgroup_fence_operand``: an empty
``asm volatile`` that takes and returns every accumulator.  The wgmma's inline
asm "returns" its outputs immediately as far as LLVM knows, so without it pure
arithmetic on the accumulators could be scheduled above the (volatile) wait;
before the fence, it keeps arithmetic that writes the accumulators from
sinking below ``wgmma.fence`` (volatile statements keep their order).

The matrix descriptor (PTX ISA, "Matrix Descriptor Format" of wgmma)
=====================================================================

::

    bits  0-13   (start address & 0x3FFFF) >> 4        shared-window byte address of the tile
    bits 16-29   (leading dimension byte offset) >> 4   LBO
    bits 32-45   (stride dimension byte offset) >> 4    SBO
    bits 49-51   base offset (0 when the swizzle pattern starts 1024/512/256-byte aligned)
    bits 62-63   swizzle: 0 none ("interleave"), 1 128-byte, 2 64-byte, 3 32-byte

The tile is built of **core matrices**: 8 rows × 16 bytes (8 f16/bf16 along
K), each row 16 contiguous bytes, the 8 rows 16 bytes apart (128 contiguous
bytes).  K-major, no swizzle — a 64×16 A tile is 8×2 core matrices::

                  k 0..7            k 8..15
    rows  0.. 7  [core 0,0] --LBO-->[core 0,1]        core matrix = 128 contiguous bytes:
                   |                                    row r, k-element e at  16·r + 2·e
                  SBO
                   v
    rows  8..15  [core 1,0]         [core 1,1]
    ...
    rows 56..63  [core 7,0]         [core 7,1]

    byte(row, k) = start + (row // 8)·SBO + (k // 8)·LBO + 16·(row % 8) + 2·(k % 8)

LBO: between the two core matrices adjacent in K; SBO: between core matrices
adjacent in M (N for B).  Any placement of the core matrices that these two
strides describe is allowed (:func:`kmajor_interleave_offset`).

128-byte swizzle, K-major: the unit is an *atom* of 8 rows × 128 bytes (64
f16 along K) in 1024 contiguous bytes, row r at 128·r; SBO is the distance
between atoms along M/N (1024 for atoms stacked densely), LBO is unused.
Within each row the eight 16-byte chunks are permuted: logical chunk c is
stored at chunk c ^ (r % 8) (:func:`kmajor_sw128_offset`)::

    row 0:  c0 c1 c2 c3 c4 c5 c6 c7
    row 1:  c1 c0 c3 c2 c5 c4 c7 c6
    row 2:  c2 c3 c0 c1 c6 c7 c4 c5
    ...
    row 7:  c7 c6 c5 c4 c3 c2 c1 c0

The hardware applies the XOR to the *address*: it forms ``start + (row // 8)·SBO
+ 128·(row % 8) + 16·chunk + 2·e`` and XORs address bits 4-6 with bits 7-9
(CuTe's ``Swizzle<3,4,3>``; 64 B: bits 4-5 with 7-8; 32 B: bit 4 with bit 7) —
see :func:`smem_desc_address`.  That is why a wgmma k-step of 16 elements
(32 bytes) within a 64-wide atom is taken by adding 32 bytes to the start
address (CUTLASS's descriptor iterator does exactly this), and why the atoms
must be 1024-byte aligned for a base offset of 0.

Sources checked: PTX ISA 9.7.15.5.1 "Register Fragments and Shared Memory
Matrix Layouts", "Shared Memory Matrix Layout" and 9.7.15.5.1.2.2 "Matrix
Descriptor Format" (https://docs.nvidia.com/cuda/parallel-thread-execution/ ,
read through the mirror https://ptx.poole.ai/docs/09-instruction-set/15-wgmma/
mma-async/matrix-descriptor and .../register-fragments); CUTLASS
``include/cute/arch/mma_sm90_desc.hpp`` (``GmmaDescriptor`` bit fields, layout
types INTERLEAVE=0, B128=1, B64=2, B32=3) and
``include/cute/atom/mma_traits_sm90_gmma.hpp`` (``make_gmma_desc``: K-major
INTERLEAVE ``((8,m),(T,2)):((1T,SBO),(1,LBO))``, B128
``((8,m),(T,2)):((8T,SBO),(1,T))`` under ``Swizzle<3,4,3>``; the accumulator
layout ``CLayout_64xN``); the wgmma operand syntax from the PTX ISA examples.

Accumulator layout
==================

Warp w of the warpgroup owns rows 16w..16w+15; within it, lane = 4g + t holds,
for every 8-column block j, the four values ``(16w+g, 8j+2t)``,
``(16w+g, 8j+2t+1)``, ``(16w+g+8, 8j+2t)``, ``(16w+g+8, 8j+2t+1)`` as registers
4j..4j+3 — the mma.sync m16n8 C layout, repeated N/8 times along the columns
and 4 times (once per warp) down the rows (:func:`acc_frag_index`).

The simulator
=============

A descriptor is only an integer, so the simulator needs to know which shared
array an address points into: :func:`smem_address` — the only way a kernel gets
a shared address here — gives each simulated shared array a fake base
address, 1024-byte aligned, per block, and remembers it.  The simulated wgmma
gathers the 128 threads' descriptors and accumulators (a warpgroup-wide
exchange, like the warp-wide one of :mod:`nbflash.intrinsics`), reads A and
B byte by byte at the addresses :func:`smem_desc_address` gives (the same
formula as the hardware's, swizzle included), multiplies in float64 and hands
each thread its own N/2 values.  It runs at issue time (fence, commit and wait
are bookkeeping), checks that a :func:`wgmma_fence` preceded each batch and a
:func:`fence_proxy_async` the first wgmma of a thread, and refuses a non-zero
base offset (not modelled).

Tiles are loaded with ``cp.async`` (or plain stores) and the proxy fence, or
by the TMA unit (:mod:`nbflash.tma`: a tensor map made on the host with the
driver's ``cuTensorMapEncodeTiled``, kept in global memory because Numba
cannot declare a ``__grid_constant__`` parameter, and mbarriers counting the
bytes), whose boxes land in exactly the 128-byte-swizzled layout above and
need no proxy fence.

Requires sm_90a (``wgmma`` is an arch-specific feature: PTX ``.target sm_90a``;
numba-cuda compiles for ``compute_90a`` on an sm_90 device by itself, and
offline with ``cc=(9, 0, "a")``).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from llvmlite import ir
from numba import types

from . import intrinsics as I
from ._device import _sim_lock, device_function, intrinsic
from .intrinsics import (
    _F32,
    _I32,
    _I64,
    _asm,
    _is_flat_array,
    _is_int,
    _public,
    _shared_address,
    bf16_bits_to_f32,
    f16_bits_to_f32,
)

__all__ = [
    "SWIZZLE_128B",
    "SWIZZLE_32B",
    "SWIZZLE_64B",
    "SWIZZLE_NONE",
    "WARPGROUP",
    "WGMMA_N",
    "acc_frag_index",
    "acc_from_array",
    "acc_to_array",
    "bulk_commit_group",
    "bulk_reduce_add_f32",
    "bulk_reduce_add_f32_where",
    "bulk_wait_group",
    "bulk_wait_group_read",
    "d_acc_frag_index",
    "d_kmajor_interleave_offset",
    "d_kmajor_sw128_offset",
    "d_mnmajor_sw128_offset",
    "d_make_smem_desc",
    "decode_smem_desc",
    "fence_proxy_async",
    "kmajor_interleave_offset",
    "kmajor_sw128_offset",
    "make_smem_desc",
    "mnmajor_sw128_offset",
    "named_barrier_arrive",
    "named_barrier_sync",
    "setmaxnreg_dec",
    "setmaxnreg_inc",
    "smem_address",
    "smem_desc_address",
    "wgmma",
    "wgmma_acc_zeros",
    "wgmma_commit_group",
    "wgmma_fence",
    "wgmma_fence_operand",
    "wgmma_m64n8k16_bf16",
    "wgmma_m64n8k16_f16",
    "wgmma_m64n16k16_bf16",
    "wgmma_m64n16k16_f16",
    "wgmma_m64n32k16_bf16",
    "wgmma_m64n32k16_f16",
    "wgmma_m64n64k16_bf16",
    "wgmma_m64n64k16_f16",
    "wgmma_m64n128k16_bf16",
    "wgmma_m64n128k16_f16",
    "wgmma_rs",
    "wgmma_wait_group",
]

#: Threads of a warpgroup (4 warps).
WARPGROUP = 128
#: The N of the ``m64nNk16`` shapes provided: every multiple of 8 up to 256, as the PTX allows for 16-bit inputs
#: (FlashAttention-3's 128 × 176 tiles at D = 128 need N = 176).
WGMMA_N = tuple(range(8, 257, 8))

#: Swizzle modes (descriptor bits 62-63).
SWIZZLE_NONE, SWIZZLE_128B, SWIZZLE_64B, SWIZZLE_32B = 0, 1, 2, 3
_SWIZZLE_BYTES = {SWIZZLE_128B: 128, SWIZZLE_64B: 64, SWIZZLE_32B: 32}


# ----------------------------------------------------------------------------
# Layouts: the accumulator fragment and the K-major shared-memory tiles
# ----------------------------------------------------------------------------


def _acc_frag_index(thread, i):
    """(row, col) in the 64×N D tile of accumulator ``i`` held by ``thread`` (0..127 within the warpgroup).

    PTX ISA, "WGMMA .m64nNk16 register fragment layout for accumulator D"
    (CUTLASS ``CLayout_64xN``): warp w = thread // 32 owns rows 16w..16w+15;
    with g = lane >> 2, t = lane & 3, register i sits at row g (+8 for
    i % 4 = 2, 3) and column 8·(i // 4) + 2t + (i & 1)::

                 col: 0,1       2,3      ...  6,7      |  8,9     ...
        row  0     T0 d0,d1   T1 d0,d1   ... T3 d0,d1   | T0 d4,d5 ...
        row  1     T4 d0,d1   ...                       |
        ...
        row  7    T28 d0,d1   ...                       |
        row  8     T0 d2,d3   T1 d2,d3   ... T3 d2,d3   | T0 d6,d7 ...
        ...
        row 15    T28 d2,d3   ...
        row 16    T32 d0,d1   ...            (warp 1)

    A row's values live in the quad 4g..4g+3 of one warp, as for mma.sync.
    """
    w = thread >> 5
    lane = thread & 31
    g = lane >> 2
    t = lane & 3
    return 16 * w + g + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * t + (i & 1)


def _kmajor_interleave_offset(row, k, lbo, sbo):
    """Byte offset of 16-bit element (row, k) in a K-major no-swizzle tile with strides ``lbo``, ``sbo``.

    Core matrix (row // 8, k // 8) starts at ``(row // 8)·sbo + (k // 8)·lbo``;
    inside it, row r is the 16 bytes at ``16·(row % 8)``.  Describe the tile with
    ``make_smem_desc(address, lbo, sbo, SWIZZLE_NONE)``.
    """
    return (row >> 3) * sbo + (k >> 3) * lbo + 16 * (row & 7) + 2 * (k & 7)


def _kmajor_sw128_offset(row, k):
    """Byte offset of 16-bit element (row, k) in a K-major, 128-byte-swizzled tile 64 elements wide (in K).

    8-row atoms of 1024 bytes, stacked densely (SBO = 1024); row r of an atom
    is 128 bytes at ``128·(row % 8)``, its 16-byte chunk c stored at chunk
    ``c ^ (row % 8)``.  The tile must start 1024-byte aligned; the k-step s
    (elements 16s..16s+15) is ``make_smem_desc(address + 32·s, 16, 1024, SWIZZLE_128B)``.
    """
    return (row >> 3) * 1024 + 128 * (row & 7) + 16 * ((k >> 3) ^ (row & 7)) + 2 * (k & 7)


def _mnmajor_sw128_offset(mn, k, lbo):
    """Byte offset of 16-bit element (mn, k) in an MN-major, 128-byte-swizzled tile (``imm-trans = 1``).

    Each k is a 128-byte row of 64 consecutive M/N elements, chunk c of k-row
    r stored at chunk ``c ^ (r % 8)``; 8 k-rows make a 1024-byte atom, atoms
    stacked along K densely (SBO = 1024), and 64-wide panels of M/N ``lbo``
    bytes apart.  A tile stored as ``rows × 64`` (say keys × head-dim columns)
    is this layout with k = the row: the same bytes as
    :func:`kmajor_sw128_offset` of (row, column).  The k-step s (k = 16s..16s+15)
    is ``make_smem_desc(address + 2048·s, lbo, 1024, SWIZZLE_128B)``.
    """
    return (mn >> 6) * lbo + (k >> 3) * 1024 + 128 * (k & 7) + 16 * (((mn & 63) >> 3) ^ (k & 7)) + 2 * (mn & 7)


def _make_smem_desc(address, leading_byte_offset, stride_byte_offset, swizzle):
    """The 64-bit wgmma matrix descriptor (base offset 0); see the module docstring for the fields."""
    desc = (np.uint64(address) & np.uint64(0x3FFFF)) >> np.uint64(4)
    desc |= ((np.uint64(leading_byte_offset) & np.uint64(0x3FFFF)) >> np.uint64(4)) << np.uint64(16)
    desc |= ((np.uint64(stride_byte_offset) & np.uint64(0x3FFFF)) >> np.uint64(4)) << np.uint64(32)
    desc |= (np.uint64(swizzle) & np.uint64(3)) << np.uint64(62)
    return desc


def make_smem_desc(address, leading_byte_offset, stride_byte_offset, swizzle) -> int:
    """The wgmma matrix descriptor of a shared-memory tile, as a Python ``int`` (host version).

    ``address``: shared-window byte address of the tile (16-byte aligned; in a
    kernel, from :func:`smem_address`); ``leading_byte_offset`` (LBO) and
    ``stride_byte_offset`` (SBO): bytes, multiples of 16, below 2**18;
    ``swizzle``: one of ``SWIZZLE_NONE``, ``SWIZZLE_128B``, ``SWIZZLE_64B``,
    ``SWIZZLE_32B``.  Kernels call :data:`d_make_smem_desc` (a ``uint64``).
    """
    return int(_make_smem_desc(address, leading_byte_offset, stride_byte_offset, swizzle))


def decode_smem_desc(desc):
    """``(start_address, lbo, sbo, base_offset, swizzle)`` of a descriptor, the byte fields in bytes."""
    desc = int(desc)
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4,
            (desc >> 49) & 7, (desc >> 62) & 3)


def smem_desc_address(desc, row, k, mn_major=False):
    """Shared byte address the tensor cores read for 16-bit element (row, k) of the operand ``desc``.

    The hardware model the simulator uses (``row``, ``k`` may be NumPy integer
    arrays); ``row`` is the M (or N) index, ``k`` the K index.

    K-major (``mn_major=False``, ``imm-trans = 0``): 16 consecutive bytes hold 8
    consecutive k.  No swizzle: core-matrix arithmetic with LBO and SBO.
    Swizzled: rows of the atom ``width`` bytes apart (128, 64 or 32), LBO
    unused.

    MN-major (``mn_major=True``, ``imm-trans = 1``; CuTe's canonical
    ``((T,W,m),(8,k)):((1,T,LBO),(W·T,SBO))``, T = 8 elements): 16 consecutive
    bytes hold 8 consecutive *rows* (M or N) of one k.  Swizzled: a k-row of
    ``width`` bytes holds ``width / 2`` consecutive M/N elements; the 8 k-rows
    of a group are ``width`` bytes apart; **LBO** steps to the next ``width / 2``
    elements of M/N, **SBO** to the next group of 8 k.  No swizzle: SBO steps
    8 M/N elements, LBO 8 k.  (For a V tile stored as rows of keys, 64 of D in
    each 128-byte row: k = key, the rows 128 bytes apart, LBO the distance
    between 64-column panels of D, SBO = 1024.)

    Swizzled addresses then have bits 4.. XORed with bits 7.. (``Swizzle<3,4,3>``,
    ``<2,4,3>``, ``<1,4,3>`` in CuTe).  A non-zero base offset is not modelled.
    """
    start, lbo, sbo, base_offset, swizzle = decode_smem_desc(desc)
    if base_offset:
        raise NotImplementedError("wgmma descriptors with a non-zero base offset are not modelled")
    if mn_major:
        if swizzle == SWIZZLE_NONE:
            return start + (row // 8) * sbo + (k // 8) * lbo + 16 * (k % 8) + 2 * (row % 8)
        width = _SWIZZLE_BYTES[swizzle]
        per_row = width // 2  # M/N elements in one swizzled k-row
        linear = start + (row // per_row) * lbo + (k // 8) * sbo + width * (k % 8) + 2 * (row % per_row)
    else:
        chunk, e = k // 8, k % 8  # 16-byte chunk along K, element within it
        if swizzle == SWIZZLE_NONE:
            return start + (row // 8) * sbo + chunk * lbo + 16 * (row % 8) + 2 * e
        width = _SWIZZLE_BYTES[swizzle]
        linear = start + (row // 8) * sbo + width * (row % 8) + 16 * chunk + 2 * e
    mask = width // 16 - 1
    if (start >> 7) & mask:
        raise NotImplementedError(f"a {width}-byte-swizzled operand must start in row 0 of its swizzle pattern "
                                  f"(shared address {start:#x}); the base offset that would fix it is not modelled")
    return linear ^ (((linear >> 7) & mask) << 4)


# Host versions ...
acc_frag_index = _acc_frag_index
kmajor_interleave_offset = _kmajor_interleave_offset
kmajor_sw128_offset = _kmajor_sw128_offset
mnmajor_sw128_offset = _mnmajor_sw128_offset

# ... and the same source compiled for kernels.
d_acc_frag_index = device_function(_acc_frag_index)
d_kmajor_interleave_offset = device_function(_kmajor_interleave_offset)
d_kmajor_sw128_offset = device_function(_kmajor_sw128_offset)
d_mnmajor_sw128_offset = device_function(_mnmajor_sw128_offset)
d_make_smem_desc = device_function(_make_smem_desc)


@functools.cache
def _acc_table(n):
    """(128, N/2, 2) array: (row, col) of every accumulator of every thread, from :func:`acc_frag_index`."""
    return np.array([[_acc_frag_index(t, i) for i in range(n // 2)] for t in range(WARPGROUP)])


# ----------------------------------------------------------------------------
# Simulator: shared addresses, the warpgroup exchange, the instructions
# ----------------------------------------------------------------------------


class _SimSharedSpace:
    """Fake shared-window addresses of one simulated block's shared arrays.

    Each distinct buffer (the root of a view chain; all dynamic shared arrays
    share one) gets a 1024-byte-aligned base on first use, as a kernel would
    get from ``cuda.shared.array(..., alignment=1024)``.
    """

    _ALIGN = 1024

    def __init__(self):
        self.regions = []  # (host pointer, nbytes, fake base, uint8 view)
        self.next = self._ALIGN  # address 0 stays unused

    def address(self, arr, offset):
        root = arr
        while isinstance(root.base, np.ndarray):
            root = root.base
        ptr = root.__array_interface__["data"][0]
        with _sim_lock:  # the block's threads ask at once: the first registers the buffer, the others find it
            known = [region[2] for region in self.regions if region[0] == ptr and region[1] >= root.nbytes]
            if known:
                base = known[0]
            else:
                base = self.next
                self.regions.append((ptr, root.nbytes, base, root.reshape(-1).view(np.uint8)))
                self.next = -(-(base + root.nbytes) // self._ALIGN) * self._ALIGN
                if self.next > 1 << 18:
                    raise ValueError("simulated shared memory exceeds the 256 KiB a descriptor can address")
        byte = base + (arr.__array_interface__["data"][0] - ptr) + int(offset) * arr.itemsize
        if byte % 16:
            raise ValueError(f"shared address {byte} (element {offset}) is not 16-byte aligned")
        return byte

    def read_u16(self, addresses):
        """The 16-bit words at byte ``addresses`` (an array), all inside one registered array; through the async
        proxy, so none may lie in a ``cp.async`` chunk its writer has not fenced yet."""
        lo, hi = int(addresses.min()), int(addresses.max()) + 2
        for ptr, nbytes, base, u8 in self.regions:
            if base <= lo and hi <= base + nbytes:
                off = addresses - base
                unfenced = _sim_unfenced_chunks()
                if unfenced:
                    with _sim_lock:
                        hit = unfenced.intersection((np.unique(off & ~15) + ptr).tolist())
                    if hit:
                        raise RuntimeError(f"wgmma read {len(hit)} shared 16-byte chunk(s) that cp.async wrote and "
                                           "the writing thread has not passed to the async proxy "
                                           "(fence_proxy_async) yet")
                return u8[off].astype(np.uint16) | (u8[off + 1].astype(np.uint16) << np.uint16(8))
        raise ValueError(f"wgmma operand bytes {lo:#x}..{hi:#x} are not inside one shared array known to "
                         "smem_address (every tile must come from an address smem_address gave)")


def _sim_block_state(name, factory):
    """Per-block simulator state ``name`` (made by ``factory`` on first use), kept on the block's manager."""
    manager = threading.current_thread()._manager
    with _sim_lock:
        state = manager.__dict__.get(name)
        if state is None:
            state = manager.__dict__[name] = factory()
    return state


class _SimWarpgroup:
    def __init__(self):
        self.barrier = threading.Barrier(WARPGROUP)
        self.slots = [None] * WARPGROUP
        self.result = None


def _sim_warpgroup():
    """The calling thread's index within its warpgroup (0..127) and the warpgroup's exchange state."""
    thread = threading.current_thread()
    group, index = divmod(thread.thread_id, WARPGROUP)
    bx, by, bz = thread._manager._block_dim
    if bx * by * bz < (group + 1) * WARPGROUP:
        raise ValueError(f"wgmma needs whole warpgroups of {WARPGROUP} threads; the block has {bx * by * bz}")
    groups = _sim_block_state("_nbflash_warpgroups", dict)
    with _sim_lock:
        wg = groups.get(group)
        if wg is None:
            wg = groups[group] = _SimWarpgroup()
    return index, wg


def _thread_state():
    """This simulated thread's bookkeeping: has it fenced registers / the async proxy, and its bulk reductions
    issued but not committed (``bulk_pending``) and committed groups (``bulk_groups``, oldest first)?"""
    thread = threading.current_thread()
    state = getattr(thread, "_nbflash_wgmma", None)
    if state is None:
        state = thread._nbflash_wgmma = {"fenced": False, "landed": [], "bulk_pending": [], "bulk_groups": []}
    return state


def _sim_smem_address(smem, offset):
    """Shared-window byte address (``uint32``) of element ``offset`` of the shared array ``smem``.

    PTX: a generic → shared address-space cast (``cvta.to.shared``), as
    :mod:`nbflash.intrinsics` does for ldmatrix; any compute capability.
    ``smem`` must be a C-contiguous shared array.  Feed the result to
    :data:`d_make_smem_desc`.  Simulator: a fake address, 1024-byte aligned per
    shared array, remembered so that the simulated wgmma can find the bytes.
    """
    return np.uint32(_sim_block_state("_nbflash_smem", _SimSharedSpace).address(smem, offset))


def _sim_wgmma_fence():
    """Order this warp's earlier accumulator-register accesses before the next wgmma.

    PTX: ``wgmma.fence.sync.aligned``; sm_90a.  Required before the first
    ``wgmma.mma_async`` of a batch, and again after ordinary instructions wrote
    the accumulators.  Simulator: records that the fence happened (a wgmma
    without one since the last wait raises).
    """
    _thread_state()["fenced"] = True


def _sim_wgmma_commit_group():
    """Close the group of this warpgroup's wgmmas issued since the last commit.

    PTX: ``wgmma.commit_group.sync.aligned``; sm_90a.  A no-op in the simulator.
    """


def _sim_wgmma_wait_group(n):
    """Wait until at most ``n`` committed wgmma groups are still running; then their accumulators are valid.

    PTX: ``wgmma.wait_group.sync.aligned n``; sm_90a.  ``n`` must be a
    compile-time constant (an immediate).  Follow it with
    :func:`wgmma_fence_operand` on the accumulators.  Simulator: the wgmma
    already ran; this only starts a new batch (the next wgmma needs a fence).
    """
    _thread_state()["fenced"] = False


def _sim_unfenced_chunks():
    """Per block: host addresses of the 16-byte shared chunks that ``cp.async`` wrote (landed) and the writing
    thread has not yet fenced with :func:`fence_proxy_async`; a wgmma reading one of them raises."""
    return _sim_block_state("_nbflash_unfenced_chunks", set)


def _sim_block_fenced():
    """Per block: ``[True]`` once any thread executed :func:`fence_proxy_async` (the check for ordinary stores)."""
    return _sim_block_state("_nbflash_proxy_fenced", lambda: [False])


def _sim_observe_landing(dst, start):
    chunk = dst.__array_interface__["data"][0] + (start & ~15)  # the 16-byte chunk (a 4-byte copy lands inside one)
    _thread_state()["landed"].append(chunk)
    unfenced = _sim_unfenced_chunks()
    with _sim_lock:
        unfenced.add(chunk)


I.SIM_LAND_OBSERVERS.append(_sim_observe_landing)


def _sim_fence_proxy_async():
    """Make this thread's generic-proxy writes to shared memory visible to the async proxy (the tensor cores).

    PTX: ``fence.proxy.async.shared::cta``; sm_90.  After writing a tile with
    ordinary stores or ``cp.async`` (and its wait), before the barrier that
    precedes the wgmma reading it — by the thread that wrote, whichever
    threads then issue the wgmma (in a warp-specialised kernel, a producer
    warpgroup writes and fences, the consumers issue).  Simulator: every
    ``cp.async`` chunk is tracked from its landing to its writer's fence, and a
    wgmma that reads a chunk still unfenced raises; for ordinary stores
    (untracked), a wgmma issued before any thread of the block fenced raises.
    """
    state = _thread_state()
    landed, state["landed"] = state["landed"], []
    unfenced, fenced = _sim_unfenced_chunks(), _sim_block_fenced()
    with _sim_lock:
        unfenced.difference_update(landed)
        fenced[0] = True


def _sim_wgmma_fence_operand(acc):
    """The accumulators, passed through an empty ``asm volatile`` so that no use of them moves above a wait.

    CUTLASS's ``warpgroup_fence_operand``; no instruction is emitted.  Call it
    on the result of a wgmma after :func:`wgmma_wait_group`.  The identity in
    the simulator.
    """
    return tuple(acc)


def _sim_wgmma_acc_zeros(n):
    """A tuple of N/2 float32 zeros: the accumulators of one ``m64nNk16`` tile (``n`` = N, a constant)."""
    return (np.float32(0),) * (n // 2)


def _sim_issue(n, acc, slot, tile):
    """One simulated wgmma of the calling thread: check the fences, publish ``slot`` (this thread's operands),
    let thread 0 of the warpgroup compute ``tile(slots)`` (128 × N/2 float32), return this thread's row."""
    if len(acc) != n // 2:
        raise TypeError(f"wgmma m64n{n}k16 takes {n // 2} accumulators, got {len(acc)}")
    state = _thread_state()
    if not state["fenced"]:
        raise RuntimeError("wgmma issued without a wgmma_fence() since the last wgmma_wait_group")
    if not _sim_block_fenced()[0]:
        raise RuntimeError("wgmma issued before any fence_proxy_async() in the block: shared-memory tiles written "
                           "with ordinary stores are not visible to the tensor cores without it")
    index, wg = _sim_warpgroup()
    wg.slots[index] = slot
    wg.barrier.wait()  # every thread has published its operands
    if index == 0:
        try:
            wg.result = tile(list(wg.slots))
        except Exception as exc:  # re-raised in every thread below
            wg.result = exc
    wg.barrier.wait()  # the result is ready
    result = wg.result
    wg.barrier.wait()  # every thread has read it before the next wgmma overwrites it
    if isinstance(result, Exception):
        raise result
    return tuple(result[index])


def _sim_accumulate(n, d, scale_d, accs):
    """D (64 × N, float64) plus, if ``scale_d``, the threads' old accumulators; as each thread's N/2 values."""
    idx = _acc_table(n)
    if scale_d:
        c = np.zeros((64, n))
        c[idx[..., 0], idx[..., 1]] = np.array(accs, dtype=np.float32)
        d = d + c
    return d[idx[..., 0], idx[..., 1]].astype(np.float32)


def _same_for_all(ops, key):
    """The operand ``key(op)`` that every thread of the warpgroup must have given alike."""
    first = key(ops[0])
    if any(key(op) != first for op in ops):
        raise ValueError("the threads of a warpgroup gave different wgmma descriptors or scale-d")
    return first


def _sim_wgmma(n, to_f32, trans_a, trans_b, desc_a, desc_b, acc, scale_d):
    slot = (int(desc_a), int(desc_b), bool(scale_d), tuple(np.float32(x) for x in acc))
    return _sim_issue(n, acc, slot, functools.partial(_sim_wgmma_tile, n, to_f32, trans_a, trans_b))


def _sim_wgmma_tile(n, to_f32, trans_a, trans_b, ops):
    """The whole warpgroup's D (128 × N/2 float32) from the 128 threads' operands."""
    desc_a, desc_b, scale_d = _same_for_all(ops, lambda op: op[:3])
    space = _sim_block_state("_nbflash_smem", _SimSharedSpace)
    k = np.arange(16)[None, :]
    a = to_f32(space.read_u16(smem_desc_address(desc_a, np.arange(64)[:, None], k, mn_major=trans_a)))
    a = a.astype(np.float64)
    b = to_f32(space.read_u16(smem_desc_address(desc_b, np.arange(n)[:, None], k, mn_major=trans_b)))
    b = b.astype(np.float64)
    d = a @ b.T  # products of f16/bf16 are exact; the sum is rounded once (the hardware's adder differs slightly)
    return _sim_accumulate(n, d, scale_d, [op[3] for op in ops])


def _a_reg_table():
    """(128, 4, 2, 2): (row, k) of the low and high half of A register r of every thread (RS form).

    Warp w of the warpgroup holds rows 16w..16w+15 exactly as one warp holds
    the A fragment of ``mma.m16n8k16`` (PTX ISA figure "WGMMA .m64nNk16
    register fragment layout for matrix A"): lane 4g + t, register r holds row
    g + 8·(r & 1), k = 8·(r >> 1) + 2t (low half) and + 1 (high half).
    """
    table = np.zeros((WARPGROUP, 4, 2, 2), dtype=np.int64)
    for thread in range(WARPGROUP):
        w, lane = divmod(thread, 32)
        g, t = divmod(lane, 4)
        for r in range(4):
            for half in range(2):
                table[thread, r, half] = (16 * w + g + 8 * (r & 1), 8 * (r >> 1) + 2 * t + half)
    return table


_A_REGS = _a_reg_table()


def _sim_wgmma_rs(n, to_f32, trans_b, a_regs, desc_b, acc, scale_d):
    slot = (int(desc_b), bool(scale_d), tuple(np.float32(x) for x in acc), tuple(int(np.uint32(x)) for x in a_regs))
    return _sim_issue(n, acc, slot, functools.partial(_sim_wgmma_rs_tile, n, to_f32, trans_b))


def _sim_wgmma_rs_tile(n, to_f32, trans_b, ops):
    """The whole warpgroup's D from the 128 threads' A registers and the shared B tile (RS form)."""
    desc_b, scale_d = _same_for_all(ops, lambda op: op[:2])
    words = np.array([op[3] for op in ops], dtype=np.uint32)  # (128, 4)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16)  # (128, 4, 2)
    a = np.zeros((64, 16))
    a[_A_REGS[..., 0], _A_REGS[..., 1]] = to_f32(halves).astype(np.float64)
    space = _sim_block_state("_nbflash_smem", _SimSharedSpace)
    k = np.arange(16)[None, :]
    b = to_f32(space.read_u16(smem_desc_address(desc_b, np.arange(n)[:, None], k, mn_major=trans_b)))
    return _sim_accumulate(n, a @ b.astype(np.float64).T, scale_d, [op[2] for op in ops])


def _make_sim_wgmma_rs(n, kind, trans_b):
    to_f32 = f16_bits_to_f32 if kind == "f16" else bf16_bits_to_f32

    def wgmma_rs(a0, a1, a2, a3, desc_b, acc, scale_d):
        return _sim_wgmma_rs(n, to_f32, bool(trans_b), (a0, a1, a2, a3), desc_b, acc, scale_d)

    major = "N-major (``imm-trans-b = 1``: 8 consecutive n of one k in 16 bytes)" if trans_b else "K-major"
    wgmma_rs.__name__ = f"wgmma_m64n{n}k16_rs_{kind}" + ("_tb" if trans_b else "")
    wgmma_rs.__doc__ = f"""D = A·B + D for a 64×{n} tile by one warpgroup, A (64×16) in registers; {kind} in, f32 out.

    PTX: ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{d0..d{n // 2 - 1}}}, {{a0, a1, a2, a3}},
    desc_b, p, 1, 1, {int(bool(trans_b))}`` with ``p = scale_d != 0``; sm_90a.

    ``a0..a3``: this thread's A fragment, four 32-bit registers of two 16-bit values, laid out per
    warp as the A fragment of ``mma.m16n8k16`` (warp w of the warpgroup: rows 16w..16w+15) — so the
    accumulators of an earlier wgmma, packed pairwise, are an A operand (FlashAttention's P·V);
    ``desc_b``: descriptor of B (16 × {n} as k × n), {major} in shared memory;
    ``acc``, ``scale_d``: as for the shared-memory form.

    Simulator: the threads exchange registers and descriptors; B read at the addresses
    :func:`smem_desc_address` gives (``mn_major={bool(trans_b)}``); products exact, the sum in float64.
    """
    return wgmma_rs


def _sim_acc_from_array(arr, n):
    """The first N/2 values of the float32 array ``arr`` (row-major) as an accumulator tuple for ``m64nNk16``.

    The way back from a register array (``cuda.local.array``, indexed by
    constants, so that it stays in registers) into wgmma's operand; no
    instruction beyond register moves.  ``n`` must be a compile-time constant.
    """
    flat = arr.reshape(-1)
    return tuple(np.float32(flat[i]) for i in range(n // 2))


def _sim_acc_to_array(acc, arr):
    """Store the accumulator tuple ``acc`` into the float32 array ``arr`` (row-major, at least as long).

    The inverse of :func:`acc_from_array`: one store per value at a constant
    index, so that the array stays in registers whatever loop follows.
    """
    flat = arr.reshape(-1)
    for i, x in enumerate(acc):
        flat[i] = x


class _SimNamedBarrier:
    def __init__(self):
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0


def _sim_named_barrier(barrier_id, count, wait):
    bars = _sim_block_state("_nbflash_named_barriers", dict)
    with _sim_lock:
        bar = bars.get(barrier_id)
        if bar is None:
            bar = bars[barrier_id] = _SimNamedBarrier()
    with bar.cond:
        generation = bar.generation
        bar.arrived += 1
        if bar.arrived == count:  # the last of ``count`` threads: release this generation
            bar.arrived = 0
            bar.generation += 1
            bar.cond.notify_all()
        elif wait:
            while bar.generation == generation:
                bar.cond.wait()


def _sim_named_barrier_sync(barrier_id, count):
    """Wait at named barrier ``barrier_id`` (1..15; 0 is ``syncthreads``'s) until ``count`` threads reached it.

    PTX: ``bar.sync id, count`` (``barrier.sync.aligned``); any compute
    capability.  ``count`` is a multiple of 32 (whole warps); the threads that
    reach the barrier with :func:`named_barrier_arrive` count without
    waiting.  A subset of the block (two warpgroups, say) can synchronise
    this way without stopping the rest.  Simulator: a counting barrier per
    block and id.
    """
    _sim_named_barrier(int(barrier_id), int(count), True)


def _sim_named_barrier_arrive(barrier_id, count):
    """Count this thread at named barrier ``barrier_id`` (of ``count`` threads) and go on without waiting.

    PTX: ``bar.arrive id, count``.  The producer's half of a handshake: the
    threads that must wait call :func:`named_barrier_sync` with the same id and
    count.  Simulator: as :func:`named_barrier_sync`, without the wait.
    """
    _sim_named_barrier(int(barrier_id), int(count), False)


def _ss_name(n, kind, trans_a, trans_b):
    return f"wgmma_m64n{n}k16_{kind}" + ("_ta" if trans_a else "") + ("_tb" if trans_b else "")


def _major(trans):
    return "MN-major (``imm-trans = 1``: 8 consecutive rows of one k in 16 bytes)" if trans else "K-major"


def _make_sim_wgmma(n, kind, trans_a=False, trans_b=False):
    to_f32 = f16_bits_to_f32 if kind == "f16" else bf16_bits_to_f32

    def wgmma(desc_a, desc_b, acc, scale_d):
        return _sim_wgmma(n, to_f32, trans_a, trans_b, desc_a, desc_b, acc, scale_d)

    wgmma.__name__ = _ss_name(n, kind, trans_a, trans_b)
    wgmma.__doc__ = f"""D = A·Bᵀ + D for a 64×{n} tile by one warpgroup (128 threads); {kind} inputs, f32 accumulators.

    PTX: ``wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{d0..d{n // 2 - 1}}}, desc_a, desc_b,
    p, 1, 1, {int(trans_a)}, {int(trans_b)}`` with ``p = scale_d != 0``; sm_90a.  Every thread of the warpgroup
    must call it with the same descriptors and scale_d.

    ``desc_a``: descriptor (:data:`d_make_smem_desc`) of A, 64×16, {_major(trans_a)} in shared memory;
    ``desc_b``: of B, {n}×16, {_major(trans_b)} (a row of B is a column of the product: D = A·Bᵀ, like Q·Kᵀ);
    ``acc``: this thread's {n // 2} float32 accumulators (a tuple; :func:`wgmma_acc_zeros` to start),
    laid out as :func:`acc_frag_index` says; ``scale_d``: 0 to ignore ``acc`` (D = A·Bᵀ).
    Returns the new accumulators — valid only after :func:`wgmma_commit_group`,
    :func:`wgmma_wait_group` and :func:`wgmma_fence_operand`.

    Simulator: the threads exchange operands; A and B are read from the simulated shared memory at
    the addresses :func:`smem_desc_address` gives (``mn_major={bool(trans_a)}`` for A, ``{bool(trans_b)}`` for B);
    products exact, the sum in float64 rounded once.
    """
    return wgmma


# ----------------------------------------------------------------------------
# GPU implementations: inline PTX
# ----------------------------------------------------------------------------


@intrinsic
def _gpu_smem_address(typingctx, smem, offset):
    if not (_is_flat_array(smem) and _is_int(offset)):
        return None
    sig = types.uint32(smem, offset)

    def codegen(context, builder, sig, args):
        return _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])

    return sig, codegen


def _make_gpu_statement(name, ptx):
    """An intrinsic of no arguments that emits ``ptx`` (kept in place, memory clobbered, convergent)."""

    def statement(typingctx):
        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], ptx, "~{memory}", [], side_effect=True, warp_wide=True)
            return context.get_dummy_value()

        return types.void(), codegen

    statement.__name__ = name
    return intrinsic(statement)


def _sim_bulk_reduce_add_f32(address, smem, offset, nbytes):
    """Start ``address[0 : nbytes / 4] += smem[offset : offset + nbytes / 4]`` (float32, each element atomically).

    PTX: ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [address], [smem + offset], nbytes``;
    sm_90.  ``address`` comes from :func:`nbflash.intrinsics.global_address`
    plus byte offsets; ``smem`` is a float32 shared array and ``offset`` an
    element of it; both 16-byte aligned, ``nbytes`` a positive multiple of 16.
    Asynchronous: the engine reads the source some time before this thread's
    :func:`bulk_wait_group_read` covering it returns, and the sum lands before
    :func:`bulk_wait_group`.  Simulator: checked at issue, performed at that
    wait (the latest moment the hardware may read), so a source rewritten
    before the wait, or a reduction never waited for, gives a wrong sum; a
    reduction issued before any thread of the block executed
    :func:`fence_proxy_async` raises.
    """
    nbytes = int(nbytes)
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"a bulk reduction moves a positive multiple of 16 bytes, got {nbytes}")
    if smem.dtype != np.float32:
        raise TypeError(f"the bulk reduction's source must be a float32 shared array, got {smem.dtype}")
    if (smem.__array_interface__["data"][0] + 4 * int(offset)) % 16:
        raise ValueError(f"the bulk reduction's shared source (element {offset}) is not 16-byte aligned")
    if not _sim_block_fenced()[0]:
        raise RuntimeError("bulk reduction issued before any fence_proxy_async() in the block: the shared source, "
                           "written by ordinary stores, is not yet visible to the async proxy")
    address.elements(nbytes // 4, 16)  # bounds and alignment, now
    _thread_state()["bulk_pending"].append((address, smem, int(offset), nbytes // 4))


def _sim_bulk_reduce_add_f32_where(issue, address, smem, offset, nbytes):
    """:func:`bulk_reduce_add_f32`, started only by the threads where ``issue`` is true (e.g. one lane of a warp).

    PTX: the same instruction under a predicate (``setp.ne.u32 p, issue, 0; @p cp.reduce.async.bulk …``)
    instead of a branch around it: every thread executes the code, so no control flow splits the warp.
    (Between a wgmma's issue and its wait, such a branch made ptxas serialise every wgmma of the kernel, its
    C7514.)  The other threads' arguments are not checked or used.
    """
    if issue:
        _sim_bulk_reduce_add_f32(address, smem, offset, nbytes)


def _sim_bulk_commit_group():
    """Close this thread's bulk reductions issued since the last commit into a group.

    PTX: ``cp.async.bulk.commit_group``; sm_90.  (An empty group is allowed.)
    """
    state = _thread_state()
    state["bulk_groups"].append(state["bulk_pending"])
    state["bulk_pending"] = []


def _sim_bulk_wait(n):
    groups = _thread_state()["bulk_groups"]
    while len(groups) > n:
        for address, smem, offset, count in groups.pop(0):
            I._sim_red_add(address, [smem[offset + e] for e in range(count)], 16)


def _sim_bulk_wait_group_read(n):
    """Wait until at most ``n`` of this thread's committed bulk groups may still read their shared sources.

    PTX: ``cp.async.bulk.wait_group.read n``; sm_90; ``n`` an immediate (a
    compile-time constant).  After it, the sources of the older groups may be
    rewritten.  Simulator: those groups' reductions are performed now.
    """
    _sim_bulk_wait(n)


def _sim_bulk_wait_group(n):
    """Wait until at most ``n`` of this thread's committed bulk groups are still running (their sums not landed).

    PTX: ``cp.async.bulk.wait_group n``; sm_90; ``n`` an immediate.  ``n = 0``
    before the thread exits: no reduction of it is left in flight.
    """
    _sim_bulk_wait(n)


def _sim_setmaxnreg(count):
    """Set this warpgroup's registers per thread to ``count`` (PTX ``setmaxnreg.{inc,dec}.sync.aligned.u32``; sm_90a).

    ``count`` is an immediate: a compile-time constant, a multiple of 8 from 24
    to 256; all four warps of the warpgroup execute it together.  ``inc``
    waits until the block's pool has the registers, ``dec`` returns them.
    Simulator: the count is checked, registers are not modelled.
    """
    if not (24 <= count <= 256 and count % 8 == 0):
        raise ValueError(f"setmaxnreg takes a multiple of 8 from 24 to 256, got {count}")


def _make_gpu_setmaxnreg(op):
    def setmaxnreg(typingctx, count):
        if not isinstance(count, types.IntegerLiteral):
            return None  # an immediate: count must be a compile-time constant
        regs = int(count.literal_value)
        if not (24 <= regs <= 256 and regs % 8 == 0):
            raise ValueError(f"setmaxnreg takes a multiple of 8 from 24 to 256, got {regs}")

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], f"setmaxnreg.{op}.sync.aligned.u32 {regs};", "~{memory}", [],
                 side_effect=True, warp_wide=True)
            return context.get_dummy_value()

        return types.void(count), codegen

    setmaxnreg.__name__ = f"setmaxnreg_{op}"
    return intrinsic(setmaxnreg)


@intrinsic
def _gpu_bulk_reduce_add_f32(typingctx, address, smem, offset, nbytes):
    if not (_is_int(address, offset, nbytes) and isinstance(smem, types.Array) and smem.dtype == types.float32):
        return None
    sig = types.void(address, smem, offset, nbytes)

    def codegen(context, builder, sig, args):
        dst = context.cast(builder, args[0], sig.args[0], types.int64)
        src = _shared_address(context, builder, sig.args[1], args[1], sig.args[2], args[2])
        size = context.cast(builder, args[3], sig.args[3], types.uint32)
        _asm(builder, ir.VoidType(), [_I64, _I32, _I32],
             "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;", "l,r,r,~{memory}",
             [dst, src, size], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_bulk_reduce_add_f32_where(typingctx, issue, address, smem, offset, nbytes):
    if not (isinstance(issue, (types.Boolean, types.Integer)) and _is_int(address, offset, nbytes)
            and isinstance(smem, types.Array) and smem.dtype == types.float32):
        return None
    sig = types.void(issue, address, smem, offset, nbytes)

    def codegen(context, builder, sig, args):
        flag = context.cast(builder, args[0], sig.args[0], types.uint32)
        dst = context.cast(builder, args[1], sig.args[1], types.int64)
        src = _shared_address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        size = context.cast(builder, args[4], sig.args[4], types.uint32)
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32, _I32],
             "{ .reg .pred p; setp.ne.u32 p, $0, 0; "
             "@p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$1], [$2], $3; }",
             "r,l,r,r,~{memory}", [flag, dst, src, size], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


def _make_gpu_wait(name, ptx, warp_wide=False):
    """An intrinsic ``wait(n)`` emitting ``ptx n`` (a wait on groups: ``n`` an immediate, a compile-time
    constant), kept in place with memory clobbered; ``warp_wide`` for the ``.sync.aligned`` forms."""

    def wait(typingctx, n):
        if not isinstance(n, types.IntegerLiteral):
            return None  # an immediate: n must be a compile-time constant
        groups = int(n.literal_value)

        def codegen(context, builder, sig, args):
            _asm(builder, ir.VoidType(), [], f"{ptx} {groups};", "~{memory}", [], side_effect=True,
                 warp_wide=warp_wide)
            return context.get_dummy_value()

        return types.void(n), codegen

    wait.__name__ = name
    return intrinsic(wait)


def _is_acc(acc):
    return isinstance(acc, types.UniTuple) and isinstance(acc.dtype, (types.Float, types.Integer))


@intrinsic
def _gpu_wgmma_fence_operand(typingctx, acc):
    if not _is_acc(acc):
        return None
    count = acc.count
    sig = types.UniTuple(types.float32, count)(acc)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, builder.extract_value(args[0], i), sig.args[0].dtype, types.float32)
                for i in range(count)]
        constraints = ",".join(["=f"] * count + [str(i) for i in range(count)]) + ",~{memory}"
        res = _asm(builder, ir.LiteralStructType([_F32] * count), [_F32] * count, "", constraints, vals,
                   side_effect=True)
        outs = [builder.extract_value(res, i) for i in range(count)] if count > 1 else [res]
        return context.make_tuple(builder, sig.return_type, outs)

    return sig, codegen


@intrinsic
def _gpu_wgmma_acc_zeros(typingctx, n):
    if not isinstance(n, types.IntegerLiteral) or int(n.literal_value) not in WGMMA_N:
        return None
    count = int(n.literal_value) // 2
    sig = types.UniTuple(types.float32, count)(n)

    def codegen(context, builder, sig, args):
        return context.make_tuple(builder, sig.return_type, [ir.Constant(_F32, 0.0)] * count)

    return sig, codegen


def _make_gpu_wgmma(n, kind, trans_a=False, trans_b=False):
    count = n // 2
    regs = ", ".join(f"${i}" for i in range(count))
    a, b, s = 2 * count, 2 * count + 1, 2 * count + 2  # operand numbers: outputs, tied inputs, then these
    ptx = ("{ .reg .pred p; "
           f"setp.ne.b32 p, ${s}, 0; "
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "
           f"{{{regs}}}, ${a}, ${b}, p, 1, 1, {int(bool(trans_a))}, {int(bool(trans_b))}; }}")
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)] + ["l", "l", "r"]) + ",~{memory}"

    def wgmma(typingctx, desc_a, desc_b, acc, scale_d):
        if not (_is_int(desc_a, desc_b) and _is_acc(acc) and acc.count == count
                and isinstance(scale_d, (types.Integer, types.Boolean))):
            return None
        sig = types.UniTuple(types.float32, count)(desc_a, desc_b, acc, scale_d)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, builder.extract_value(args[2], i), sig.args[2].dtype, types.float32)
                    for i in range(count)]
            da = context.cast(builder, args[0], sig.args[0], types.uint64)
            db = context.cast(builder, args[1], sig.args[1], types.uint64)
            sd = context.cast(builder, args[3], sig.args[3], types.uint32)
            # side_effect + memory clobber: the tensor cores read shared memory the compiler cannot see,
            # so the statement must stay after the barrier and fences that precede it.
            res = _asm(builder, ir.LiteralStructType([_F32] * count), [_F32] * count + [_I64, _I64, _I32], ptx,
                       constraints, vals + [da, db, sd], side_effect=True, warp_wide=True)
            outs = [builder.extract_value(res, i) for i in range(count)] if count > 1 else [res]
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen

    wgmma.__name__ = _ss_name(n, kind, trans_a, trans_b)
    return intrinsic(wgmma)


def _make_gpu_wgmma_rs(n, kind, trans_b):
    count = n // 2
    regs = ", ".join(f"${i}" for i in range(count))
    a = 2 * count  # operand numbers: outputs, tied inputs, then the four A registers, desc_b, scale_d
    b, s = a + 4, a + 5
    ptx = ("{ .reg .pred p; "
           f"setp.ne.b32 p, ${s}, 0; "
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} "
           f"{{{regs}}}, {{${a}, ${a + 1}, ${a + 2}, ${a + 3}}}, ${b}, p, 1, 1, {int(bool(trans_b))}; }}")
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)] + ["r"] * 4 + ["l", "r"]) + ",~{memory}"

    def wgmma_rs(typingctx, a0, a1, a2, a3, desc_b, acc, scale_d):
        if not (_is_int(a0, a1, a2, a3, desc_b) and _is_acc(acc) and acc.count == count
                and isinstance(scale_d, (types.Integer, types.Boolean))):
            return None
        sig = types.UniTuple(types.float32, count)(a0, a1, a2, a3, desc_b, acc, scale_d)

        def codegen(context, builder, sig, args):
            vals = [context.cast(builder, builder.extract_value(args[5], i), sig.args[5].dtype, types.float32)
                    for i in range(count)]
            regs_a = [context.cast(builder, args[i], sig.args[i], types.uint32) for i in range(4)]
            db = context.cast(builder, args[4], sig.args[4], types.uint64)
            sd = context.cast(builder, args[6], sig.args[6], types.uint32)
            res = _asm(builder, ir.LiteralStructType([_F32] * count), [_F32] * count + [_I32] * 4 + [_I64, _I32],
                       ptx, constraints, vals + regs_a + [db, sd], side_effect=True, warp_wide=True)
            outs = [builder.extract_value(res, i) for i in range(count)] if count > 1 else [res]
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen

    wgmma_rs.__name__ = f"wgmma_m64n{n}k16_rs_{kind}" + ("_tb" if trans_b else "")
    return intrinsic(wgmma_rs)


@intrinsic
def _gpu_acc_from_array(typingctx, arr, n):
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"
            and isinstance(n, types.IntegerLiteral) and int(n.literal_value) in WGMMA_N):
        return None
    count = int(n.literal_value) // 2
    sig = types.UniTuple(types.float32, count)(arr, n)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        outs = [builder.load(builder.gep(data, [ir.Constant(_I64, i)])) for i in range(count)]
        return context.make_tuple(builder, sig.return_type, outs)

    return sig, codegen


@intrinsic
def _gpu_acc_to_array(typingctx, acc, arr):
    if not (_is_acc(acc) and isinstance(arr, types.Array) and arr.dtype == types.float32 and arr.layout == "C"):
        return None
    count = acc.count

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        for i in range(count):
            x = context.cast(builder, builder.extract_value(args[0], i), sig.args[0].dtype, types.float32)
            builder.store(x, builder.gep(data, [ir.Constant(_I64, i)]))
        return context.get_dummy_value()

    return types.void(acc, arr), codegen


def _make_gpu_named_barrier(op):
    def barrier(typingctx, barrier_id, count):
        if not _is_int(barrier_id, count):
            return None

        def codegen(context, builder, sig, args):
            regs = [context.cast(builder, a, t, types.uint32) for a, t in zip(args, sig.args, strict=True)]
            # memory clobber: shared-memory accesses must not move across the barrier
            _asm(builder, ir.VoidType(), [_I32, _I32], f"bar.{op} $0, $1;", "r,r,~{memory}", regs,
                 side_effect=True, warp_wide=True)
            return context.get_dummy_value()

        return types.void(barrier_id, count), codegen

    barrier.__name__ = f"named_barrier_{op}"
    return intrinsic(barrier)


# ----------------------------------------------------------------------------
# The public names: one implementation or the other
# ----------------------------------------------------------------------------


smem_address = _public(_sim_smem_address, lambda: _gpu_smem_address)
wgmma_fence = _public(_sim_wgmma_fence, lambda: _make_gpu_statement("wgmma_fence", "wgmma.fence.sync.aligned;"))
wgmma_commit_group = _public(_sim_wgmma_commit_group,
                             lambda: _make_gpu_statement("wgmma_commit_group", "wgmma.commit_group.sync.aligned;"))
wgmma_wait_group = _public(_sim_wgmma_wait_group,
                           lambda: _make_gpu_wait("wgmma_wait_group", "wgmma.wait_group.sync.aligned", warp_wide=True))
fence_proxy_async = _public(_sim_fence_proxy_async,
                            lambda: _make_gpu_statement("fence_proxy_async", "fence.proxy.async.shared::cta;"))
wgmma_fence_operand = _public(_sim_wgmma_fence_operand, lambda: _gpu_wgmma_fence_operand)
setmaxnreg_inc = _public(_sim_setmaxnreg, lambda: _make_gpu_setmaxnreg("inc"))
setmaxnreg_dec = _public(_sim_setmaxnreg, lambda: _make_gpu_setmaxnreg("dec"))
wgmma_acc_zeros = _public(_sim_wgmma_acc_zeros, lambda: _gpu_wgmma_acc_zeros)

_WGMMA = {(n, kind, ta, tb): _public(_make_sim_wgmma(n, kind, ta, tb),
                                     functools.partial(_make_gpu_wgmma, n, kind, ta, tb))
          for n in WGMMA_N for kind in ("f16", "bf16") for ta in (False, True) for tb in (False, True)}

wgmma_m64n8k16_f16 = _WGMMA[8, "f16", False, False]
wgmma_m64n8k16_bf16 = _WGMMA[8, "bf16", False, False]
wgmma_m64n16k16_f16 = _WGMMA[16, "f16", False, False]
wgmma_m64n16k16_bf16 = _WGMMA[16, "bf16", False, False]
wgmma_m64n32k16_f16 = _WGMMA[32, "f16", False, False]
wgmma_m64n32k16_bf16 = _WGMMA[32, "bf16", False, False]
wgmma_m64n64k16_f16 = _WGMMA[64, "f16", False, False]
wgmma_m64n64k16_bf16 = _WGMMA[64, "bf16", False, False]
wgmma_m64n128k16_f16 = _WGMMA[128, "f16", False, False]
wgmma_m64n128k16_bf16 = _WGMMA[128, "bf16", False, False]


_WGMMA_RS = {(n, kind, tb): _public(_make_sim_wgmma_rs(n, kind, tb), functools.partial(_make_gpu_wgmma_rs, n, kind, tb))
              for n in WGMMA_N for kind in ("f16", "bf16") for tb in (False, True)}
acc_from_array = _public(_sim_acc_from_array, lambda: _gpu_acc_from_array)
named_barrier_sync = _public(_sim_named_barrier_sync, lambda: _make_gpu_named_barrier("sync"))
named_barrier_arrive = _public(_sim_named_barrier_arrive, lambda: _make_gpu_named_barrier("arrive"))
acc_to_array = _public(_sim_acc_to_array, lambda: _gpu_acc_to_array)
bulk_reduce_add_f32 = _public(_sim_bulk_reduce_add_f32, lambda: _gpu_bulk_reduce_add_f32)
bulk_reduce_add_f32_where = _public(_sim_bulk_reduce_add_f32_where, lambda: _gpu_bulk_reduce_add_f32_where)
bulk_commit_group = _public(_sim_bulk_commit_group,
                            lambda: _make_gpu_statement("bulk_commit_group", "cp.async.bulk.commit_group;"))
bulk_wait_group_read = _public(_sim_bulk_wait_group_read,
                               lambda: _make_gpu_wait("bulk_wait_group_read", "cp.async.bulk.wait_group.read"))
bulk_wait_group = _public(_sim_bulk_wait_group,
                          lambda: _make_gpu_wait("bulk_wait_group", "cp.async.bulk.wait_group"))


def wgmma(n, kind, trans_a=False, trans_b=False):
    """The ``wgmma_m64n{n}k16_{kind}`` function (``kind``: ``"f16"`` or ``"bf16"``), for kernel factories.

    ``trans_a`` / ``trans_b``: that operand is MN-major in shared memory (``_ta`` / ``_tb``; 16-bit inputs
    only, which these are): a tile stored as rows of k, such as a dSᵀ tile ``[key][query]`` read as the A of
    dS·K.
    """
    return _WGMMA[n, kind, bool(trans_a), bool(trans_b)]


def wgmma_rs(n, kind, trans_b=False):
    """The register-A form ``wgmma_m64n{n}k16_rs_{kind}`` (``_tb``: B N-major), for kernel factories.

    Called as ``acc = f(a0, a1, a2, a3, desc_b, acc, scale_d)``.
    """
    return _WGMMA_RS[n, kind, bool(trans_b)]
