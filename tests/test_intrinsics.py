"""The tensor-core building blocks of :mod:`nbflash.intrinsics`, one warp at a time.

In the simulator (CI) each test launches a one-warp kernel that uses the
intrinsics exactly as a real kernel would — fragments indexed through the
layout helpers, tiles in shared memory — and compares with NumPy in float64.
The layouts themselves are checked against the PTX ISA's formulas, transcribed
here independently of the helpers.  Without a GPU, the same kernels are also
compiled for sm_80/sm_90 (NVVM), assembled by ptxas (nvJitLink) and, where
``nvdisasm`` can be found, disassembled to look for HMMA/LDSM/LDGSTS.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import pytest
from offline import TESTS, find_nvdisasm, offline_json_rows

from nbflash import intrinsics as I
from nbflash._device import SIMULATOR, cuda, device_function, kernel, numba

SMEM_ALIGN = None if SIMULATOR else 16  # ldmatrix / cp.async rows must be 16-byte aligned
KINDS = ["float16", "bfloat16"]


def to_bits(x, kind):
    """float array → 16-bit patterns (uint16) of ``kind``, and the exactly representable float64 values."""
    x = np.asarray(x, dtype=np.float32)
    bits = I.f32_to_f16_bits(x) if kind == "float16" else I.f32_to_bf16_bits(x)
    vals = I.f16_bits_to_f32(bits) if kind == "float16" else I.bf16_bits_to_f32(bits)
    return bits, vals.astype(np.float64)


def launch(kern, *args):
    """One block of one warp."""
    kern[1, 32](*args)


# ----------------------------------------------------------------------------
# The layout helpers against the PTX ISA text
# ----------------------------------------------------------------------------


def ptx_a(lane, i):
    """PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type", multiplicand A, element a_i."""
    group_id, tid_in_group = lane >> 2, lane % 4
    row = group_id if (0 <= i < 2 or 4 <= i < 6) else group_id + 8
    col = tid_in_group * 2 + (i & 0x1) if i < 4 else tid_in_group * 2 + (i & 0x1) + 8
    return row, col


def ptx_b(lane, i):
    """Same section, multiplicand B, element b_i."""
    group_id, tid_in_group = lane >> 2, lane % 4
    row = tid_in_group * 2 + (i & 0x1) if i < 2 else tid_in_group * 2 + (i & 0x1) + 8
    return row, group_id


def ptx_c(lane, i):
    """Same section, accumulators C/D, element c_i."""
    group_id, tid_in_group = lane >> 2, lane % 4
    row = group_id if i < 2 else group_id + 8
    return row, tid_in_group * 2 + (i & 0x1)


def test_fragment_helpers_match_ptx_isa():
    for lane in range(32):
        for i in range(8):
            assert I.a_frag_index(lane, i // 2, i % 2) == ptx_a(lane, i)
        for i in range(4):
            assert I.b_frag_index(lane, i // 2, i % 2) == ptx_b(lane, i)
            assert I.c_frag_index(lane, i) == ptx_c(lane, i)
    # Each layout covers its tile exactly once.
    for cells, shape in (
        ([I.a_frag_index(ln, r, h) for ln in range(32) for r in range(4) for h in range(2)], (16, 16)),
        ([I.b_frag_index(ln, r, h) for ln in range(32) for r in range(2) for h in range(2)], (16, 8)),
        ([I.c_frag_index(ln, i) for ln in range(32) for i in range(4)], (16, 8)),
    ):
        assert sorted(cells) == [(r, c) for r in range(shape[0]) for c in range(shape[1])]


def test_ldmatrix_addresses_cover_the_tile():
    for helper in (I.ldmatrix_x4_a_address, I.ldmatrix_x4_bt_address):
        starts = sorted(helper(lane) for lane in range(32))
        assert starts == sorted((r, c) for r in range(16) for c in (0, 8))
    # Lanes 8i..8i+7 give rows 0..7 of one 8×8 block (matrix i).
    for lane in range(32):
        r, c = I.ldmatrix_x4_a_address(lane)
        assert r % 8 == lane % 8


# ----------------------------------------------------------------------------
# mma.sync.m16n8k16
# ----------------------------------------------------------------------------


@device_function
def pack_pair(tile, idx0, idx1):
    """One fragment register: the 16-bit elements tile[idx0] (low half) and tile[idx1] (high half)."""
    return numba.uint32(tile[idx0]) | (numba.uint32(tile[idx1]) << 16)


@functools.cache
def mma_kernel(kind, swap_registers=False):
    """D = A·B + C with every fragment read from / written to global memory through the layout helpers.

    ``swap_registers`` passes A's registers 1 and 2 in the wrong order: the
    deliberately broken kernel the tests must catch.
    """
    mma = I.mma_m16n8k16_f16 if kind == "float16" else I.mma_m16n8k16_bf16
    R1, R2 = (2, 1) if swap_registers else (1, 2)

    @kernel
    def mma_tile(a, b, c, d):
        lane = cuda.threadIdx.x
        ra = cuda.local.array(4, numba.uint32)
        for r in range(4):
            ra[r] = pack_pair(a, I.d_a_frag_index(lane, r, 0), I.d_a_frag_index(lane, r, 1))
        rb = cuda.local.array(2, numba.uint32)
        for r in range(2):
            rb[r] = pack_pair(b, I.d_b_frag_index(lane, r, 0), I.d_b_frag_index(lane, r, 1))
        rc = cuda.local.array(4, numba.float32)
        for i in range(4):
            rc[i] = c[I.d_c_frag_index(lane, i)]
        out = mma(ra[0], ra[R1], ra[R2], ra[3], rb[0], rb[1], rc[0], rc[1], rc[2], rc[3])
        for i in range(4):
            d[I.d_c_frag_index(lane, i)] = out[i]

    return mma_tile


def check_mma(kind, rng, swap_registers=False):
    a_bits, a = to_bits(rng.standard_normal((16, 16)), kind)
    b_bits, b = to_bits(rng.standard_normal((16, 8)), kind)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, dtype=np.float32)
    launch(mma_kernel(kind, swap_registers), a_bits, b_bits, c, d)
    ref = a @ b + c
    # fp32 accumulation of 16 exact products: a few ulp of the magnitudes involved.
    tol = 1e-6 * (np.abs(a) @ np.abs(b) + np.abs(c))
    assert np.all(np.abs(d - ref) <= tol), f"max error {np.nanmax(np.abs(d - ref))}"


@pytest.mark.parametrize("kind", KINDS)
def test_mma_matches_numpy(rng, kind):
    check_mma(kind, rng)


@pytest.mark.parametrize("kind", KINDS)
def test_mma_test_catches_a_wrong_fragment(rng, kind):
    with pytest.raises(AssertionError):
        check_mma(kind, rng, swap_registers=True)


# ----------------------------------------------------------------------------
# ldmatrix (.trans) feeding mma
# ----------------------------------------------------------------------------

PITCH = 24  # row pitch of the shared tiles (elements): 48 bytes, so rows stay 16-byte aligned
A_OFF, B_OFF, BT_OFF, LD_SMEM = 0, 16 * PITCH, 32 * PITCH, 48 * PITCH  # three tiles (elements)


@functools.cache
def ldmatrix_kernel(kind):
    """Load A, B (k-major) and Bᵀ (n-major) 16×16 tiles into shared memory; ldmatrix them; two mma n-tiles each.

    regs[0] = A registers (ldmatrix_x4), regs[1] = B registers from B via
    ldmatrix_x4_trans, regs[2] = B registers from Bᵀ via ldmatrix_x4;
    d_trans = A·B + C through regs[1], d_bt = A·B + C through regs[2].
    """
    mma = I.mma_m16n8k16_f16 if kind == "float16" else I.mma_m16n8k16_bf16

    @kernel
    def ldmatrix_tiles(a, b, bt, c, regs, d_trans, d_bt):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(LD_SMEM, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(lane, 256, 32):
            r = e // 16
            col = e % 16
            smem[A_OFF + r * PITCH + col] = a[r, col]
            smem[B_OFF + r * PITCH + col] = b[r, col]
            smem[BT_OFF + r * PITCH + col] = bt[r, col]
        cuda.syncthreads()  # the tiles are complete before any lane reads another's rows

        row, col = I.d_ldmatrix_x4_a_address(lane)
        qa = I.ldmatrix_x4(smem, A_OFF + row * PITCH + col)
        vb = I.ldmatrix_x4_trans(smem, B_OFF + row * PITCH + col)
        row, col = I.d_ldmatrix_x4_bt_address(lane)
        kb = I.ldmatrix_x4(smem, BT_OFF + row * PITCH + col)
        for i in range(4):
            regs[0, lane, i] = qa[i]
            regs[1, lane, i] = vb[i]
            regs[2, lane, i] = kb[i]

        for j in range(2):  # n-tiles: columns 8j .. 8j + 7
            c0 = c[I.d_c_frag_index(lane, 0)[0], 8 * j + I.d_c_frag_index(lane, 0)[1]]
            c1 = c[I.d_c_frag_index(lane, 1)[0], 8 * j + I.d_c_frag_index(lane, 1)[1]]
            c2 = c[I.d_c_frag_index(lane, 2)[0], 8 * j + I.d_c_frag_index(lane, 2)[1]]
            c3 = c[I.d_c_frag_index(lane, 3)[0], 8 * j + I.d_c_frag_index(lane, 3)[1]]
            dt = mma(qa[0], qa[1], qa[2], qa[3], vb[2 * j], vb[2 * j + 1], c0, c1, c2, c3)
            dk = mma(qa[0], qa[1], qa[2], qa[3], kb[2 * j], kb[2 * j + 1], c0, c1, c2, c3)
            for i in range(4):
                row, col = I.d_c_frag_index(lane, i)
                d_trans[row, 8 * j + col] = dt[i]
                d_bt[row, 8 * j + col] = dk[i]

    return ldmatrix_tiles


def expected_a_words(a_bits):
    w = np.zeros((32, 4), dtype=np.uint32)
    for lane in range(32):
        for r in range(4):
            lo, hi = a_bits[I.a_frag_index(lane, r, 0)], a_bits[I.a_frag_index(lane, r, 1)]
            w[lane, r] = int(lo) | (int(hi) << 16)
    return w


def expected_b_words(b_bits):
    """B registers of the two n-tiles of a 16×16 (k × n) tile: (b0, b1) of n 0..7, then of n 8..15."""
    w = np.zeros((32, 4), dtype=np.uint32)
    for lane in range(32):
        for j in range(2):
            for r in range(2):
                (k0, n), (k1, _) = I.b_frag_index(lane, r, 0), I.b_frag_index(lane, r, 1)
                w[lane, 2 * j + r] = int(b_bits[k0, 8 * j + n]) | (int(b_bits[k1, 8 * j + n]) << 16)
    return w


@pytest.mark.parametrize("kind", KINDS)
def test_ldmatrix_feeds_mma(rng, kind):
    a_bits, a = to_bits(rng.standard_normal((16, 16)), kind)
    b_bits, b = to_bits(rng.standard_normal((16, 16)), kind)
    c = rng.standard_normal((16, 16)).astype(np.float32)
    regs = np.zeros((3, 32, 4), dtype=np.uint32)
    d_trans = np.full((16, 16), np.nan, dtype=np.float32)
    d_bt = np.full((16, 16), np.nan, dtype=np.float32)
    launch(ldmatrix_kernel(kind), a_bits, b_bits, np.ascontiguousarray(b_bits.T), c, regs, d_trans, d_bt)

    np.testing.assert_array_equal(regs[0], expected_a_words(a_bits))  # ldmatrix_x4 → A fragment
    np.testing.assert_array_equal(regs[1], expected_b_words(b_bits))  # ldmatrix_x4_trans of B → B fragment
    np.testing.assert_array_equal(regs[2], expected_b_words(b_bits))  # ldmatrix_x4 of Bᵀ → B fragment
    ref = a @ b + c
    tol = 1e-6 * (np.abs(a) @ np.abs(b) + np.abs(c))
    assert np.all(np.abs(d_trans - ref) <= tol)
    assert np.all(np.abs(d_bt - ref) <= tol)


def test_ldmatrix_rejects_a_misaligned_row():
    if not SIMULATOR:
        pytest.skip("the alignment check is the simulator's (misaligned ldmatrix is undefined on the GPU)")

    @kernel
    def misaligned(out):
        smem = cuda.shared.array(16 * PITCH, numba.uint16)
        row, col = I.d_ldmatrix_x4_a_address(cuda.threadIdx.x)
        out[cuda.threadIdx.x] = I.ldmatrix_x4(smem, row * PITCH + col + 1)[0]

    with pytest.raises(ValueError, match="16-byte aligned"):
        launch(misaligned, np.zeros(32, dtype=np.uint32))


# ----------------------------------------------------------------------------
# cp.async with zero-fill
# ----------------------------------------------------------------------------

CP_ROWS, CP_D, CP_PITCH = 8, 16, 24
CP_SMEM = CP_ROWS * CP_PITCH
CP_SMEM_2 = 2 * CP_SMEM  # two such tiles (cp_async_at_kernel)
SENTINEL = 0xAAAA


@functools.cache
def cp_async_kernel():
    """Copy rows [0, seqlen) of src[b, :, h] into an 8-row shared tile, zero-filling the rest.

    Each of 16 lanes copies one 16-byte chunk (8 elements): full rows through
    the plain form, the last row's second chunk with ``src_bytes = tail_bytes``
    (a ragged tail), rows past ``seqlen`` with ``src_bytes = 0`` (their source
    index clamped to a valid row, as real kernels must).
    """

    @kernel
    def cp_async_tile(src, b, h, seqlen, tail_bytes, out):  # src: (batch, seq, head, dim)
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(CP_SMEM, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(lane, CP_SMEM, 32):
            smem[e] = SENTINEL  # so that a missing zero-fill shows
        cuda.syncthreads()
        if lane < 2 * CP_ROWS:
            row = lane // 2
            col = (lane % 2) * 8
            dst = row * CP_PITCH + col
            src_row = min(row, seqlen - 1)
            if row < seqlen - 1 or (row == seqlen - 1 and col == 0):
                I.cp_async_16(smem, dst, src, (b, src_row, h, col))
            elif row == seqlen - 1:
                I.cp_async_16(smem, dst, src, (b, src_row, h, col), tail_bytes)
            else:
                I.cp_async_16(smem, dst, src, (b, src_row, h, col), 0)
        I.cp_async_commit()
        I.cp_async_wait(0)
        I.cp_async_wait_all()
        cuda.syncthreads()  # cp.async data is visible to other threads after the wait and a barrier
        for e in range(lane, CP_ROWS * CP_D, 32):
            out[e // CP_D, e % CP_D] = smem[(e // CP_D) * CP_PITCH + e % CP_D]

    return cp_async_tile


@pytest.mark.parametrize("seqlen,tail_bytes", [(5, 10), (8, 16), (1, 2), (3, 0)])
def test_cp_async_zero_fills_ragged_tail(rng, seqlen, tail_bytes):
    # A (batch, seq, head, dim) array: rows of one head are H·D elements apart.
    src = rng.integers(0, 2**16, size=(2, seqlen, 3, CP_D), dtype=np.uint16)
    out = np.zeros((CP_ROWS, CP_D), dtype=np.uint16)
    launch(cp_async_kernel(), src, 1, 2, seqlen, tail_bytes, out)
    expect = np.zeros((CP_ROWS, CP_D), dtype=np.uint16)
    expect[:seqlen] = src[1, :, 2]
    expect[seqlen - 1, 8 + tail_bytes // 2 :] = 0
    np.testing.assert_array_equal(out, expect)


@functools.cache
def cp_async_at_kernel():
    """The tile of :func:`cp_async_kernel` through ``cp_async_16_at``: one global address per lane, computed
    once from a (pinned) row index, and the lane's next row reached by adding the row stride in bytes.

    Lanes 0..15 own chunk ``lane % 2`` of rows ``lane // 2`` and ``lane // 2 + 8`` of a 16-row tile; rows
    past ``seqlen`` copy 0 bytes (their address is not read, and the kernel does not clamp it: that is the
    zero-fill contract, and the simulator's address object fails a read outside the array)."""

    @kernel
    def cp_async_at_tile(src, b, h, seqlen, out):  # src: (batch, seq, head, dim)
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(CP_SMEM_2, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(lane, CP_SMEM_2, 32):
            smem[e] = SENTINEL
        cuda.syncthreads()
        if lane < 2 * CP_ROWS:
            row = numba.int64(I.pinned_u32(lane)) // 2
            col = (lane % 2) * 8
            address = I.global_address(src, (b, min(row, seqlen - 1), h, col))
            step = src.strides[1] * CP_ROWS  # bytes from row r to row r + 8
            for half in range(2):
                r = row + half * CP_ROWS
                nbytes = 16 if r < seqlen else 0
                I.cp_async_16_at(smem, r * CP_PITCH + col, address + half * step, nbytes)
        I.cp_async_commit()
        I.cp_async_wait_all()
        cuda.syncthreads()  # the copies are visible to other threads after the wait and a barrier
        for e in range(lane, 2 * CP_ROWS * CP_D, 32):
            out[e // CP_D, e % CP_D] = smem[(e // CP_D) * CP_PITCH + e % CP_D]

    return cp_async_at_tile


@pytest.mark.parametrize("seqlen", [16, 11, 8, 3])
def test_cp_async_at_copies_rows_by_address(rng, seqlen):
    """Rows below seqlen arrive from the address plus row strides; the rest are zero-filled; a strided source."""
    src = rng.integers(1, 2**16, size=(2, max(seqlen, 9), 3, CP_D), dtype=np.uint16)
    out = np.zeros((2 * CP_ROWS, CP_D), dtype=np.uint16)
    launch(cp_async_at_kernel(), src, 1, 2, seqlen, out)
    expect = np.zeros((2 * CP_ROWS, CP_D), dtype=np.uint16)
    expect[:seqlen] = src[1, :seqlen, 2]
    np.testing.assert_array_equal(out, expect)


@functools.cache
def cp_async_at_one_kernel():
    """One thread: 16 bytes from ``src[row, col]`` plus ``extra`` bytes to ``smem[dst]``, then to ``out``."""

    @kernel
    def cp_async_at_one(src, row, col, extra, dst, nbytes, out):
        smem = cuda.shared.array(64, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(64):
            smem[e] = SENTINEL
        I.cp_async_16_at(smem, dst, I.global_address(src, (row, col)) + extra, nbytes)
        I.cp_async_commit()
        I.cp_async_wait_all()
        for e in range(64):
            out[e] = smem[e]

    return cp_async_at_one


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's address checks")
def test_cp_async_at_rejects_reads_outside_or_misaligned():
    src = np.arange(1, 4 * CP_D + 1, dtype=np.uint16).reshape(4, CP_D)
    out = np.zeros(64, dtype=np.uint16)
    k = cp_async_at_one_kernel()
    k[1, 1](src, 3, 8, 0, 8, 16, out)  # the array's last chunk
    np.testing.assert_array_equal(out[8:16], src[3, 8:])
    assert (out[:8] == SENTINEL).all() and (out[16:] == SENTINEL).all()
    with pytest.raises(IndexError):
        k[1, 1](src, 3, 8, 16, 0, 16, out)  # one chunk past the end
    with pytest.raises(ValueError, match="aligned"):
        k[1, 1](src, 0, 1, 0, 0, 16, out)  # a misaligned source
    with pytest.raises(ValueError, match="aligned"):
        k[1, 1](src, 0, 0, 0, 3, 16, out)  # a misaligned destination
    k[1, 1](src, 3, 8, 10**6, 0, 0, out)  # 0 bytes: the source is not read, 16 zero bytes land
    assert not out[:8].any() and (out[8:] == SENTINEL).all()


@functools.cache
def cp_async_4_kernel():
    """Lane ``c`` of 32 copies ``src[b, h, start + c]`` (float32) to ``smem[c + 1]`` with ``cp_async_4``, 0 past
    ``seqlen`` (its source index clamped, 0 bytes read); the tile starts one word into shared memory (only 4-byte
    alignment is needed) and lands in the same group as a 16-byte copy of the sentinel-free ``pad`` row."""

    @kernel
    def cp_async_4_tile(src, b, h, start, seqlen, pad, out, out_pad):  # src: (batch, head, seq) float32
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(40, numba.float32, alignment=SMEM_ALIGN)
        for e in range(lane, 40, 32):
            smem[e] = numba.float32(-7.0)  # so that a missing copy or zero-fill shows
        cuda.syncthreads()
        row = start + lane
        inside = row < seqlen
        I.cp_async_4(smem, 1 + lane, src, (b, h, row if inside else seqlen - 1), 4 if inside else 0)
        if lane == 0:
            I.cp_async_16(smem, 36, pad, (0,))
        I.cp_async_commit()
        I.cp_async_wait_all()
        cuda.syncthreads()  # the copies are visible to other threads after the wait and a barrier
        out[lane] = smem[1 + (lane + 1) % 32]  # another lane's value
        if lane < 4:
            out_pad[lane] = smem[36 + lane]
        if lane == 0:
            out_pad[4] = smem[0]  # untouched

    return cp_async_4_tile


@pytest.mark.parametrize("start,seqlen", [(0, 40), (16, 40), (24, 30), (0, 1)])
def test_cp_async_4_copies_values_and_zero_fills(rng, start, seqlen):
    """One float32 per lane from a strided row (lse2 of a query tile in the backward), 0 past the end."""
    src = rng.standard_normal((2, 3, seqlen)).astype(np.float32)
    pad = rng.standard_normal(4).astype(np.float32)
    out, out_pad = np.zeros(32, np.float32), np.zeros(5, np.float32)
    launch(cp_async_4_kernel(), src, 1, 2, start, seqlen, pad, out, out_pad)
    want = np.zeros(32, np.float32)
    n = max(0, min(32, seqlen - start))
    want[:n] = src[1, 2, start : start + n]
    np.testing.assert_array_equal(out, np.roll(want, -1))
    np.testing.assert_array_equal(out_pad, [*pad, -7.0])


# ----------------------------------------------------------------------------
# Packing, unpacking, ex2
# ----------------------------------------------------------------------------


@functools.cache
def convert_kernel():
    @kernel
    def convert(x, packed, unpacked, e2):
        lane = cuda.threadIdx.x
        p = I.pack_f16x2(x[lane, 0], x[lane, 1])
        q = I.pack_bf16x2(x[lane, 0], x[lane, 1])
        packed[lane, 0] = p
        packed[lane, 1] = q
        lo, hi = I.unpack_f16x2(p)
        unpacked[lane, 0] = lo
        unpacked[lane, 1] = hi
        lo, hi = I.unpack_bf16x2(q)
        unpacked[lane, 2] = lo
        unpacked[lane, 3] = hi
        e2[lane] = I.ex2_approx(x[lane, 0])

    return convert


def ref_f16_bits(x):
    """Round to nearest even through CPython's own half-float packing (independent of NumPy)."""
    x = float(x)
    if np.isnan(x):
        return None
    try:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError:  # past the largest half (plus half an ulp): the cast gives inf
        return 0xFC00 if x < 0 else 0x7C00


def ref_bf16_bits(x):
    """Round to nearest even by choosing the nearer of the two bfloat16 neighbours (ties: even mantissa)."""
    x32 = np.float32(x)
    bits = int(np.array(x32).view(np.uint32))
    lo = bits >> 16
    hi = lo + 1

    def value(b):  # the all-ones exponent rounds like the next binade: 2**128
        mag = b & 0x7FFF
        v = 2.0**128 if mag == 0x7F80 else float(np.array(mag << 16, dtype=np.uint32).view(np.float32))
        return -v if b & 0x8000 else v

    if bits & 0xFFFF == 0:
        return lo
    d_lo, d_hi = abs(float(x32) - value(lo)), abs(float(x32) - value(hi))
    return lo if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0) else hi


SPECIAL = [0.0, -0.0, 1.0, -2.5, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65504.0, 65519.0,
           65520.0, 1e5, 6e-8, 3e-8, 1e-40, 3.3895e38, 3.4e38, np.inf, -np.inf, 2.0**-126, -150.0, 127.9]


def test_packs_are_bit_exact_and_unpack_inverts(rng):
    x = rng.standard_normal(64).astype(np.float32) * np.float32(100)
    x[: len(SPECIAL)] = SPECIAL
    x = x.reshape(32, 2)
    packed = np.zeros((32, 2), dtype=np.uint32)
    unpacked = np.zeros((32, 4), dtype=np.float32)
    e2 = np.zeros(32, dtype=np.float32)
    launch(convert_kernel(), x, packed, unpacked, e2)

    lo16 = (packed & 0xFFFF).astype(np.uint16)
    hi16 = (packed >> 16).astype(np.uint16)
    for lane in range(32):
        for half, bits in ((0, lo16), (1, hi16)):  # the first argument lands in the low half
            assert bits[lane, 0] == ref_f16_bits(x[lane, half]), (x[lane, half], hex(bits[lane, 0]))
            assert bits[lane, 1] == ref_bf16_bits(x[lane, half]), (x[lane, half], hex(bits[lane, 1]))
    np.testing.assert_array_equal(unpacked[:, 0:2], I.f16_bits_to_f32(np.stack([lo16[:, 0], hi16[:, 0]], 1)))
    np.testing.assert_array_equal(unpacked[:, 2:4], I.bf16_bits_to_f32(np.stack([lo16[:, 1], hi16[:, 1]], 1)))

    # ex2.approx: within 2 ulp of 2**x; results below the normal range flush to 0, above it overflow to inf.
    f32 = np.finfo(np.float32)
    with np.errstate(over="ignore"):
        ref = np.exp2(x[:, 0].astype(np.float64))
    normal = (ref >= f32.tiny) & (ref <= f32.max)
    ulp = np.spacing(ref[normal].astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(e2[normal] - ref[normal]) <= 2 * ulp)
    assert np.all(e2[ref < f32.tiny] == 0)
    assert np.all(e2[ref > f32.max] == np.inf)
    assert normal.sum() > 10 and (ref < f32.tiny).sum() >= 2 and (ref > f32.max).sum() >= 2


@functools.cache
def ex2_poly_kernel():
    @kernel
    def ex2_poly(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = I.ex2_poly(x[i])

    return ex2_poly


def test_ex2_poly_matches_exp2_and_maps_minus_inf_to_zero(rng):
    """The polynomial exponential (FlashAttention-4's split of the softmax's exponentials): within the fitted
    relative error (2.9e-6, a few float32 roundings on top) wherever 2**x is a normal number past 2^-125;
    exactly +0 for -inf (a masked score) and -127, a non-negative tiny value below; the simulator's emulation's
    bits on the GPU, up to an ulp (its FMAs round twice, rarely)."""
    special = np.float32([-np.inf, -1000.0, -127.0, -126.75, -126.5, -126.0, -125.0, -0.5, -0.25, 0.0, 0.25, 0.5,
                          1.0, 7.999, 8.0, 100.0, 126.9, -1e-30, 1e-30])
    grid = np.linspace(-130, 10, 4096, dtype=np.float32)
    x = np.concatenate([special, grid, (rng.standard_normal(1024) * 10).astype(np.float32)])
    out = np.zeros(x.size, np.float32)
    ex2_poly_kernel()[-(-x.size // 128), 128](x, out)
    ref = np.exp2(x.astype(np.float64))
    got = out.astype(np.float64)
    normal = x >= -125
    assert np.all(np.abs(got[normal] / ref[normal] - 1) <= 3.2e-6)
    assert got[0] == 0 and got[1] == 0 and got[2] == 0 and not np.signbit(out[0])
    assert np.all((got[~normal] >= 0) & (got[~normal] <= 2.0**-124))
    assert got[9] == 1.0 and got[10] != got[9]  # 2**0 exactly; x = 0.25 is not 1
    sim = np.array([I._sim_ex2_poly(v) for v in x], dtype=np.float32)
    assert np.all(np.abs(got - sim) <= np.spacing(np.abs(sim)).astype(np.float64))


# ----------------------------------------------------------------------------
# Global float32 reductions: red.global.add.f32 and red.global.add.v2.f32
# ----------------------------------------------------------------------------

RED_SHAPE = (2, 3, 4, 16)  # (batch, heads, rows, columns) float32, as dq_accum


@functools.cache
def red_kernel(vector):
    """Every lane adds x[block, lane, 0..3] to columns 2p, 2p + 1, 8 + 2p, 9 + 2p of row (lane % 4) of acc[b, h].

    p = (lane // 4) % 4, so lanes ``lane`` and ``lane + 16`` of both blocks hit the
    same elements: four-way contention.  The row's address is computed once;
    the second pair is 32 bytes (8 columns) on, as the tiles of an ``mma``
    accumulator.  ``vector``: one ``red_add_f32x2`` per pair, else two ``red_add_f32``.
    """

    @kernel
    def red_add(acc, b, h, x):
        lane = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        addr = I.global_address(acc, (b, h, lane % 4, 2 * (lane // 4 % 4)))
        for n in range(2):
            if vector:
                I.red_add_f32x2(addr + 32 * n, x[blk, lane, 2 * n], x[blk, lane, 2 * n + 1])
            else:
                I.red_add_f32(addr + 32 * n, x[blk, lane, 2 * n])
                I.red_add_f32(addr + 32 * n + 4, x[blk, lane, 2 * n + 1])

    return red_add


def expected_red(acc, b, h, x):
    want = acc.astype(np.float64)
    for blk in range(x.shape[0]):
        for lane in range(32):
            row, col = lane % 4, 2 * (lane // 4 % 4)
            for n in range(2):
                for c in range(2):
                    want[b, h, row, col + 8 * n + c] += x[blk, lane, 2 * n + c]
    return want


@pytest.mark.parametrize("vector", [True, False], ids=["v2", "scalar"])
def test_red_add_accumulates_every_lane(rng, vector):
    if vector and not SIMULATOR and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("red.global.add.v2.f32 needs sm_90")
    acc = rng.integers(-8, 8, size=RED_SHAPE).astype(np.float32)
    x = (rng.integers(-64, 64, size=(2, 32, 4)) / 8).astype(np.float32)  # sums exact in any order
    want = expected_red(acc, 1, 2, x)
    red_kernel(vector)[2, 32](acc, 1, 2, x)
    np.testing.assert_array_equal(acc, want)  # every other (batch, head, row, column) untouched


def test_red_add_flushes_subnormals(rng):
    """red.add.f32 flushes subnormal inputs to zero (``.ftz``, as the SASS says), keeps normal ones."""
    acc = np.zeros(RED_SHAPE, dtype=np.float32)
    x = np.zeros((1, 32, 4), dtype=np.float32)
    x[0, 0] = [1e-40, 1.0, 2.0**-24, -1e-39]  # subnormal, normal, normal (below 1's ulp), subnormal
    red_kernel(False)[1, 32](acc, 0, 0, x)
    assert acc[0, 0, 0, 0] == 0 and acc[0, 0, 0, 1] == 1 and acc[0, 0, 0, 8] == 2.0**-24 and acc[0, 0, 0, 9] == 0


def test_red_add_rejects_misaligned_or_outside_addresses():
    if not SIMULATOR:
        pytest.skip("the checks are the simulator's (on the GPU these are undefined behaviour)")

    @kernel
    def misaligned(acc):
        I.red_add_f32x2(I.global_address(acc, (0, 0, 0, 1)), 1.0, 2.0)  # column 1: 4 bytes past an 8-byte boundary

    @kernel
    def outside(acc):
        I.red_add_f32(I.global_address(acc, (0, 0, 0, 0)) + 4 * acc.size, 1.0)  # one element past the end

    acc = np.zeros(RED_SHAPE, dtype=np.float32)
    with pytest.raises(ValueError, match="8-byte aligned"):
        misaligned[1, 1](acc)
    with pytest.raises(IndexError, match="not an element"):
        outside[1, 1](acc)
    assert not acc.any()
# red.global.add.v4.f32: four float32 additions to global memory, each atomic
# ----------------------------------------------------------------------------


@functools.cache
def red4_kernel():
    @kernel
    def red(acc, vals):
        # Lane l adds its four values to row l % 2, columns 4·((l // 2) % 4) … + 3: four lanes share each run.
        lane = cuda.threadIdx.x
        I.red_add_f32x4(acc, (lane % 2, 4 * ((lane // 2) % 4)), vals[lane, 0], vals[lane, 1], vals[lane, 2],
                        vals[lane, 3])

    return red


def test_red_add_f32x4_adds_every_lane(rng):
    vals = rng.integers(-8, 8, size=(32, 4)).astype(np.float32)  # small integers: sums exact in any order
    acc = np.ones((2, 16), np.float32)
    red4_kernel()[1, 32](acc, vals)
    want = np.ones((2, 16), np.float32)
    for lane in range(32):
        col = 4 * ((lane // 2) % 4)
        want[lane % 2, col:col + 4] += vals[lane]
    np.testing.assert_array_equal(acc, want)


@functools.cache
def store_pairs_kernel():
    """Lane l packs (x[l, 0], x[l, 1]) to bfloat16 and stores the pair at row l // 4, columns 2·(l % 4) + {0, 1}
    of out[1, :, 2, :] (a (batch, seq, head, dim) array): one row address, then constant byte offsets."""

    @kernel
    def store_pairs(x, out):
        lane = cuda.threadIdx.x
        address = I.global_address(out, (1, lane // 4, 2, 0))
        I.st_global_b32(address + 4 * (lane % 4), I.pack_bf16x2(x[lane, 0], x[lane, 1]))

    return store_pairs


def test_st_global_b32_stores_packed_pairs(rng):
    x = rng.standard_normal((32, 2)).astype(np.float32)
    out = np.full((2, 8, 3, 8), SENTINEL, dtype=np.uint16)
    launch(store_pairs_kernel(), x, out)
    want = np.full_like(out, SENTINEL)
    want[1, :, 2, :] = I.f32_to_bf16_bits(x).reshape(8, 8)  # lane 4g + t: row g, columns 2t, 2t + 1
    np.testing.assert_array_equal(out, want)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's address checks")
def test_st_global_b32_rejects_misaligned_or_outside():
    out = np.zeros((4, 8), dtype=np.uint16)
    with pytest.raises(ValueError, match="aligned"):
        I.st_global_b32(I.global_address(out, (0, 1)), 7)
    with pytest.raises(IndexError):
        I.st_global_b32(I.global_address(out, (3, 6)) + 4, 7)
    I.st_global_b32(I.global_address(out, (3, 6)), 0x00020001)  # the last pair: low half first
    assert out[3, 6] == 1 and out[3, 7] == 2 and out.sum() == 3


@functools.cache
def vector_copy_kernel():
    """Thread l copies the 16 bytes of src[1, l // 2, 8·(l % 2) : 8·(l % 2) + 8] (uint16) to the same place of
    dst by one ld.global.v4.b32 and one st.global.v4.b32, and row l of the float32 f by one ld.global.v4.f32
    into row l of g, element by element."""

    @kernel
    def vector_copy(src, dst, f, g):
        lane = cuda.threadIdx.x
        w0, w1, w2, w3 = I.ld_global_v4_b32(I.global_address(src, (1, lane // 2, 8 * (lane % 2))))
        I.st_global_v4_b32(I.global_address(dst, (1, lane // 2, 8 * (lane % 2))), w0, w1, w2, w3)
        x0, x1, x2, x3 = I.ld_global_v4_f32(I.global_address(f, (lane, 0)))
        g[lane, 0] = x0
        g[lane, 1] = x1
        g[lane, 2] = x2
        g[lane, 3] = x3

    return vector_copy


def test_vector_loads_and_stores_move_16_bytes(rng):
    src = rng.integers(0, 2**16, size=(2, 4, 16), dtype=np.uint16)
    dst = np.full_like(src, SENTINEL)
    f = rng.standard_normal((8, 4)).astype(np.float32)
    g = np.full_like(f, np.nan)
    vector_copy_kernel()[1, 8](src, dst, f, g)
    want = np.full_like(src, SENTINEL)
    want[1] = src[1]
    np.testing.assert_array_equal(dst, want)
    np.testing.assert_array_equal(g, f)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's address checks")
def test_vector_loads_and_stores_reject_misaligned_or_outside():
    a = np.arange(64, dtype=np.uint16).reshape(4, 16)
    with pytest.raises(ValueError, match="aligned"):
        I.ld_global_v4_b32(I.global_address(a, (0, 4)))  # 8 bytes in
    with pytest.raises(ValueError, match="aligned"):
        I.st_global_v4_b32(I.global_address(a, (1, 2)), 1, 2, 3, 4)
    with pytest.raises(IndexError):
        I.ld_global_v4_b32(I.global_address(a, (3, 8)) + 16)  # past the end
    w = I.ld_global_v4_b32(I.global_address(a, (2, 8)))
    assert [int(x) for x in w] == [int(a[2, 8 + 2 * i]) | int(a[2, 9 + 2 * i]) << 16 for i in range(4)]
    I.st_global_v4_b32(I.global_address(a, (0, 0)), 0x00020001, 0, 0, 0x00080007)  # low half first
    assert list(a[0, :8]) == [1, 2, 0, 0, 0, 0, 7, 8]


@functools.cache
def shared_vector_kernel():
    """Lane l writes element l·8 + e of a 256-element shared buffer (e = 0 … 7, a uint16 each), then reads chunk
    31 − l (the 16 bytes another lane wrote) by one ld.shared.v4.b32 into row l of ``out``."""

    @kernel
    def shared_vector(src, out):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(256, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(8):
            smem[8 * lane + e] = src[8 * lane + e]
        cuda.syncthreads()  # every lane's elements are visible before others read them
        w = I.ld_shared_v4_b32(smem, 8 * (31 - lane))
        for i in range(4):
            out[lane, i] = w[i]

    return shared_vector


def test_ld_shared_v4_reads_16_bytes_low_half_first(rng):
    src = rng.integers(0, 2**16, size=256, dtype=np.uint16)
    out = np.zeros((32, 4), dtype=np.uint32)
    shared_vector_kernel()[1, 32](src, out)
    want = src.reshape(32, 4, 2).astype(np.uint32)
    np.testing.assert_array_equal(out, (want[..., 0] | want[..., 1] << 16)[::-1])


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's alignment check")
def test_ld_shared_v4_rejects_a_misaligned_address():
    with pytest.raises(ValueError, match="aligned"):
        I.ld_shared_v4_b32(np.zeros(64, dtype=np.uint16), 4)  # 8 bytes in


# ----------------------------------------------------------------------------
# Offline GPU compilation: NVVM → PTX → ptxas (→ SASS), no GPU needed
# ----------------------------------------------------------------------------


def compile_targets():
    """``(name, kernel, signature, instructions its PTX must contain)`` for every test kernel above.

    Every one must assemble for sm_80 and sm_90, except those in :data:`SM90_ONLY`,
    which ptxas must refuse for sm_80.
    """
    from numba import types

    u16, u32, f32, i64 = types.uint16, types.uint32, types.float32, types.int64

    def arr(dt, nd, layout="C"):
        return types.Array(dt, nd, layout)

    out = []
    for kind, ptx_kind in (("float16", "f16"), ("bfloat16", "bf16")):
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_kind}.{ptx_kind}.f32"
        out.append((f"mma_{kind}", mma_kernel(kind), (arr(u16, 2), arr(u16, 2), arr(f32, 2), arr(f32, 2)), [mma]))
        out.append((f"ldmatrix_{kind}", ldmatrix_kernel(kind),
                    (arr(u16, 2), arr(u16, 2), arr(u16, 2), arr(f32, 2), arr(u32, 3), arr(f32, 2), arr(f32, 2)),
                    [mma, "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                     "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"]))
    out.append(("cp_async", cp_async_kernel(), (arr(u16, 4), types.int64, types.int64, types.int64, types.int64,
                                                arr(u16, 2)),
                ["cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0", "cp.async.wait_all"]))
    out.append(("cp_async_at", cp_async_at_kernel(), (arr(u16, 4, "A"), i64, i64, i64, arr(u16, 2)),
                ["cp.async.cg.shared.global", "mov.b32"]))
    out.append(("cp_async_4", cp_async_4_kernel(),
                (arr(f32, 3), i64, i64, i64, i64, arr(f32, 1), arr(f32, 1), arr(f32, 1)),
                ["cp.async.ca.shared.global", "cp.async.cg.shared.global"]))
    out.append(("st_global_b32", store_pairs_kernel(), (arr(f32, 2), arr(u16, 4, "A")), ["st.global.b32"]))
    out.append(("vector_copy", vector_copy_kernel(), (arr(u16, 3, "A"), arr(u16, 3, "A"), arr(f32, 2), arr(f32, 2)),
                ["ld.global.v4.b32", "st.global.v4.b32", "ld.global.v4.f32"]))
    out.append(("shared_vector", shared_vector_kernel(), (arr(u16, 1), arr(u32, 2)), ["ld.shared.v4.b32"]))
    out.append(("convert", convert_kernel(), (arr(f32, 2), arr(u32, 2), arr(f32, 2), arr(f32, 1)),
                ["cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32", "ex2.approx.ftz.f32"]))
    out.append(("ex2_poly", ex2_poly_kernel(), (arr(f32, 1), arr(f32, 1)),
                ["max.f32", "add.rn.f32", "fma.rn.f32", "shl.b32"]))
    red_sig = (arr(f32, 4, "A"), i64, i64, arr(f32, 3))
    out.append(("red_scalar", red_kernel(False), red_sig, ["red.global.add.f32", "cvta.to.global"]))
    out.append(("red_v2", red_kernel(True), red_sig, ["red.global.add.v2.f32"]))
    out.append(("red_v4", red4_kernel(), (arr(f32, 2), arr(f32, 2)), ["red.global.add"]))  # .v4.f32 on sm_90
    return out


SM90_ONLY = {"red_v2"}  # red.global.add.v2.f32: PTX ISA 8.1, sm_90


# The SASS each kernel must show (when nvdisasm is available).
SASS = {
    "mma_float16": ["HMMA.16816.F32"],
    "mma_bfloat16": ["HMMA.16816.F32.BF16"],
    "ldmatrix_float16": ["LDSM.16.M88.4", "LDSM.16.MT88.4", "HMMA.16816.F32"],
    "ldmatrix_bfloat16": ["LDSM.16.M88.4", "LDSM.16.MT88.4", "HMMA.16816.F32.BF16"],
    "cp_async": ["LDGSTS", "LDGSTS.E.BYPASS.128.ZFILL", "LDGDEPBAR", "DEPBAR"],
    "cp_async_at": ["LDGSTS.E.BYPASS.128"],
    "cp_async_4": ["LDGSTS.E", "LDGSTS.E.BYPASS.128"],
    "st_global_b32": ["STG.E"],  # a 0-or-16 byte count becomes a predicate, not .ZFILL
    "vector_copy": ["LDG.E.128", "STG.E.128"],
    "shared_vector": ["LDS.128"],
    "convert": ["F2FP.F16.F32.PACK_AB", "F2FP.BF16.F32.PACK_AB", "MUFU.EX2"],
    "ex2_poly": ["FFMA", "FMNMX"],  # on the FMA and integer units ...
    "red_scalar": ["REDG.E.ADD.F32.FTZ.RN"],  # a global reduction: no ATOM, no generic-address (QSPC) fallback
    "red_v2": ["REDG.E.ADD.F32x2.FTZ.RN"],
    "red_v4": ["REDG.E.ADD"],  # REDG.E.ADD.F32x4 on sm_90
}
FORBIDDEN_SASS = {"red_scalar": ["ATOM", "QSPC"], "red_v2": ["ATOM", "QSPC"], "ex2_poly": ["MUFU"]}  # ... not MUFU

_OFFLINE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
nvdisasm = sys.argv[2] or None
import test_intrinsics as t
from nbflash._device import SIMULATOR, compile_ptx_offline, ptxas_info
assert not SIMULATOR

for name, kern, sig, instructions in t.compile_targets():
    for cc in ((8, 0), (9, 0)):
        ptx = compile_ptx_offline(kern.py_func, sig, cc=cc)
        arch = f"sm_{cc[0]}{cc[1]}"
        if name in t.SM90_ONLY and cc < (9, 0):
            refused = not ptxas_info(ptx, arch, check=False)["ok"]
            print(json.dumps(dict(kernel=name, arch=arch, refused=refused)), flush=True)
            continue
        info = ptxas_info(ptx, arch)
        cubin = info["cubin"]
        row = dict(kernel=name, arch=arch, missing=[i for i in instructions if i not in ptx],
                   local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
                   spill_bytes=info["spill_bytes"], sass=None)
        if nvdisasm and cc == (9, 0):
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(cubin)
            sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
            os.unlink(f.name)
            row["sass"] = sorted(set(re.findall(r"\b([A-Z][A-Z0-9]+(?:\.[A-Za-z0-9_]+)*)\b", sass)))
        print(json.dumps(row), flush=True)
"""


@functools.cache
def offline_results():
    return offline_json_rows(_OFFLINE_SCRIPT, TESTS, find_nvdisasm() or "")


def test_intrinsics_compile_and_assemble_offline():
    """Every test kernel compiles for sm_80 and sm_90 and ptxas accepts the inline PTX, with no local memory."""
    rows = offline_results()
    assert len(rows) == 2 * len(SASS)
    for row in rows:
        if row["kernel"] in SM90_ONLY and row["arch"] == "sm_80":
            assert row["refused"], row  # ptxas knows the instruction needs sm_90
            continue
        assert not row["missing"], row
        assert row["local"] == 0 and row["spill_bytes"] == 0, row


def test_intrinsics_become_tensor_core_sass():
    """The sm_90 cubins contain HMMA / LDSM / LDGSTS (needs nvdisasm: $NVDISASM or the nvidia-cuda-nvdisasm wheel)."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not found")
    rows = [r for r in offline_results() if r["arch"] == "sm_90"]
    for row in rows:
        missing = [op for op in SASS[row["kernel"]] if not any(t == op or t.startswith(op + ".") for t in row["sass"])]
        assert not missing, (row["kernel"], missing)
        extra = [t for t in row["sass"] for op in FORBIDDEN_SASS.get(row["kernel"], ()) if t.split(".")[0] == op]
        assert not extra, (row["kernel"], extra)


# ----------------------------------------------------------------------------
# 32-bit unsigned division (the persistent forward's work items)
# ----------------------------------------------------------------------------


@functools.cache
def divmod_kernel():
    @kernel
    def divmod_all(a, b, q, r):
        for i in range(cuda.threadIdx.x, a.size, 32):
            q[i], r[i] = I.divmod_u32(a[i], b[i])

    return divmod_all


def test_divmod_u32_matches_integer_division(rng):
    """Quotient and remainder in 32-bit unsigned arithmetic, up to 2^32 - 1 (past int32), on int64 operands as the
    kernels pass them; the simulator version refuses a zero divisor."""
    a = np.concatenate([rng.integers(0, 2**32, 200), [0, 1, 2**31, 2**32 - 1, 7]]).astype(np.int64)
    b = np.concatenate([rng.integers(1, 2**20, 100), rng.integers(1, 2**32, 100), [1, 3, 2**31 - 1, 2**32 - 1, 7]])
    b = b.astype(np.int64)
    q, r = np.zeros(a.size, np.uint32), np.zeros(a.size, np.uint32)
    launch(divmod_kernel(), a, b, q, r)
    np.testing.assert_array_equal(q.astype(np.int64), a // b)
    np.testing.assert_array_equal(r.astype(np.int64), a % b)
    if SIMULATOR:
        with pytest.raises(ZeroDivisionError):
            I.divmod_u32(5, 0)
