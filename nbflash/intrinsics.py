"""Tensor-core building blocks: ``mma.sync``, ``ldmatrix``, ``cp.async``, packed conversions — and the
vector accesses to global memory (16-byte loads and stores, float32 reductions) of the backward, and a
32-bit unsigned ``divmod`` (a 64-bit division by a run-time value is a subroutine call in PTX).

Numba has no API for the warp-level matrix instructions, so each one here is an
``@intrinsic`` whose code generator emits the PTX instruction as inline
assembly (``llvmlite.ir.InlineAsm``) and hands its results back as a Numba
tuple.  Kernels call them like any device function::

    d0, d1, d2, d3 = mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

Numba's CUDA simulator cannot run inline PTX, so every function also has a
Python implementation with the hardware's per-lane semantics, chosen when
:data:`nbflash._device.SIMULATOR` is true.  The warp-wide ones (``mma``,
``ldmatrix``) exchange the 32 lanes' operands through the same per-warp
barrier and slots as the simulated shuffles in :mod:`nbflash._device`.

Fragment layouts follow the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
floating point type"; "ldmatrix").  They are written once, as the ``*_frag_index``
and ``ldmatrix_x4_*_address`` helpers below (host functions, plus ``d_`` device
versions for kernels), and the simulator builds its matrices from those same
helpers — so a kernel that indexes fragments through them and passes the
simulator tests also agrees with the layout of the hardware.  Notation::

    lane = laneid (0..31)     g = lane >> 2 ("groupID")     t = lane % 4 ("threadID_in_group")

A 32-bit fragment register holds two 16-bit elements; "half 0" is the low 16
bits and holds the element with the smaller PTX index (a0 of the pair a0, a1).

Minimum compute capability: ``mma.m16n8k16`` (f16, bf16), ``cp.async`` and the
``cvt`` packs need sm_80; ``ldmatrix`` sm_75; ``ex2.approx``, its FMA-unit
stand-in ``ex2_poly``, ``red.global.add.f32``, the 16-byte global loads and
stores (``ld/st.global.v4``, for the backward's memory-bound steps 0 and 2')
and the 16-byte shared loads (``ld.shared.v4``, the forward's epilogue) any;
the vector reductions ``red.global.add.v2.f32`` / ``.v4.f32`` sm_90 (PTX ISA
8.1; ``red_add_f32x4`` falls back to four scalar ``red`` on older GPUs).
"""

from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types

from ._device import SIMULATOR, _sim_warp, cgutils, device_function, intrinsic, target_cc

__all__ = [
    "a_frag_index",
    "b_frag_index",
    "c_frag_index",
    "cp_async_16",
    "cp_async_16_at",
    "cp_async_4",
    "cp_async_commit",
    "cp_async_wait",
    "cp_async_wait_all",
    "d_a_frag_index",
    "divmod_u32",
    "d_b_frag_index",
    "d_c_frag_index",
    "d_ldmatrix_x4_a_address",
    "d_ldmatrix_x4_bt_address",
    "ex2_approx",
    "ex2_poly",
    "f32_after",
    "global_address",
    "ld_global_v4_b32",
    "ld_global_v4_f32",
    "ld_shared_v4_b32",
    "ldmatrix_x4",
    "ldmatrix_x4_a_address",
    "ldmatrix_x4_bt_address",
    "ldmatrix_x4_trans",
    "mma_m16n8k16_bf16",
    "mma_m16n8k16_f16",
    "pinned_u32",
    "pack_bf16x2",
    "pack_f16x2",
    "red_add_f32",
    "red_add_f32x2",
    "red_add_f32x4",
    "st_global_b32",
    "st_global_v4_b32",
    "unpack_bf16x2",
    "unpack_f16x2",
]


# ----------------------------------------------------------------------------
# Fragment layouts of mma.m16n8k16 (.f16/.bf16 inputs, .f32 accumulators)
# ----------------------------------------------------------------------------


def _a_frag_index(lane, reg, half):
    """(row, col) in the 16×16 A tile of half ``half`` of A-register ``reg`` held by ``lane``.

    PTX: element a_i (i = 2·reg + half) sits at row g (+8 for a2, a3, a6, a7)
    and column 2t + (i & 1) (+8 for a4..a7)::

                 k: 0,1     2,3     4,5     6,7    |  8,9    10,11   12,13   14,15
        row  0    T0 r0   T1 r0   T2 r0   T3 r0    |  T0 r2   T1 r2   T2 r2   T3 r2
        row  1    T4 r0   T5 r0   T6 r0   T7 r0    |  T4 r2   ...
        ...
        row  7   T28 r0  T29 r0  T30 r0  T31 r0    | T28 r2   ...             T31 r2
        row  8    T0 r1   T1 r1   T2 r1   T3 r1    |  T0 r3   ...
        ...
        row 15   T28 r1  T29 r1  T30 r1  T31 r1    | T28 r3   ...             T31 r3

    ("T5 r2": lane 5, register 2, whose two halves are the two columns.)
    """
    g = lane >> 2
    t = lane & 3
    return g + 8 * (reg & 1), 2 * t + half + 8 * (reg >> 1)


def _b_frag_index(lane, reg, half):
    """(k, n) in the 16×8 B tile of half ``half`` of B-register ``reg`` held by ``lane``.

    PTX: element b_i (i = 2·reg + half) sits at row (k) 2t + (i & 1) (+8 for
    b2, b3) and column (n) g::

                  n: 0       1       2     ...     7
        k  0,1     T0 r0   T4 r0   T8 r0   ...   T28 r0
        k  2,3     T1 r0   T5 r0   T9 r0   ...   T29 r0
        k  4,5     T2 r0   T6 r0  T10 r0   ...   T30 r0
        k  6,7     T3 r0   T7 r0  T11 r0   ...   T31 r0
        k  8,9     T0 r1   T4 r1   ...           T28 r1
        ...
        k 14,15    T3 r1   T7 r1   ...           T31 r1

    A register holds two consecutive k of one column n: B is "col" (k-major)
    in ``mma ... .row.col``, i.e. a row of Bᵀ — a row of K for S = Q Kᵀ.
    """
    g = lane >> 2
    t = lane & 3
    return 2 * t + half + 8 * reg, g


def _c_frag_index(lane, i):
    """(row, col) in the 16×8 C/D tile of accumulator ``i`` (0..3) held by ``lane``.

    PTX: c_i sits at row g (+8 for c2, c3) and column 2t + (i & 1)::

                  col: 0,1       2,3       4,5       6,7
        row  0      T0 c0,c1  T1 c0,c1  T2 c0,c1  T3 c0,c1
        row  1      T4 c0,c1  ...
        ...
        row  7     T28 c0,c1  ...                 T31 c0,c1
        row  8      T0 c2,c3  T1 c2,c3  ...
        ...
        row 15     T28 c2,c3  ...                 T31 c2,c3

    So a row's 8 values live in the 4 lanes 4g..4g+3 (a "quad"): a row max or
    sum is two ``shfl.bfly`` steps (lane masks 1 and 2).
    """
    g = lane >> 2
    t = lane & 3
    return g + 8 * (i >> 1), 2 * t + (i & 1)


# ----------------------------------------------------------------------------
# Which row address each lane gives ldmatrix.x4 for a 16×16 tile
# ----------------------------------------------------------------------------


def _ldmatrix_x4_a_address(lane):
    """(row, col) of the 8-element row segment whose address ``lane`` passes to ``ldmatrix.x4``.

    For a row-major 16×16 tile X: matrix j = lane >> 3 is the 8×8 block
    ``X[8(j & 1) : +8, 8(j >> 1) : +8]``, so register j comes back as::

        r0 = X[ 0: 8, 0: 8]   r1 = X[8:16, 0: 8]   r2 = X[ 0: 8, 8:16]   r3 = X[8:16, 8:16]

    * ``ldmatrix_x4`` of a Q or P tile (rows m, columns k) gives exactly the
      four A registers of ``mma.m16n8k16`` (see :func:`a_frag_index`).
    * ``ldmatrix_x4_trans`` of a V tile (rows k, columns n) gives B registers
      for two 8-column n-tiles: (r0, r1) for n 0..7 and (r2, r3) for n 8..15.
    """
    return (lane & 7) + 8 * ((lane >> 3) & 1), 8 * (lane >> 4)


def _ldmatrix_x4_bt_address(lane):
    """(row, col) whose address ``lane`` passes to ``ldmatrix_x4`` for B stored as Bᵀ (n-major).

    For a row-major 16×16 tile Y = Bᵀ (rows n, columns k — a K tile for
    S = Q Kᵀ): matrix j is ``Y[8(j >> 1) : +8, 8(j & 1) : +8]``, so::

        r0 = Y[0: 8, 0: 8]   r1 = Y[0: 8, 8:16]   r2 = Y[8:16, 0: 8]   r3 = Y[8:16, 8:16]

    and (r0, r1) are the B registers for keys n 0..7, (r2, r3) for n 8..15.
    """
    return (lane & 7) + 8 * (lane >> 4), 8 * ((lane >> 3) & 1)


# Host versions (plain Python) ...
a_frag_index = _a_frag_index
b_frag_index = _b_frag_index
c_frag_index = _c_frag_index
ldmatrix_x4_a_address = _ldmatrix_x4_a_address
ldmatrix_x4_bt_address = _ldmatrix_x4_bt_address

# ... and the same source compiled for kernels.
d_a_frag_index = device_function(_a_frag_index)
d_b_frag_index = device_function(_b_frag_index)
d_c_frag_index = device_function(_c_frag_index)
d_ldmatrix_x4_a_address = device_function(_ldmatrix_x4_a_address)
d_ldmatrix_x4_bt_address = device_function(_ldmatrix_x4_bt_address)


def _layout_tables():
    """Index arrays of every fragment element of the warp, built from the helpers above."""
    lanes = range(32)
    a = np.array([[[_a_frag_index(ln, r, h) for h in range(2)] for r in range(4)] for ln in lanes])  # (32,4,2,2)
    b = np.array([[[_b_frag_index(ln, r, h) for h in range(2)] for r in range(2)] for ln in lanes])  # (32,2,2,2)
    c = np.array([[_c_frag_index(ln, i) for i in range(4)] for ln in lanes])  # (32,4,2)
    return a, b, c


_A_IDX, _B_IDX, _C_IDX = _layout_tables()


# ----------------------------------------------------------------------------
# Bit conversions shared by the simulator implementations and the tests
# ----------------------------------------------------------------------------


def f32_to_f16_bits(x) -> np.ndarray:
    """float32 → float16 bits, round to nearest even (NumPy's cast, as ``cvt.rn.f16.f32``)."""
    with np.errstate(over="ignore"):  # overflow to ±inf is the rounding rule, not an error
        return np.asarray(x, dtype=np.float32).astype(np.float16).view(np.uint16)


def f32_to_bf16_bits(x) -> np.ndarray:
    """float32 → bfloat16 bits, round to nearest even; NaN becomes the canonical 0x7FFF."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(x, dtype=np.float32)), np.uint16(0x7FFF), rounded)


def f16_bits_to_f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


def bf16_bits_to_f32(bits) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------
# Simulator implementations
# ----------------------------------------------------------------------------


def _sim_exchange(value):
    """Publish this lane's ``value``; return the 32 lanes' values (a warp-wide, synchronising call)."""
    lane, warp = _sim_warp()
    warp.slots[lane] = value
    warp.barrier.wait()  # every lane has published
    values = list(warp.slots)
    warp.barrier.wait()  # every lane has read before any slot is reused
    return lane, values


def _sim_mma(to_f32, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    lane, ops = _sim_exchange((a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
    regs = np.array([op[:6] for op in ops], dtype=np.uint32)  # (32, 6): a0..a3, b0, b1
    halves = np.stack([regs & 0xFFFF, regs >> 16], axis=-1).astype(np.uint16)  # (32, 6, 2)
    vals = to_f32(halves).astype(np.float64)
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    A[_A_IDX[..., 0], _A_IDX[..., 1]] = vals[:, :4]
    B[_B_IDX[..., 0], _B_IDX[..., 1]] = vals[:, 4:]
    C[_C_IDX[..., 0], _C_IDX[..., 1]] = np.array([op[6:] for op in ops], dtype=np.float32)
    # Products of two f16 (or bf16) values are exact; the sum is taken in float64
    # and rounded once (the hardware's adder tree rounds differently in the last bits).
    rows, cols = _C_IDX[lane, :, 0], _C_IDX[lane, :, 1]
    d = (A[rows] * B[:, cols].T).sum(axis=1) + C[rows, cols]
    return tuple(np.float32(x) for x in d)


def _sim_mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A·B + C on the tensor cores, one 16×16×8 tile per warp (float16 inputs, float32 accumulate).

    PTX: ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}``;
    sm_80 or newer.  Every lane of the warp must call it (converged, ``.sync.aligned``).

    Arguments, per lane: ``a0..a3`` — four 32-bit registers (``uint32``), each
    two float16 of A (16×16, the "row" operand); ``b0, b1`` — two registers of
    B (16×8, the "col" operand); ``c0..c3`` — four float32 of C (16×8).
    Returns this lane's ``(d0, d1, d2, d3)`` of D, laid out like C.  Which
    elements each lane holds (ASCII pictures in the helpers' docstrings)::

        A: register r, half h  ->  a_frag_index(lane, r, h) = (row, k)
        B: register r, half h  ->  b_frag_index(lane, r, h) = (k, col)
        C, D: value i          ->  c_frag_index(lane, i)    = (row, col)

    Simulator: the lanes exchange their operands, and each lane computes its
    four outputs from the whole tile — products exactly, the sum in float64
    rounded once to float32 (the hardware's adder differs in the last bits).
    """
    return _sim_mma(f16_bits_to_f32, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


def _sim_mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A·B + C on the tensor cores with bfloat16 inputs: as :func:`mma_m16n8k16_f16`.

    PTX: ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32``; sm_80 or newer.
    The registers hold bfloat16 bit patterns (the top 16 bits of a float32);
    fragment layouts are the same as for float16.
    """
    return _sim_mma(bf16_bits_to_f32, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


def _words16(smem, offset):
    """``smem`` as 16-bit words, and element ``offset`` as a word index (checking 16-byte alignment)."""
    byte = int(offset) * smem.itemsize
    if byte % 16:
        raise ValueError(f"shared-memory address {byte} (element {offset}) is not 16-byte aligned")
    return smem.reshape(-1).view(np.uint16), byte // 2


def _sim_ldmatrix(smem, offset, trans):
    lane, rows = _sim_exchange((smem, offset))
    g, t = lane >> 2, lane & 3
    out = []
    for i in range(4):
        if trans:  # column g of matrix i, rows 2t and 2t + 1
            lo_mem, lo_off = _words16(*rows[8 * i + 2 * t])
            hi_mem, hi_off = _words16(*rows[8 * i + 2 * t + 1])
            lo, hi = lo_mem[lo_off + g], hi_mem[hi_off + g]
        else:  # row g of matrix i, columns 2t and 2t + 1
            mem, off = _words16(*rows[8 * i + g])
            lo, hi = mem[off + 2 * t], mem[off + 2 * t + 1]
        out.append(np.uint32(lo) | (np.uint32(hi) << np.uint32(16)))
    return tuple(out)


def _sim_ldmatrix_x4(smem, offset):
    """Four 8×8 matrices of 16-bit elements from shared memory into registers, one warp together.

    PTX: ``ldmatrix.sync.aligned.m8n8.x4.shared.b16 {r0, r1, r2, r3}, [addr]``; sm_75 or newer.
    Every lane of the warp must call it.

    ``smem`` is a shared array and ``offset`` an element index into it: the
    start of one 16-byte matrix row (8 elements), 16-byte aligned.  Lanes
    8i..8i+7 give the addresses of rows 0..7 of matrix i.  Register i of each
    lane comes back holding two elements of matrix i::

                  cols 0,1   2,3   4,5   6,7
        row 0        T0      T1    T2    T3         lane T gets row T >> 2,
        row 1        T4      T5    T6    T7         columns 2(T % 4) (low half)
        ...                                         and 2(T % 4) + 1 (high half)
        row 7       T28     T29   T30   T31

    This is the A (and C) fragment layout of ``mma``: with the addresses of
    :func:`ldmatrix_x4_a_address` one call loads the A operand of a 16×16
    tile, with :func:`ldmatrix_x4_bt_address` the B operands of two n-tiles
    stored n-major (a K tile).
    """
    return _sim_ldmatrix(smem, offset, False)


def _sim_ldmatrix_x4_trans(smem, offset):
    """:func:`ldmatrix_x4` with each 8×8 matrix transposed on the way.

    PTX: ``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16``; sm_75 or newer.
    Addresses as for :func:`ldmatrix_x4`; register i of lane T holds the
    elements (row 2(T % 4), column T >> 2) (low half) and (row 2(T % 4) + 1,
    column T >> 2) (high half) of matrix i::

                  cols 0     1     2   ...   7
        rows 0,1     T0    T4    T8  ...   T28
        rows 2,3     T1    T5    T9  ...   T29
        rows 4,5     T2    T6   T10  ...   T30
        rows 6,7     T3    T7   T11  ...   T31

    That is the B fragment layout of ``mma`` for B stored k-major (row-major
    k × n, a V tile): with the addresses of :func:`ldmatrix_x4_a_address`,
    registers (r0, r1) are B for columns 0..7 and (r2, r3) for columns 8..15.
    """
    return _sim_ldmatrix(smem, offset, True)


def _sim_ld_shared_v4_b32(smem, offset):
    """Load 16 bytes of shared memory as four 32-bit words: ``(w0, w1, w2, w3)``, uint32, ``w0`` lowest.

    PTX: ``ld.shared.v4.b32 {w0, w1, w2, w3}, [addr]``; any compute capability.  ``smem`` is a shared
    array and ``offset`` an element index into it, 16-byte aligned (as for :func:`ldmatrix_x4`).  One
    thread's own load, not a warp-wide one: the tensor-core forward reads its output tile back with these,
    8 elements of 16 bits per thread and request, for one :func:`st_global_v4_b32` each.  Eight 16-bit
    elements come as four words, the lower-addressed element of each pair in the low half.  Simulator: the
    array's elements there, alignment checked.
    """
    mem, off = _words16(smem, offset)
    return tuple(np.uint32(mem[off + 2 * w]) | (np.uint32(mem[off + 2 * w + 1]) << np.uint32(16)) for w in range(4))


#: Simulator only.  ``False`` (the default): a ``cp.async`` copy happens at once.  ``True``: it happens
#: at the wait that covers it, and until then its 16 destination bytes hold all-ones (a NaN in every
#: float type) — the freedom the hardware has.  A kernel whose schedule reads a tile before the wait
#: and barrier that make it complete, or starts a copy over a tile that another thread still reads,
#: then computes NaN or stale values instead of passing by luck (``tests/test_backward.py`` sets it).
SIM_CP_ASYNC_LANDS_AT_WAIT = False
_sim_cp_async_groups = threading.local()  # per simulated thread: .open (uncommitted copies), .committed (groups)


def _sim_cp_async_queue():
    state = _sim_cp_async_groups
    if not hasattr(state, "open"):
        state.open, state.committed = [], []
    return state


#: Simulator only: functions called as ``f(dst, byte_start)`` for every ``cp.async`` chunk that lands (in the
#: landing thread).  :mod:`nbflash.hopper` keeps the chunks that have not passed a ``fence.proxy.async`` yet.
SIM_LAND_OBSERVERS = []


def _sim_land(copies):
    for dst, start, chunk in copies:
        dst.reshape(-1).view(np.uint8)[start : start + len(chunk)] = chunk
        for observe in SIM_LAND_OBSERVERS:
            observe(dst, start)


def _sim_cp_async_16(dst, dst_offset, src, src_index, src_bytes=16):
    """Start an asynchronous 16-byte copy global → shared that bypasses registers (and L1).

    PTX: ``cp.async.cg.shared.global [dst], [src], 16{, src_bytes}``; sm_80 or newer.

    ``dst[dst_offset]`` (a shared array, element index, 16-byte aligned)
    receives the 16 bytes starting at ``src[src_index]`` (a global array;
    ``src_index`` an integer or a tuple of non-negative integers; the 16 bytes
    run along the contiguous last axis and must be 16-byte aligned).  With
    ``src_bytes`` < 16 only that many bytes are read and the rest of the 16
    are zero-filled; ``src_bytes = 0`` reads nothing and writes 16 zero bytes
    (rows past the end of a sequence).  The copy completes only after
    :func:`cp_async_commit` and a :func:`cp_async_wait` that covers its group
    (and is visible to other threads after a barrier).

    Simulator: the copy happens at once; commit and wait do nothing — unless
    :data:`SIM_CP_ASYNC_LANDS_AT_WAIT` makes it land at the wait.
    """

    def read(n):
        dtype = np.dtype(src.dtype)
        idx = tuple(src_index) if isinstance(src_index, tuple) else (src_index,)
        count = -(-n // dtype.itemsize)
        return np.array([src[idx[:-1] + (idx[-1] + e,)] for e in range(count)], dtype=dtype).view(np.uint8)[:n]

    _sim_copy_chunk(dst, dst_offset, src_bytes, read)


def _sim_copy_chunk(dst, dst_offset, src_bytes, read, size=16):
    """Start one copy of ``size`` bytes to ``dst[dst_offset]``: ``read(n)`` returns the ``n`` source bytes (not
    called when ``n`` is 0), the rest of the ``size`` are zero.  It lands now, or at the wait that covers its
    group."""
    start = int(dst_offset) * dst.itemsize
    if start % size:
        raise ValueError(f"cp.async destination {start} (element {dst_offset}) is not {size}-byte aligned")
    chunk = np.zeros(size, dtype=np.uint8)
    n = min(int(src_bytes), size)
    if n > 0:  # with src-size 0 the source is not read at all
        chunk[:n] = read(n)
    if SIM_CP_ASYNC_LANDS_AT_WAIT:
        dst.reshape(-1).view(np.uint8)[start : start + size] = 0xFF  # in flight: not the old tile, not the new
        _sim_cp_async_queue().open.append((dst, start, chunk))
    else:
        _sim_land([(dst, start, chunk)])


def _sim_cp_async_4(dst, dst_offset, src, src_index, src_bytes=4):
    """Start an asynchronous 4-byte copy global → shared (through L1): one float32 value.

    PTX: ``cp.async.ca.shared.global [dst], [src], 4, src_bytes``; sm_80 or newer.

    ``dst[dst_offset]`` (a shared array, element index, 4-byte aligned)
    receives the 4 bytes of ``src[src_index]`` (a global array of a 4-byte
    type; ``src_index`` a tuple of non-negative integers).  ``src_bytes = 0``
    reads nothing and writes 4 zero bytes (a row past the end of a sequence;
    ``src_index`` must still be a valid index).  Grouped, waited for and made
    visible as :func:`cp_async_16`: the per-row scalars of a tile (the
    backward's lse2 and D) travel in the same group as the tile's rows, with
    no register and no wait for the load in the thread that starts it.
    """

    def read(n):
        value = np.array([src[src_index]], dtype=src.dtype)
        if value.itemsize != 4:
            raise TypeError(f"cp_async_4 copies one 4-byte element, got a {src.dtype} array")
        return value.view(np.uint8)[:n]

    _sim_copy_chunk(dst, dst_offset, src_bytes, read, size=4)


def _sim_cp_async_16_at(dst, dst_offset, address, src_bytes=16):
    """:func:`cp_async_16` from a global address: 16 bytes from ``address`` to ``dst[dst_offset]``.

    PTX: ``cp.async.cg.shared.global [dst], [address], 16, src_bytes``; sm_80 or newer.

    ``address`` comes from :func:`global_address` plus byte offsets (16-byte
    aligned; the 16 bytes lie along the contiguous last axis of the array it
    points into).  A tile loader computes one address per tile and reaches
    the next rows it copies by adding a row stride: two integer additions per
    chunk instead of a four-index address computation.  ``src_bytes`` as in
    :func:`cp_async_16` (0: read nothing, write 16 zero bytes).

    Simulator: ``address`` is the simulator's address object, which checks
    that the bytes read lie inside the array and are aligned.
    """

    def read(n):
        src = address.array
        if (src.ctypes.data + address.offset) % 16:
            raise ValueError(f"cp.async source {src.ctypes.data + address.offset:#x} is not 16-byte aligned")
        count = -(-n // src.itemsize)
        idx = address._index(address.offset)
        last = len(idx) - 1  # (the simulator's shape tuples refuse negative indices)
        if src.strides[last] != src.itemsize or idx[last] + count > src.shape[last]:
            raise IndexError(f"16 bytes from element {idx} do not lie along the last axis of the {src.shape} array")
        vals = np.array([src[idx[:last] + (idx[last] + e,)] for e in range(count)], dtype=src.dtype)
        return vals.view(np.uint8)[:n]

    _sim_copy_chunk(dst, dst_offset, src_bytes, read)


def _sim_cp_async_commit():
    """Close the group of this thread's ``cp.async`` copies issued since the last commit.

    PTX: ``cp.async.commit_group``; sm_80 or newer.  In the simulator the
    groups matter only with :data:`SIM_CP_ASYNC_LANDS_AT_WAIT`.
    """
    state = _sim_cp_async_queue()
    state.committed.append(state.open)
    state.open = []


def _sim_cp_async_wait(n):
    """Wait until at most ``n`` of this thread's committed ``cp.async`` groups are still in flight.

    PTX: ``cp.async.wait_group n``; sm_80 or newer.  ``n`` must be a
    compile-time constant (an immediate in the instruction): ``n = 1`` with two
    groups in flight waits for the older one — double buffering.  The data is
    visible to *other* threads only after a following ``cuda.syncthreads()``.
    In the simulator the older groups land here with :data:`SIM_CP_ASYNC_LANDS_AT_WAIT`.
    """
    state = _sim_cp_async_queue()
    while len(state.committed) > n:
        _sim_land(state.committed.pop(0))


def _sim_cp_async_wait_all():
    """Wait for all of this thread's ``cp.async`` copies.

    PTX: ``cp.async.wait_all`` (commit + wait_group 0); sm_80 or newer.  In the
    simulator every copy lands here with :data:`SIM_CP_ASYNC_LANDS_AT_WAIT`.
    """
    _sim_cp_async_commit()
    _sim_cp_async_wait(0)


def _sim_pack_f16x2(lo, hi):
    """Two float32 → one 32-bit register of two float16 (round to nearest even), ``lo`` in the low half.

    PTX: ``cvt.rn.f16x2.f32 d, hi, lo`` — the instruction puts its *first*
    source in the upper half, so the operands are passed swapped; sm_80 or
    newer.  ``pack_f16x2(p[c], p[c + 1])`` is the A-fragment register of
    columns c, c + 1.  Simulator: NumPy's float32 → float16 cast (round to
    nearest even, overflow to inf), bit for bit for every non-NaN input (which
    NaN pattern the hardware returns is not modelled).
    """
    lo_b, hi_b = f32_to_f16_bits(lo), f32_to_f16_bits(hi)
    return np.uint32(lo_b) | (np.uint32(hi_b) << np.uint32(16))


def _sim_pack_bf16x2(lo, hi):
    """Two float32 → one 32-bit register of two bfloat16 (round to nearest even), ``lo`` in the low half.

    PTX: ``cvt.rn.bf16x2.f32 d, hi, lo`` (first source → upper half); sm_80 or
    newer.  Simulator: round-to-nearest-even on the bits, overflow to inf;
    NaN → 0x7FFF (the PTX canonical NaN; not checked against hardware).
    """
    lo_b, hi_b = f32_to_bf16_bits(lo), f32_to_bf16_bits(hi)
    return np.uint32(lo_b) | (np.uint32(hi_b) << np.uint32(16))


def _sim_unpack_f16x2(x):
    """One 32-bit register of two float16 → ``(low, high)`` as float32 (exact).

    Plain LLVM bit operations and ``cvt.f32.f16``; any compute capability.
    """
    x = np.uint32(x)
    return np.float32(f16_bits_to_f32(x & 0xFFFF)), np.float32(f16_bits_to_f32(x >> 16))


def _sim_unpack_bf16x2(x):
    """One 32-bit register of two bfloat16 → ``(low, high)`` as float32 (exact: a shift).

    Plain LLVM bit operations; any compute capability.
    """
    x = np.uint32(x)
    return np.float32(bf16_bits_to_f32(x & 0xFFFF)), np.float32(bf16_bits_to_f32(x >> 16))


_F32_TINY = np.finfo(np.float32).tiny


_RED_LOCK = threading.Lock()


def _sim_divmod_u32(a, b):
    """``(a // b, a % b)`` of two integers taken as 32-bit unsigned: ``div.u32`` and ``rem.u32``.

    Why not ``//``: Numba types integer arithmetic at 64 bits, and PTX has no
    64-bit divide instruction, so ``x // y`` with a run-time ``y`` becomes a
    call to a division subroutine.  ptxas serialises every ``wgmma`` of a
    kernel that makes a call (its C7509 note).  32-bit division is inline code.
    The caller keeps both operands below 2^32.  Simulator: Python's divmod.
    """
    a, b = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF
    if b == 0:
        raise ZeroDivisionError("divmod_u32: division by zero")
    return divmod(a, b)  # Python ints (the values of the GPU's uint32): a NumPy scalar costs a microsecond each


@intrinsic
def _gpu_divmod_u32(typingctx, a, b):
    if not _is_int(a, b):
        return None
    sig = types.UniTuple(types.uint32, 2)(a, b)

    def codegen(context, builder, sig, args):
        x, y = _cast_all(context, builder, args, sig.args, types.uint32)
        return context.make_tuple(builder, sig.return_type, [builder.udiv(x, y), builder.urem(x, y)])

    return sig, codegen


def _sim_red_add_f32x4(arr, index, v0, v1, v2, v3):
    """Atomically add ``v0 … v3`` to four consecutive float32 elements of a global array; no result.

    PTX: ``red.global.add.v4.f32 [a], {v0, v1, v2, v3}`` on sm_90 (one request
    for 16 bytes), four ``red.global.add.f32`` before.  ``arr[index]`` is the
    first element (``index`` a tuple of non-negative integers); the four run
    along the contiguous last axis and must be 16-byte aligned.  Each element's
    addition is atomic, the four together are not.  Unlike ``cuda.atomic.add``
    on a generic pointer, the address is known to be global: no test for a
    shared-memory address around each addition.
    """
    offset = sum(int(i) * int(st) for i, st in zip(index, arr.strides, strict=True))
    if offset % 16:
        raise ValueError(f"red.v4 address {index} (byte offset {offset}) is not 16-byte aligned")
    *lead, last = index
    with _RED_LOCK:  # simulated threads are Python threads: each read-modify-write under the lock
        for i, value in enumerate((v0, v1, v2, v3)):
            arr[(*lead, last + i)] += np.float32(value)


def _sim_pinned_u32(x):
    """``x`` as a uint32 that the optimiser must compute where it stands.

    PTX: a ``mov.b32`` in a ``volatile`` inline ``asm``; any compute
    capability.  Whatever is derived from the result stays where the code
    puts it: LLVM cannot hoist it out of a loop as loop-invariant, and keep it
    in registers for the whole loop.  A tile copy inside a key loop derives its
    addresses from a pinned thread index, so that they cost registers only
    while the copy is issued (the tensor-core kernels run at 255 registers).
    Simulator: ``x`` itself.
    """
    return np.uint32(x)


def _sim_f32_after(x, y):
    """``x``, computed only once ``y`` is: a data dependence the instruction scheduler must keep.

    PTX: ``fma.rn.f32 out, y, 0, x`` (one FFMA; ``y`` finite, so the result
    is ``x``; ptxas cannot drop ``y · 0`` since it does not know ``y`` is
    finite); any compute capability.  ptxas places a ``wgmma.wait_group``
    right before the first instruction that reads the awaited accumulators:
    in the wgmma forward, O's rescale by ``f32_after(alpha, l)`` reads them
    only after the row sum l, so the wait for P V comes after the softmax it
    is meant to overlap, not amid it.  Simulator: ``x``.
    """
    return np.float32(x)


def _sim_ex2_approx(x):
    """2**x in float32 by the special-function unit, subnormals flushed to zero.

    PTX: ``ex2.approx.ftz.f32``; any compute capability (one MUFU.EX2).  The
    hardware result is within 2 ulp of the exact one (PTX ISA); ``-inf`` gives
    +0, ``+inf`` gives +inf.  Simulator: NumPy's float32 ``exp2`` with subnormal
    inputs and results flushed to zero — not the hardware's bits.
    """
    x = np.float32(x)
    if abs(x) < _F32_TINY:  # .ftz: a subnormal input counts as zero
        x = np.float32(0)
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp2(x)
    return np.float32(0) if abs(y) < _F32_TINY else np.float32(y)  # .ftz: subnormal result → 0


#: ``ex2_poly``: float32 coefficients c1 … c4 of 2**f ≈ 1 + c1·f + c2·f² + c3·f³ + c4·f⁴ on [-1/2, 1/2], fitted
#: for the least maximum relative error (Lawson's reweighted least squares; the constant term held at 1, so that
#: 2**0 is exact): 2.9e-6 evaluated in float32 by Horner's rule, a hundredth of fp16's half-ulp (4.9e-4) and far
#: inside the 1e-5 that lse = m + log l is held to.  (Degree 3 would save one FMA at 1.0e-4: enough for a bf16 P,
#: not for lse.)
EXP2_POLY = (0.6931241750717163, 0.24024099111557007, 0.055906400084495544, 0.009582829661667347)
_ROUNDER = np.float32(12582912.0)  # 1.5 · 2^23: x + this rounds x to an integer, held in the low mantissa bits


def _sim_ex2_poly(x):
    """2**x in float32 on the FMA and integer units, not the special-function unit (after FlashAttention-4).

    The steps: x' = max(x, -127); j = round(x') by adding and subtracting
    1.5 · 2^23 (the sum's low mantissa bits hold j in two's complement);
    f = x' − j in [-1/2, 1/2]; p = 2**f by the polynomial :data:`EXP2_POLY`
    (Horner, four FMAs); then j is added to p's exponent field (an integer
    add of the sum's bits shifted left by 23).  ``-inf`` (a masked score)
    gives exactly +0: x' = -127, f = 0, p = 1 and the exponent field becomes
    0.  x' in (-127, -125) may give a subnormal (flushed by any later
    ``.ftz`` arithmetic), x up to 127 a normal number; relative error within
    3e-6 past 2^-125.  Why: at D = 64 a warpgroup's softmax needs one
    MUFU.EX2 per score, and the special-function unit does 16 a clock per
    multiprocessor, the tensor cores' pace there; computing a share of the
    exponentials on the FMA units (128 lanes a clock) shortens the softmax.

    PTX: ``max``, ``add.rn``/``sub.rn`` (not fused), four ``fma.rn``,
    ``shl.b32``, ``add.s32``; any compute capability.  Simulator: the same
    steps in NumPy float32, each FMA computed in float64 and rounded once to
    float32 (the GPU's bits but for rare double roundings).
    """
    xc = np.float32(max(np.float32(x), np.float32(-127.0)))
    t = np.float32(xc + _ROUNDER)
    j = np.float32(t - _ROUNDER)
    f = np.float32(xc - j)
    p = np.float32(EXP2_POLY[-1])
    for c in (*EXP2_POLY[-2::-1], 1.0):
        p = np.float32(float(p) * float(f) + float(np.float32(c)))
    bits = (int(np.array(p).view(np.uint32)) + (int(np.array(t).view(np.uint32)) << 23)) & 0xFFFFFFFF
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


# Global addresses and fire-and-forget float32 reductions (atomic adds whose old value nobody reads).


class _SimGlobalAddress:
    """The simulator's stand-in for a 64-bit global address: ``offset`` bytes from element 0 of ``array``.

    Adding an integer adds bytes, as on the GPU; an access must then land on
    an element of ``array`` (else ``IndexError``), aligned as the instruction
    requires (else ``ValueError``) — where the GPU would silently touch another
    row, another allocation, or fault.
    """

    __slots__ = ("array", "offset")

    def __init__(self, array, offset):
        self.array = array
        self.offset = offset

    def __add__(self, nbytes):
        return _SimGlobalAddress(self.array, self.offset + int(nbytes))

    __radd__ = __add__

    def __and__(self, mask):
        """The low bits of the address, as ``address & mask`` on the GPU (an alignment test)."""
        return (self.array.ctypes.data + self.offset) & int(mask)

    def elements(self, count, align):
        """The index of each of the ``count`` consecutive float32 from here (checking bounds and alignment)."""
        if (self.array.ctypes.data + self.offset) % align:
            raise ValueError(f"global address {self.array.ctypes.data + self.offset:#x} is not {align}-byte aligned")
        return [self._index(self.offset + 4 * e) for e in range(count)]

    def _index(self, offset):
        shape, strides = self.array.shape, self.array.strides
        idx = [0] * len(shape)
        rest = offset
        for axis in sorted(range(len(shape)), key=lambda a: -strides[a]):  # outermost axis first
            if shape[axis] > 1:
                idx[axis], rest = divmod(rest, strides[axis])
        if rest or not all(0 <= i < n for i, n in zip(idx, shape, strict=True)):
            raise IndexError(f"byte offset {offset} is not an element of the {shape} array")
        return tuple(idx)


def _sim_global_address(array, index):
    """The 64-bit ``.global`` address of ``array[index]`` in bytes, for :func:`red_add_f32`, :func:`red_add_f32x2`
    and :func:`cp_async_16_at`.

    ``array``: a global array (strided layouts are fine; element strides must
    be positive); ``index``: an integer or a tuple of non-negative integers,
    one per axis.  Any compute capability (the index arithmetic and a
    ``cvta.to.global``).  Returns an ``int64`` to which a kernel adds byte
    offsets: compute a row's address once, and reach its columns by constant
    offsets (immediates in the instruction).  Simulator: an object that
    adds bytes the same way and checks each access (see ``_SimGlobalAddress``).
    """
    idx = tuple(int(i) for i in index) if isinstance(index, tuple) else (int(index),)
    return _SimGlobalAddress(array, sum(i * s for i, s in zip(idx, array.strides, strict=True)))


_sim_red_lock = threading.Lock()


def _ftz(x):
    """A float32 with subnormals flushed to a zero of the same sign."""
    x = np.float32(x)
    return np.copysign(np.float32(0), x) if abs(x) < _F32_TINY else x


def _sim_red_add(address, values, align):
    if address.array.dtype != np.float32:
        raise TypeError(f"a float32 reduction into an array of {address.array.dtype}")
    with _sim_red_lock:  # each element's read-modify-write is atomic
        for idx, v in zip(address.elements(len(values), align), values, strict=True):
            address.array[idx] = _ftz(_ftz(address.array[idx]) + _ftz(v))


def _sim_st_global_b32(address, bits):
    """Store 32 bits at a global address: ``*(uint32 *) address = bits``.

    PTX: ``st.global.b32 [address], bits``; any compute capability.
    ``address`` comes from :func:`global_address` plus byte offsets (4-byte
    aligned).  The tensor-core epilogue writes each pair of adjacent outputs
    (two float16 or bfloat16 values packed by :func:`pack_f16x2` /
    :func:`pack_bf16x2`, the first in the low half) with one of these, from a
    row address computed once, instead of two 2-byte stores each with a
    4-index address.  Simulator: the two 16-bit elements (or one 32-bit
    element) of the array at that address, bounds and alignment checked.
    """
    src = address.array
    if (src.ctypes.data + address.offset) % 4:
        raise ValueError(f"st.global.b32 address {src.ctypes.data + address.offset:#x} is not 4-byte aligned")
    parts = np.array([bits], dtype=np.uint32).view(np.dtype(src.dtype))
    for e, part in enumerate(parts):
        src[address._index(address.offset + e * src.itemsize)] = part


def _sim_vector_words(address, what):
    """The element indices of the four 32-bit words at ``address`` (16-byte aligned; bounds checked), each a
    tuple of ``4 // itemsize`` indices, lowest address first."""
    src = address.array
    if (src.ctypes.data + address.offset) % 16:
        raise ValueError(f"{what} address {src.ctypes.data + address.offset:#x} is not 16-byte aligned")
    per = 4 // src.itemsize
    return [tuple(address._index(address.offset + 4 * w + e * src.itemsize) for e in range(per)) for w in range(4)]


def _sim_ld_global_v4_b32(address):
    """Load 16 bytes from a global address as four 32-bit words: ``(w0, w1, w2, w3)``, uint32, ``w0`` lowest.

    PTX: ``ld.global.v4.b32 {w0, w1, w2, w3}, [address]``; any compute capability (one 16-byte request per
    thread, where element-wise loads of 16-bit data issue eight).  ``address`` comes from
    :func:`global_address` plus byte offsets and must be 16-byte aligned.  The memory must not change while
    the kernel runs (the load may be moved or merged like any pure computation): inputs, or what an earlier
    kernel wrote.  Eight 16-bit elements come as four words, the lower-addressed element of each pair in
    the low half (as :func:`unpack_f16x2` / :func:`unpack_bf16x2` take them).  Simulator: the array's
    elements at that address, bounds and alignment checked.
    """
    src = address.array
    words = []
    for idx in _sim_vector_words(address, "ld.global.v4"):
        words.append(np.array([src[i] for i in idx], dtype=src.dtype).view(np.uint32)[0])
    return tuple(words)


def _sim_ld_global_v4_f32(address):
    """Load four consecutive float32 from a global address: ``(x0, x1, x2, x3)``.

    PTX: ``ld.global.v4.f32``; otherwise as :func:`ld_global_v4_b32` (16-byte aligned, memory unchanged
    during the kernel).
    """
    return tuple(np.uint32(w).view(np.float32) for w in _sim_ld_global_v4_b32(address))


def _sim_st_global_v4_b32(address, w0, w1, w2, w3):
    """Store four 32-bit words at a global address (16 bytes, ``w0`` at the lowest address).

    PTX: ``st.global.v4.b32 [address], {w0, w1, w2, w3}``; any compute capability.  ``address`` (from
    :func:`global_address`) must be 16-byte aligned.  Eight 16-bit outputs packed in pairs by
    :func:`pack_f16x2` / :func:`pack_bf16x2` (or four float32 bit patterns; zeros to clear) go out as one
    request.  Simulator: the array's elements at that address, bounds and alignment checked.
    """
    src = address.array
    for idx, w in zip(_sim_vector_words(address, "st.global.v4"), (w0, w1, w2, w3), strict=True):
        parts = np.array([w], dtype=np.uint32).view(np.dtype(src.dtype))
        for i, part in zip(idx, parts, strict=True):
            src[i] = part


def _sim_red_add_f32(address, x):
    """``*address += x`` atomically in float32; nothing is returned (a reduction, not an ``atom``).

    PTX: ``red.global.add.f32 [address], x``; any compute capability.
    ``address`` comes from :func:`global_address` (4-byte aligned).  Rounds to
    nearest even and flushes subnormal inputs and results to zero (as
    ``atom.add.f32``; SASS ``REDG.E.ADD.F32.FTZ.RN`` on sm_90).  Unlike
    Numba's ``cuda.atomic.add`` on an array (a generic address: ptxas adds a
    shared-or-global test and a compare-and-swap fallback to every addition),
    the address is known to be global.
    """
    _sim_red_add(address, (x,), 4)


def _sim_red_add_f32x2(address, x, y):
    """``address[0] += x`` and ``address[1] += y`` in one instruction: two adjacent float32, each atomically.

    PTX: ``red.global.add.v2.f32 [address], {x, y}`` — the ``.v2`` form of
    ``red`` with ``.vec_32_bit`` (PTX ISA 8.1, **sm_90** or newer; ``.global``
    only).  ``address`` (from :func:`global_address`) must be 8-byte aligned;
    float32 semantics as :func:`red_add_f32`.  A pair of ``mma`` accumulators
    (c0, c1: row g, columns 2t, 2t + 1; or c2, c3 at row g + 8) is such a pair,
    so a thread adds its four values of a 16×8 tile with two of these instead
    of four scalar reductions (SASS ``REDG.E.ADD.F32x2``).
    """
    _sim_red_add(address, (x, y), 8)


# ----------------------------------------------------------------------------
# GPU implementations: inline PTX
# ----------------------------------------------------------------------------

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()


def _asm(builder, ret, arg_types, ptx, constraints, args, side_effect=False, warp_wide=False):
    """Emit one inline-PTX statement.

    ``side_effect`` keeps it in place and alive (memory operations);
    ``warp_wide`` marks the call ``convergent`` — as CUDA C++ marks every inline
    ``asm`` — so the optimiser never moves a ``.sync.aligned`` instruction into
    or out of a branch that only some lanes take.
    """
    fnty = ir.FunctionType(ret, arg_types)
    asm = ir.InlineAsm(fnty, ptx, constraints, side_effect=side_effect)
    return builder.call(asm, args, attrs=("convergent",) if warp_wide else ())


def _cast_all(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types, strict=True)]


def _is_int(*tys):
    return all(isinstance(t, types.Integer) for t in tys)


def _is_flat_array(ty):
    """A C-contiguous array, which a flat element offset addresses (a shared array)."""
    return isinstance(ty, types.Array) and ty.layout == "C"


def _is_number(*tys):
    return all(isinstance(t, (types.Float, types.Integer)) for t in tys)


def _shared_address(context, builder, arrty, arr, offty, offset):
    """32-bit ``.shared`` address of element ``offset`` of a shared array.

    A Numba array's data pointer is *generic*.  Casting it to LLVM address
    space 3 and taking the integer gives the shared-window address the
    ``.shared`` forms of ldmatrix / cp.async want; for an array from
    ``cuda.shared.array`` (itself a generic cast of an addrspace(3) global)
    NVVM folds the two casts away, where inline ``cvta.to.shared`` could not be.
    """
    ary = context.make_array(arrty)(context, builder, value=arr)
    off = context.cast(builder, offset, offty, types.intp)
    ptr = builder.gep(ary.data, [off])
    sptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
    return builder.ptrtoint(sptr, _I32)


def _global_address(context, builder, arrty, arr, idxty, idx):
    """64-bit ``.global`` address of ``arr[idx]`` (idx: an integer or a tuple of integers, none negative)."""
    ary = context.make_array(arrty)(context, builder, value=arr)
    if isinstance(idxty, types.BaseTuple):
        inds = [context.cast(builder, builder.extract_value(idx, i), t, types.intp) for i, t in enumerate(idxty)]
    else:
        inds = [context.cast(builder, idx, idxty, types.intp)]
    ptr = cgutils.get_item_pointer(context, builder, arrty, ary, inds, wraparound=False)
    gptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 1))
    return builder.ptrtoint(gptr, _I64)


def _make_gpu_mma(kind):
    ptx = (
        f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    )

    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not (_is_int(a0, a1, a2, a3, b0, b1) and _is_number(c0, c1, c2, c3)):
            return None
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = _cast_all(context, builder, args[:6], sig.args[:6], types.uint32)
            acc = _cast_all(context, builder, args[6:], sig.args[6:], types.float32)
            res = _asm(builder, ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4, ptx,
                       "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", regs + acc, warp_wide=True)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    mma.__name__ = f"mma_m16n8k16_{kind}"
    return intrinsic(mma)


def _make_gpu_shared_x4(name, ptx, warp_wide):
    """An intrinsic ``name(smem, offset) -> 4 × uint32`` running ``ptx`` (``$0 … $3`` the words, ``$4`` the address)
    on the ``.shared`` address of element ``offset`` of a shared array: ldmatrix x4, and ld.shared.v4.

    Side effects and a memory clobber keep it after the stores and barriers before it: the words were written
    by other threads, which the compiler cannot see.  ``warp_wide``: a ``.sync.aligned`` instruction (convergent).
    """

    def load(typingctx, smem, offset):
        if not (_is_flat_array(smem) and _is_int(offset)):
            return None
        sig = types.UniTuple(types.uint32, 4)(smem, offset)

        def codegen(context, builder, sig, args):
            addr = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            res = _asm(builder, ir.LiteralStructType([_I32] * 4), [_I32], ptx, "=r,=r,=r,=r,r,~{memory}", [addr],
                       side_effect=True, warp_wide=warp_wide)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    load.__name__ = load.__qualname__ = name
    return intrinsic(load)


def _make_gpu_ldmatrix(trans):
    ptx = f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];"
    return _make_gpu_shared_x4("ldmatrix_x4_trans" if trans else "ldmatrix_x4", ptx, warp_wide=True)


def _emit_cp_async_zfill(builder, shared_address, global_address, src_bytes):
    """``cp.async`` of 16 bytes, ``src_bytes`` of them read and the rest zero-filled (both cp.async forms)."""
    _asm(builder, ir.VoidType(), [_I32, _I64, _I32], "cp.async.cg.shared.global [$0], [$1], 16, $2;",
         "r,l,r,~{memory}", [shared_address, global_address, src_bytes], side_effect=True)


@intrinsic
def _gpu_cp_async_16(typingctx, dst, dst_offset, src, src_index, src_bytes=None):
    idx_ok = _is_int(src_index) or (isinstance(src_index, types.BaseTuple) and _is_int(*src_index))
    if not (_is_flat_array(dst) and _is_int(dst_offset) and isinstance(src, types.Array) and idx_ok):
        return None
    zfill = src_bytes is not None and not isinstance(src_bytes, (types.NoneType, types.Omitted))
    if zfill and not _is_int(src_bytes):
        return None
    sig = types.void(dst, dst_offset, src, src_index, src_bytes if zfill else types.Omitted(None))

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _global_address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        if zfill:
            _emit_cp_async_zfill(builder, d, s, context.cast(builder, args[4], sig.args[4], types.uint32))
        else:
            _asm(builder, ir.VoidType(), [_I32, _I64], "cp.async.cg.shared.global [$0], [$1], 16;",
                 "r,l,~{memory}", [d, s], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_cp_async_4(typingctx, dst, dst_offset, src, src_index, src_bytes):
    idx_ok = isinstance(src_index, types.BaseTuple) and _is_int(*src_index)
    if not (_is_flat_array(dst) and _is_int(dst_offset, src_bytes) and isinstance(src, types.Array) and idx_ok):
        return None
    if src.dtype.bitwidth != 32:
        return None
    sig = types.void(dst, dst_offset, src, src_index, src_bytes)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = _global_address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        _asm(builder, ir.VoidType(), [_I32, _I64, _I32], "cp.async.ca.shared.global [$0], [$1], 4, $2;",
             "r,l,r,~{memory}", [d, s, n], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_cp_async_16_at(typingctx, dst, dst_offset, address, src_bytes):
    if not (_is_flat_array(dst) and _is_int(dst_offset, address, src_bytes)):
        return None
    sig = types.void(dst, dst_offset, address, src_bytes)

    def codegen(context, builder, sig, args):
        d = _shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        s = context.cast(builder, args[2], sig.args[2], types.int64)
        _emit_cp_async_zfill(builder, d, s, context.cast(builder, args[3], sig.args[3], types.uint32))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_cp_async_commit(typingctx):
    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], "cp.async.commit_group;", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _gpu_cp_async_wait(typingctx, n):
    if not isinstance(n, types.IntegerLiteral):
        return None  # wait_group takes an immediate: n must be a compile-time constant
    groups = int(n.literal_value)

    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], f"cp.async.wait_group {groups};", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()

    return types.void(n), codegen


@intrinsic
def _gpu_cp_async_wait_all(typingctx):
    def codegen(context, builder, sig, args):
        _asm(builder, ir.VoidType(), [], "cp.async.wait_all;", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()

    return types.void(), codegen


def _make_gpu_pack(kind):
    ptx = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

    def pack(typingctx, lo, hi):
        if not _is_number(lo, hi):
            return None
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo_v, hi_v = _cast_all(context, builder, args, sig.args, types.float32)
            # cvt puts its first source in the upper half: pass (hi, lo).
            return _asm(builder, _I32, [_F32, _F32], ptx, "=r,f,f", [hi_v, lo_v])

        return sig, codegen

    pack.__name__ = f"pack_{kind}x2"
    return intrinsic(pack)


def _make_gpu_unpack(kind):
    def unpack(typingctx, x):
        if not _is_int(x):
            return None
        sig = types.UniTuple(types.float32, 2)(x)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.uint32)
            halves = [builder.trunc(v, ir.IntType(16)), builder.trunc(builder.lshr(v, ir.Constant(_I32, 16)),
                                                                      ir.IntType(16))]
            if kind == "f16":
                out = [builder.fpext(builder.bitcast(h, ir.HalfType()), _F32) for h in halves]
            else:  # bf16 is the top half of a float32
                out = [builder.bitcast(builder.shl(builder.zext(h, _I32), ir.Constant(_I32, 16)), _F32)
                       for h in halves]
            return context.make_tuple(builder, sig.return_type, out)

        return sig, codegen

    unpack.__name__ = f"unpack_{kind}x2"
    return intrinsic(unpack)


def _make_gpu_unary(name: str, ptx: str, value_type, value_ok, side_effect: bool = False):
    """An intrinsic ``op(x)``: the one PTX instruction ``ptx`` ($0 = f($1)) on a float32 or uint32 value;
    ``side_effect`` makes it ``volatile`` (computed where it stands, never hoisted or merged)."""
    ir_type, c = (_F32, "f") if value_type == types.float32 else (_I32, "r")

    def op(typingctx, x):
        if not value_ok(x):
            return None
        sig = value_type(x)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], value_type)
            return _asm(builder, ir_type, [ir_type], ptx, f"={c},{c}", [v], side_effect=side_effect)

        return sig, codegen

    op.__name__ = op.__qualname__ = name
    return intrinsic(op)


_gpu_ex2_approx = _make_gpu_unary("ex2_approx", "ex2.approx.ftz.f32 $0, $1;", types.float32, _is_number)


def _f32_hex(x) -> str:
    """A float32 constant as PTX writes it (``0f`` and its bits)."""
    return f"0f{int(np.array(np.float32(x)).view(np.uint32)):08X}"


def _ex2_poly_ptx() -> str:
    """:func:`_sim_ex2_poly`'s steps as one inline-PTX block ($0 = 2**$1)."""
    horner = "".join(f"fma.rn.f32 ep_p, ep_p, ep_f, {_f32_hex(c)}; " for c in (*EXP2_POLY[-2::-1], 1.0))
    return ("{ .reg .f32 ep_x, ep_t, ep_j, ep_f, ep_p; .reg .b32 ep_e, ep_b; "
            f"max.f32 ep_x, $1, {_f32_hex(-127.0)}; "
            f"add.rn.f32 ep_t, ep_x, {_f32_hex(_ROUNDER)}; "
            f"sub.rn.f32 ep_j, ep_t, {_f32_hex(_ROUNDER)}; "
            "sub.rn.f32 ep_f, ep_x, ep_j; "
            f"mov.f32 ep_p, {_f32_hex(EXP2_POLY[-1])}; " + horner +
            "mov.b32 ep_e, ep_t; shl.b32 ep_e, ep_e, 23; mov.b32 ep_b, ep_p; add.s32 ep_b, ep_b, ep_e; "
            "mov.b32 $0, ep_b; }")


_gpu_ex2_poly = _make_gpu_unary("ex2_poly", _ex2_poly_ptx(), types.float32, _is_number)


@intrinsic
def _gpu_f32_after(typingctx, x, y):
    if not _is_number(x, y):
        return None
    sig = types.float32(x, y)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, a, t, types.float32) for a, t in zip(args, sig.args, strict=True)]
        return _asm(builder, _F32, [_F32, _F32], "fma.rn.f32 $0, $2, 0f00000000, $1;", "=f,f,f", vals)

    return sig, codegen


_gpu_pinned_u32 = _make_gpu_unary("pinned_u32", "mov.b32 $0, $1;", types.uint32, _is_int, side_effect=True)


@intrinsic
def _gpu_global_address(typingctx, array, index):
    idx_ok = _is_int(index) or (isinstance(index, types.BaseTuple) and _is_int(*index))
    if not (isinstance(array, types.Array) and idx_ok):
        return None
    sig = types.int64(array, index)

    def codegen(context, builder, sig, args):
        return _global_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])

    return sig, codegen


def _make_gpu_address_op(name: str, ptx: str, value_type, value_ok):
    """An intrinsic ``op(address, value)`` that is the one PTX instruction ``ptx`` ($0: the 64-bit global
    address, $1: the value, cast to ``value_type``: float32 or uint32), kept in place as a memory operation."""
    ir_type, constraint = (_F32, "f") if value_type == types.float32 else (_I32, "r")

    def op(typingctx, address, value):
        if not (_is_int(address) and value_ok(value)):
            return None
        sig = types.void(address, value)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.int64)
            v = context.cast(builder, args[1], sig.args[1], value_type)
            _asm(builder, ir.VoidType(), [_I64, ir_type], ptx, f"l,{constraint},~{{memory}}", [a, v],
                 side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    op.__name__ = op.__qualname__ = name
    return intrinsic(op)


_gpu_red_add_f32 = _make_gpu_address_op("red_add_f32", "red.global.add.f32 [$0], $1;", types.float32, _is_number)
_gpu_st_global_b32 = _make_gpu_address_op("st_global_b32", "st.global.b32 [$0], $1;", types.uint32, _is_int)


def _make_gpu_ld_v4(kind):
    ir_type, c, value_type = (_F32, "f", types.float32) if kind == "f32" else (_I32, "r", types.uint32)
    ptx = f"ld.global.v4.{kind} {{$0, $1, $2, $3}}, [$4];"

    def ld(typingctx, address):
        if not _is_int(address):
            return None
        sig = types.UniTuple(value_type, 4)(address)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[0], sig.args[0], types.int64)
            res = _asm(builder, ir.LiteralStructType([ir_type] * 4), [_I64], ptx, f"={c},={c},={c},={c},l", [a])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    ld.__name__ = ld.__qualname__ = f"ld_global_v4_{kind}"
    return intrinsic(ld)


@intrinsic
def _gpu_st_global_v4_b32(typingctx, address, w0, w1, w2, w3):
    if not _is_int(address, w0, w1, w2, w3):
        return None
    sig = types.void(address, w0, w1, w2, w3)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[0], sig.args[0], types.int64)
        words = _cast_all(context, builder, args[1:], sig.args[1:], types.uint32)
        _asm(builder, ir.VoidType(), [_I64] + [_I32] * 4, "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
             "l,r,r,r,r,~{memory}", [a, *words], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_red_add_f32x2(typingctx, address, x, y):
    if not (_is_int(address) and _is_number(x, y)):
        return None
    sig = types.void(address, x, y)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[0], sig.args[0], types.int64)
        xv, yv = _cast_all(context, builder, args[1:], sig.args[1:], types.float32)
        _asm(builder, ir.VoidType(), [_I64, _F32, _F32], "red.global.add.v2.f32 [$0], {$1, $2};", "l,f,f,~{memory}",
             [a, xv, yv], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _gpu_red_add_f32x4(typingctx, arr, index, v0, v1, v2, v3):
    if not (isinstance(arr, types.Array) and arr.dtype == types.float32 and _is_number(v0, v1, v2, v3)):
        return None
    if not (isinstance(index, types.BaseTuple) and _is_int(*index) and len(index) == arr.ndim):
        return None
    sig = types.void(arr, index, v0, v1, v2, v3)

    def codegen(context, builder, sig, args):
        addr = _global_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        vals = _cast_all(context, builder, args[2:], sig.args[2:], types.float32)
        if target_cc() >= (9, 0):
            _asm(builder, ir.VoidType(), [_I64] + [_F32] * 4, "red.global.add.v4.f32 [$0], {$1, $2, $3, $4};",
                 "l,f,f,f,f,~{memory}", [addr, *vals], side_effect=True)
        else:
            for i, v in enumerate(vals):
                _asm(builder, ir.VoidType(), [_I64, _F32], f"red.global.add.f32 [$0+{4 * i}], $1;",
                     "l,f,~{memory}", [addr, v], side_effect=True)
        return context.get_dummy_value()

    return sig, codegen


# ----------------------------------------------------------------------------
# The public names: one implementation or the other
# ----------------------------------------------------------------------------

def _public(sim, gpu):
    """This run's implementation: ``sim`` in the simulator, else ``gpu()``; both carry ``sim``'s docstring."""
    impl = sim if SIMULATOR else gpu()
    impl.__doc__ = sim.__doc__
    return impl


mma_m16n8k16_f16 = _public(_sim_mma_m16n8k16_f16, lambda: _make_gpu_mma("f16"))
mma_m16n8k16_bf16 = _public(_sim_mma_m16n8k16_bf16, lambda: _make_gpu_mma("bf16"))
ldmatrix_x4 = _public(_sim_ldmatrix_x4, lambda: _make_gpu_ldmatrix(trans=False))
ldmatrix_x4_trans = _public(_sim_ldmatrix_x4_trans, lambda: _make_gpu_ldmatrix(trans=True))
ld_shared_v4_b32 = _public(
    _sim_ld_shared_v4_b32,
    lambda: _make_gpu_shared_x4("ld_shared_v4_b32", "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", warp_wide=False),
)
cp_async_16 = _public(_sim_cp_async_16, lambda: _gpu_cp_async_16)
cp_async_16_at = _public(_sim_cp_async_16_at, lambda: _gpu_cp_async_16_at)
cp_async_4 = _public(_sim_cp_async_4, lambda: _gpu_cp_async_4)
cp_async_commit = _public(_sim_cp_async_commit, lambda: _gpu_cp_async_commit)
cp_async_wait = _public(_sim_cp_async_wait, lambda: _gpu_cp_async_wait)
cp_async_wait_all = _public(_sim_cp_async_wait_all, lambda: _gpu_cp_async_wait_all)
pack_f16x2 = _public(_sim_pack_f16x2, lambda: _make_gpu_pack("f16"))
pack_bf16x2 = _public(_sim_pack_bf16x2, lambda: _make_gpu_pack("bf16"))
unpack_f16x2 = _public(_sim_unpack_f16x2, lambda: _make_gpu_unpack("f16"))
unpack_bf16x2 = _public(_sim_unpack_bf16x2, lambda: _make_gpu_unpack("bf16"))
ex2_approx = _public(_sim_ex2_approx, lambda: _gpu_ex2_approx)
ex2_poly = _public(_sim_ex2_poly, lambda: _gpu_ex2_poly)
f32_after = _public(_sim_f32_after, lambda: _gpu_f32_after)
global_address = _public(_sim_global_address, lambda: _gpu_global_address)
pinned_u32 = _public(_sim_pinned_u32, lambda: _gpu_pinned_u32)
ld_global_v4_b32 = _public(_sim_ld_global_v4_b32, lambda: _make_gpu_ld_v4("b32"))
ld_global_v4_f32 = _public(_sim_ld_global_v4_f32, lambda: _make_gpu_ld_v4("f32"))
st_global_v4_b32 = _public(_sim_st_global_v4_b32, lambda: _gpu_st_global_v4_b32)
red_add_f32 = _public(_sim_red_add_f32, lambda: _gpu_red_add_f32)
st_global_b32 = _public(_sim_st_global_b32, lambda: _gpu_st_global_b32)
red_add_f32x2 = _public(_sim_red_add_f32x2, lambda: _gpu_red_add_f32x2)
red_add_f32x4 = _public(_sim_red_add_f32x4, lambda: _gpu_red_add_f32x4)
divmod_u32 = _public(_sim_divmod_u32, lambda: _gpu_divmod_u32)
