"""The Hopper building blocks of :mod:`nbflash.hopper`: wgmma descriptors, layouts, and the instruction itself.

* Host: descriptor bit packing; the accumulator layout against the PTX ISA /
  CUTLASS ``CLayout_64xN`` formula; the shared-memory layout helpers against
  the core-matrix and 128-byte-swizzle definitions.
* Simulator: one warpgroup (128 threads) writes A (64×K) and B (N×K) into
  shared memory through the layout helpers, issues wgmma through descriptors
  and writes D out through the accumulator layout; compared with NumPy.
  Deliberately broken kernels (LBO and SBO swapped; tiles stored unswizzled
  under a 128B-swizzle descriptor) must fail the comparison.
* Offline (no GPU, simulator off, in a subprocess): the same kernels compile
  for ``compute_90a`` and nvJitLink assembles them for ``sm_90a``.
* GPU (``@pytest.mark.gpu``): the same kernels on an H100/H200.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from offline import TESTS, offline_json_rows

from nbflash import hopper as H
from nbflash import intrinsics as I
from nbflash._device import SIMULATOR, compute_capability, cuda, device_function, kernel, numba

sim_only = pytest.mark.skipif(not SIMULATOR, reason="simulator test")
KINDS = ["f16", "bf16"]


def to_bits(x, kind):
    """float array → 16-bit patterns of ``kind`` and the exactly representable float64 values."""
    x = np.asarray(x, dtype=np.float32)
    bits = I.f32_to_f16_bits(x) if kind == "f16" else I.f32_to_bf16_bits(x)
    vals = I.f16_bits_to_f32(bits) if kind == "f16" else I.bf16_bits_to_f32(bits)
    return bits, vals.astype(np.float64)


# ----------------------------------------------------------------------------
# Host: descriptor, layouts
# ----------------------------------------------------------------------------


def test_descriptor_fields_round_trip(rng):
    for _ in range(200):
        addr, lbo, sbo = (int(x) * 16 for x in rng.integers(0, 2**14, size=3))
        swizzle = int(rng.integers(0, 4))
        desc = H.make_smem_desc(addr, lbo, sbo, swizzle)
        assert H.decode_smem_desc(desc) == (addr, lbo, sbo, 0, swizzle)
        # The PTX ISA's bit positions, written out independently.
        assert desc & 0x3FFF == addr >> 4
        assert (desc >> 16) & 0x3FFF == lbo >> 4
        assert (desc >> 32) & 0x3FFF == sbo >> 4
        assert (desc >> 62) == swizzle
        assert desc & ((3 << 14) | (3 << 30) | (0x7FFF << 46) | (0x3FF << 52)) == 0  # reserved bits stay zero
    # matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4: the address wraps at 256 KiB.
    assert H.make_smem_desc(0x40010, 0, 0, 0) == 1
    assert H.make_smem_desc(1024, 16, 1024, H.SWIZZLE_128B) == (1 << 62) | (64 << 32) | (1 << 16) | 64


def ptx_acc(thread, i):
    """CUTLASS CLayout_64xN: thread (t, g, w) strides (128, 1, 16), value (v0, v1, j) strides (64, 8, 512); m + 64n."""
    t, g, w = thread % 4, (thread // 4) % 8, thread // 32
    v0, v1, j = i % 2, (i // 2) % 2, i // 4
    flat = 128 * t + g + 16 * w + 64 * v0 + 8 * v1 + 512 * j
    return flat % 64, flat // 64


@pytest.mark.parametrize("n", H.WGMMA_N)
def test_accumulator_layout_covers_the_tile_once(n):
    cells = [H.acc_frag_index(t, i) for t in range(128) for i in range(n // 2)]
    assert sorted(cells) == [(r, c) for r in range(64) for c in range(n)]
    for t in range(128):
        for i in range(n // 2):
            assert H.acc_frag_index(t, i) == ptx_acc(t, i)
    # Warp w owns rows 16w..16w+15; a row lives in one quad of lanes.
    assert all(H.acc_frag_index(t, i)[0] // 16 == t // 32 for t in range(128) for i in range(n // 2))


def test_layout_helpers_match_the_canonical_layouts():
    for row in range(64):
        for k in range(64):
            # 128B swizzle: 8-row atoms of 1024 bytes, chunk c of row r stored at chunk c ^ (r % 8).
            chunk = (k // 8) ^ (row % 8)
            assert H.kmajor_sw128_offset(row, k) == 1024 * (row // 8) + 128 * (row % 8) + 16 * chunk + 2 * (k % 8)
            if k < 16:
                off = H.kmajor_interleave_offset(row, k, 128, 256)
                assert off == 256 * (row // 8) + 128 * (k // 8) + 16 * (row % 8) + 2 * (k % 8)
    # Each layout is a permutation of the tile's bytes.
    offs = sorted(H.kmajor_sw128_offset(r, k) for r in range(64) for k in range(64))
    assert offs == list(range(0, 8192, 2))


def test_descriptor_addresses_agree_with_the_layout_helpers():
    """The hardware model (descriptor → address) reads back exactly what the helpers wrote, per k-step."""
    base = 4096
    for s in range(4):  # k-steps of a 64-wide 128B-swizzled tile: start address + 32 bytes each
        desc = H.make_smem_desc(base + 32 * s, 16, 1024, H.SWIZZLE_128B)
        for row in range(64):
            for k in range(16):
                assert H.smem_desc_address(desc, row, k) == base + H.kmajor_sw128_offset(row, 16 * s + k)
    desc = H.make_smem_desc(base, 1024, 128, H.SWIZZLE_NONE)
    for row in range(64):
        for k in range(16):
            assert H.smem_desc_address(desc, row, k) == base + H.kmajor_interleave_offset(row, k, 1024, 128)
    with pytest.raises(NotImplementedError):  # a swizzled operand starting mid-pattern needs a base offset
        H.smem_desc_address(H.make_smem_desc(base + 128, 16, 1024, H.SWIZZLE_128B), 0, 0)


# ----------------------------------------------------------------------------
# One warpgroup: shared tiles → descriptors → wgmma → D
# ----------------------------------------------------------------------------

SMEM_ALIGN = None if SIMULATOR else 1024  # a 128B-swizzle atom must be 1024-byte aligned


def tile_layout(swizzle, n):
    """K, and the (lbo, sbo) of A and of B for the interleaved layout (bytes)."""
    if swizzle == H.SWIZZLE_128B:
        return 64, (16, 1024), (16, 1024)
    # A: the two K-chunks of each 8-row group adjacent (LBO 128, SBO 256); B: all of K-chunk 0 first
    # (LBO = n·16, SBO = 128) — two different placements, so that LBO and SBO are both exercised.
    return 16, (128, 256), (16 * n, 128)


@functools.cache
def wait_and_store(n):
    """``finish(acc, out, tid)``: commit the warpgroup's products, wait for them, and write this thread's
    accumulators of the 64 × n tile to ``out`` where :func:`~nbflash.hopper.acc_frag_index` puts them."""

    def finish(acc, out, tid):
        H.wgmma_commit_group()
        H.wgmma_wait_group(0)
        acc = H.wgmma_fence_operand(acc)
        for i in range(n // 2):
            r, c = H.d_acc_frag_index(tid, i)
            out[r, c] = acc[i]

    return device_function(finish)


@functools.cache
def wgmma_kernel(kind, n, swizzle, broken=None):
    """D (64×n) = A (64×K) · Bᵀ (B: n×K) through wgmma; K = 16 (no swizzle) or 64 (128B swizzle, 4 k-steps).

    The first wgmma computes a k-step into the accumulators, which the next
    (``scale_d = 0``) must discard.  ``broken``: ``"swap_lbo_sbo"`` gives the
    descriptors LBO and SBO the wrong way round; ``"unswizzled"`` stores the
    tiles row-major (no XOR) under a 128B-swizzle descriptor.
    """
    mma = H.wgmma(n, kind)
    K, (a_lbo, a_sbo), (b_lbo, b_sbo) = tile_layout(swizzle, n)
    if broken == "swap_lbo_sbo":
        a_lbo, a_sbo, b_lbo, b_sbo = a_sbo, a_lbo, b_sbo, b_lbo
    sw128 = swizzle == H.SWIZZLE_128B
    unswizzled = broken == "unswizzled"
    a_bytes = 64 * K * 2
    b_off = -(-a_bytes // 1024) * 1024  # B's tile starts 1024-byte aligned too
    smem_elems = (b_off + n * K * 2) // 2
    steps = K // 16

    finish = wait_and_store(n)

    @kernel
    def wgmma_tile(a, b, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(smem_elems, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(tid, 64 * K, 128):
            r = e // K
            k = e % K
            if sw128:
                off = r * 128 + 2 * k if unswizzled else H.d_kmajor_sw128_offset(r, k)
            else:
                off = H.d_kmajor_interleave_offset(r, k, 128, 256)
            smem[off // 2] = a[r, k]
        for e in range(tid, n * K, 128):
            r = e // K
            k = e % K
            if sw128:
                off = r * 128 + 2 * k if unswizzled else H.d_kmajor_sw128_offset(r, k)
            else:
                off = H.d_kmajor_interleave_offset(r, k, 16 * n, 128)
            smem[(b_off + off) // 2] = b[r, k]
        H.fence_proxy_async()  # my st.shared writes → visible to the tensor cores (async proxy)
        cuda.syncthreads()  # ... and everyone's

        acc = H.wgmma_fence_operand(H.wgmma_acc_zeros(n))
        H.wgmma_fence()
        addr_a = H.smem_address(smem, 0)
        addr_b = H.smem_address(smem, b_off // 2)
        # A throw-away product, discarded by scale_d = 0 below.
        acc = mma(H.d_make_smem_desc(addr_a, a_lbo, a_sbo, swizzle), H.d_make_smem_desc(addr_b, b_lbo, b_sbo, swizzle),
                  acc, 1)
        for s in range(steps):  # k-step s: elements 16s..16s+15 start 32·s bytes further (within the swizzle atom)
            da = H.d_make_smem_desc(addr_a + 32 * s, a_lbo, a_sbo, swizzle)
            db = H.d_make_smem_desc(addr_b + 32 * s, b_lbo, b_sbo, swizzle)
            acc = mma(da, db, acc, s > 0)
        finish(acc, out, tid)  # wait, and write the accumulators out

    return wgmma_tile


def run_wgmma(rng, kind, n, swizzle, broken=None, xp=np):
    K = tile_layout(swizzle, n)[0]
    a_bits, a = to_bits(rng.standard_normal((64, K)), kind)
    b_bits, b = to_bits(rng.standard_normal((n, K)), kind)
    out = xp.full((64, n), np.nan, dtype=np.float32)
    wgmma_kernel(kind, n, swizzle, broken)[1, 128](xp.asarray(a_bits), xp.asarray(b_bits), out)
    out = out.get() if hasattr(out, "get") else out
    return out, a, b


def assert_product(out, a, b):
    ref = a @ b.T
    tol = 1e-6 * (np.abs(a) @ np.abs(b).T) + 1e-30  # fp32 accumulation of exact products
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"max error {np.nanmax(err)}"


CASES = [("f16", 8, H.SWIZZLE_NONE), ("bf16", 16, H.SWIZZLE_NONE), ("f16", 64, H.SWIZZLE_NONE),
         ("f16", 64, H.SWIZZLE_128B), ("bf16", 16, H.SWIZZLE_128B)]


@sim_only
@pytest.mark.parametrize("kind,n,swizzle", CASES)
def test_wgmma_matches_numpy(rng, kind, n, swizzle):
    out, a, b = run_wgmma(rng, kind, n, swizzle)
    assert_product(out, a, b)
    if n == 64:  # a transposed read of the (square) result must not pass
        with pytest.raises(AssertionError):
            assert_product(out.T, a, b)


@sim_only
@pytest.mark.parametrize("broken,swizzle", [("swap_lbo_sbo", H.SWIZZLE_NONE), ("unswizzled", H.SWIZZLE_128B)])
def test_wgmma_test_catches_a_wrong_layout(rng, broken, swizzle):
    out, a, b = run_wgmma(rng, "f16", 16, swizzle, broken)
    with pytest.raises(AssertionError):
        assert_product(out, a, b)


@sim_only
def test_simulator_insists_on_the_fences(rng):
    @kernel
    def no_fence(a_bits, out):
        smem = cuda.shared.array(64 * 16 + 8 * 16, numba.uint16)
        d = H.d_make_smem_desc(H.smem_address(smem, 0), 128, 256, 0)
        H.fence_proxy_async()
        acc = H.wgmma_m64n8k16_f16(d, d, H.wgmma_acc_zeros(8), 0)  # no wgmma_fence()
        out[cuda.threadIdx.x] = acc[0]

    with pytest.raises(RuntimeError, match="wgmma_fence"):
        no_fence[1, 128](np.zeros(1, np.uint16), np.zeros(128, np.float32))


@sim_only
@pytest.mark.parametrize("fence_copies", [True, False])
def test_simulator_tracks_cp_async_until_the_writers_fence(rng, fence_copies):
    """A wgmma may read a cp.async chunk only after the thread that copied it executed fence.proxy.async (before
    the barrier): the block has fenced once already, so only the per-chunk tracking can object."""

    @kernel
    def copy_then_wgmma(src, out, fence):
        smem = cuda.shared.array(0, numba.uint16)
        tid = cuda.threadIdx.x
        H.fence_proxy_async()  # an early fence of every thread: nothing copied yet
        for c in (tid, tid + 128):
            if c < 144:  # A (64 × 16) and B (8 × 16) halves: 144 chunks of 16 bytes
                I.cp_async_16(smem, 8 * c, src, 8 * c, 16)
        I.cp_async_commit()
        I.cp_async_wait(0)
        if fence:
            H.fence_proxy_async()  # my copies → the async proxy
        cuda.syncthreads()
        d_a = H.d_make_smem_desc(H.smem_address(smem, 0), 128, 256, 0)
        d_b = H.d_make_smem_desc(H.smem_address(smem, 64 * 16), 128, 256, 0)
        acc = H.wgmma_fence_operand(H.wgmma_acc_zeros(8))
        H.wgmma_fence()
        acc = H.wgmma_m64n8k16_f16(d_a, d_b, acc, 0)
        H.wgmma_commit_group()
        H.wgmma_wait_group(0)
        acc = H.wgmma_fence_operand(acc)
        out[tid] = acc[0]

    src = (rng.standard_normal(144 * 8) * 0.5).astype(np.float16).view(np.uint16)
    out = np.full(128, np.nan, np.float32)
    if fence_copies:
        copy_then_wgmma[1, 128, 0, 144 * 16](src, out, True)
        assert np.isfinite(out).all()
    else:
        with pytest.raises(RuntimeError, match="async proxy"):
            copy_then_wgmma[1, 128, 0, 144 * 16](src, out, False)


# ----------------------------------------------------------------------------
# Offline: NVVM → PTX (.target sm_90a) → nvJitLink (ptxas) for sm_90a
# ----------------------------------------------------------------------------

OFFLINE = [("f16", 8, H.SWIZZLE_NONE), ("bf16", 16, H.SWIZZLE_NONE), ("f16", 32, H.SWIZZLE_128B),
           ("f16", 64, H.SWIZZLE_128B), ("bf16", 64, H.SWIZZLE_NONE)]

_OFFLINE_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
import test_hopper as t
from numba import types
from nbflash._device import SIMULATOR, compile_ltoir_offline, compile_ptx_offline, ptxas_info
assert not SIMULATOR

u16, f32 = types.uint16, types.float32
sig = (types.Array(u16, 2, "C"), types.Array(u16, 2, "C"), types.Array(f32, 2, "C"))
for kind, n, swizzle in t.OFFLINE:
    ptx = compile_ptx_offline(t.wgmma_kernel(kind, n, swizzle).py_func, sig, cc=(9, 0, "a"))
    info = ptxas_info(ptx, "sm_90a", check=False)
    row = dict(kind=kind, n=n, swizzle=swizzle, ok=info["ok"], log=info["log"][-2000:],
               target=re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
               wgmma=re.findall(r"wgmma\.[a-z_]+[.a-z0-9_]*", ptx),
               fence_proxy="fence.proxy.async.shared::cta" in ptx,
               local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
               spill_bytes=info["spill_bytes"])
    if (kind, n) == ("f16", 8):  # the same PTX retargeted to plain sm_90: ptxas must refuse wgmma
        plain = re.sub(r"^\.target\s+sm_90a", ".target sm_90", ptx, flags=re.M)
        row["plain_sm90_ok"] = ptxas_info(plain, "sm_90", check=False)["ok"]
        # The same LTO IR linked twice: nvJitLink 13.0 skipped ptxas (and its log) for an input in its cache
        # unless asked -no-cache; ptxas_info raises when the log lacks the registers.
        lto = compile_ltoir_offline(t.wgmma_kernel(kind, n, swizzle).py_func, sig, cc=(9, 0, "a"))
        row["relinked_registers"] = [ptxas_info(lto, "sm_90a")["registers"] for _ in range(2)]
    print(json.dumps(row), flush=True)
"""


@functools.cache
def offline_results():
    return offline_json_rows(_OFFLINE_SCRIPT, TESTS)


def test_wgmma_compiles_and_assembles_for_sm90a():
    rows = offline_results()
    assert len(rows) == len(OFFLINE)
    for row in rows:
        assert row["target"] == "sm_90a", row
        assert row["ok"], row["log"]
        mma = f"wgmma.mma_async.sync.aligned.m64n{row['n']}k16.f32.{row['kind']}.{row['kind']}"
        for op in (mma, "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned"):
            assert op in row["wgmma"], (op, row["wgmma"])
        assert row["fence_proxy"], row
        assert row["local"] == 0 and row["spill_bytes"] in (0, None), row
    # wgmma is an sm_90a ("arch-specific") feature: ptxas refuses it for plain sm_90.
    assert [r["plain_sm90_ok"] for r in rows if "plain_sm90_ok" in r] == [False]
    relinked = [r["relinked_registers"] for r in rows if "relinked_registers" in r]
    assert len(relinked) == 1 and relinked[0][0] > 0 and relinked[0][0] == relinked[0][1], relinked


# ----------------------------------------------------------------------------
# GPU (H100/H200): the same kernels on the tensor cores
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind,n,swizzle", CASES + [("bf16", 64, H.SWIZZLE_128B), ("f16", 32, H.SWIZZLE_NONE)])
def test_wgmma_on_gpu(rng, xp, kind, n, swizzle):
    if compute_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 (Hopper) GPU")
    out, a, b = run_wgmma(rng, kind, n, swizzle, xp=xp)
    assert_product(out, a, b)


def test_ptx_names_in_docstrings():
    """Every public wgmma function documents the PTX it emits (checked on the docstrings both builds carry)."""
    for n in H.WGMMA_N:
        for kind in KINDS:
            doc = H.wgmma(n, kind).__doc__
            assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.{kind}\.{kind}", doc)


# ----------------------------------------------------------------------------
# The register-A form (A in registers, as P in P·V) with a K-major or N-major B
# ----------------------------------------------------------------------------


def test_mn_major_addresses_agree_with_the_helper():
    """N-major 128B swizzle: the descriptor model reads back what ``mnmajor_sw128_offset`` wrote, per k-step."""
    base, lbo = 8192, 4096
    for s in range(2):  # k-steps: 16 k-rows = 2048 bytes each
        desc = H.make_smem_desc(base + 2048 * s, lbo, 1024, H.SWIZZLE_128B)
        for n in range(128):
            for k in range(16):
                want = base + H.mnmajor_sw128_offset(n, 16 * s + k, lbo)
                assert H.smem_desc_address(desc, n, k, mn_major=True) == want
    # A tile of rows × 64 columns, rows K-major-swizzled, is the N-major tile with k = row.
    assert all(H.mnmajor_sw128_offset(c, r, 0) == H.kmajor_sw128_offset(r, c) for r in range(32) for c in range(64))
    offs = sorted(H.mnmajor_sw128_offset(n, k, 2048) for n in range(128) for k in range(16))
    assert offs == list(range(0, 4096, 2))  # two panels of 16 k-rows × 128 bytes: a permutation


@functools.cache
def wgmma_rs_kernel(kind, n, trans_b, broken=None):
    """D (64×n) = A (64×16, from registers) · B (16×n) through the register-A wgmma, B in shared memory
    128B-swizzled, N-major (``trans_b``) or K-major.  ``broken="a_rows"``: the A registers of rows g and
    g + 8 swapped (a wrong fragment index)."""
    mma = H.wgmma_rs(n, kind, trans_b)
    lbo = 16 * 128  # N-major: 64-column panels of n, 16 k-rows of 128 bytes each
    swap = broken == "a_rows"
    SMEM_ELEMS = max(4096, 64 * n)  # 16 k-rows of every 64-column panel of B (N-major), or n rows (K-major)

    finish = wait_and_store(n)

    @kernel
    def wgmma_rs_tile(a, b, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(SMEM_ELEMS, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(tid, 16 * n, 128):
            k = e // n
            c = e % n
            off = H.d_mnmajor_sw128_offset(c, k, lbo) if trans_b else H.d_kmajor_sw128_offset(c, k)
            smem[off // 2] = b[k, c]
        H.fence_proxy_async()  # my st.shared writes → visible to the tensor cores
        cuda.syncthreads()  # ... and everyone's
        lane = tid % 32
        row = 16 * (tid // 32) + lane // 4
        col = 2 * (lane % 4)
        r0 = row + 8 if swap else row
        r1 = row if swap else row + 8
        a0 = numba.uint32(a[r0, col]) | (numba.uint32(a[r0, col + 1]) << 16)
        a1 = numba.uint32(a[r1, col]) | (numba.uint32(a[r1, col + 1]) << 16)
        a2 = numba.uint32(a[r0, col + 8]) | (numba.uint32(a[r0, col + 9]) << 16)
        a3 = numba.uint32(a[r1, col + 8]) | (numba.uint32(a[r1, col + 9]) << 16)
        acc = H.wgmma_fence_operand(H.wgmma_acc_zeros(n))
        H.wgmma_fence()
        desc = H.d_make_smem_desc(H.smem_address(smem, 0), lbo if trans_b else 16, 1024, H.SWIZZLE_128B)
        acc = mma(a0, a1, a2, a3, desc, acc, 0)
        finish(acc, out, tid)  # wait, and write the accumulators out

    return wgmma_rs_tile


def run_wgmma_rs(rng, kind, n, trans_b, broken=None, xp=np):
    a_bits, a = to_bits(rng.standard_normal((64, 16)), kind)
    b_bits, b = to_bits(rng.standard_normal((16, n)), kind)
    out = xp.full((64, n), np.nan, dtype=np.float32)
    wgmma_rs_kernel(kind, n, trans_b, broken)[1, 128](xp.asarray(a_bits), xp.asarray(b_bits), out)
    out = out.get() if hasattr(out, "get") else out
    return out, a, b.T  # assert_product takes B as n × k


RS_CASES = [("f16", 64, True), ("bf16", 128, True), ("f16", 16, False), ("bf16", 64, False)]


@sim_only
def test_acc_from_array_round_trip():
    @kernel
    def round_trip(out):
        arr = cuda.local.array((4, 4), numba.float32)
        for i in range(16):
            arr[i // 4, i % 4] = cuda.threadIdx.x * 100 + i
        acc = H.acc_from_array(arr, 32)
        back = cuda.local.array((2, 8), numba.float32)
        H.acc_to_array(acc, back)
        for i in range(16):
            out[cuda.threadIdx.x, i] = back[i // 8, i % 8]

    out = np.zeros((2, 16), np.float32)
    round_trip[1, 2](out)
    assert np.array_equal(out, np.arange(16)[None, :] + 100 * np.arange(2)[:, None])


# ----------------------------------------------------------------------------
# Shared × shared with A MN-major (a transposed tile, as dSᵀ read as the A of dS·K)
# ----------------------------------------------------------------------------

TT_STEPS = 2  # two k-steps: the descriptor steps 2048 bytes (16 k-rows) for both operands


@functools.cache
def wgmma_tt_kernel(kind, n, trans_b, broken=None):
    """D (64×n) = A (64×32) · B (32×n), both from shared memory 128B-swizzled, A stored *transposed*
    (``aᵀ[k][m]``, MN-major: ``trans_a``), B N-major (``trans_b``, stored ``b[k][c]``) or K-major.
    ``broken="k_major_a"``: the same bytes read as a K-major A (no ``trans_a``)."""
    K = 16 * TT_STEPS
    mma = H.wgmma(n, kind, trans_a=broken != "k_major_a", trans_b=trans_b)
    a_lbo = 16 * 128 * TT_STEPS  # one 64-wide panel of M (A has only one)
    b_lbo = 16 * 128 * TT_STEPS  # N-major B: 64-column panels of n, K k-rows of 128 bytes each
    B_OFF = 64 * K  # 16-bit elements: A's 32 k-rows × 128 bytes, so B starts 1024-byte aligned
    SMEM_ELEMS = max(B_OFF + max(64, n) * K, 6144)  # (room for the broken read: 64 K-major rows, a step on)

    finish = wait_and_store(n)

    @kernel
    def wgmma_tt_tile(at, b, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(SMEM_ELEMS, numba.uint16, alignment=SMEM_ALIGN)
        for e in range(tid, 64 * K, 128):
            k = e // 64
            m = e % 64
            smem[H.d_mnmajor_sw128_offset(m, k, a_lbo) // 2] = at[k, m]
        for e in range(tid, K * n, 128):
            k = e // n
            c = e % n
            off = H.d_mnmajor_sw128_offset(c, k, b_lbo) if trans_b else (k // 64) * n * 128 + H.d_kmajor_sw128_offset(
                c, k % 64)
            smem[B_OFF + off // 2] = b[k, c]
        H.fence_proxy_async()  # my st.shared writes → visible to the tensor cores
        cuda.syncthreads()  # ... and everyone's
        acc = H.wgmma_fence_operand(H.wgmma_acc_zeros(n))
        H.wgmma_fence()
        addr_a = H.smem_address(smem, 0)
        addr_b = H.smem_address(smem, B_OFF)
        for s in range(TT_STEPS):
            da = H.d_make_smem_desc(addr_a + 2048 * s, a_lbo, 1024, H.SWIZZLE_128B)
            db = H.d_make_smem_desc(addr_b + 2048 * s, b_lbo, 1024, H.SWIZZLE_128B) if trans_b else \
                H.d_make_smem_desc(addr_b + 32 * s, 16, 1024, H.SWIZZLE_128B)
            acc = mma(da, db, acc, s > 0)
        finish(acc, out, tid)  # wait, and write the accumulators out

    return wgmma_tt_tile


def run_wgmma_tt(rng, kind, n, trans_b, broken=None, xp=np):
    at_bits, at = to_bits(rng.standard_normal((16 * TT_STEPS, 64)), kind)
    b_bits, b = to_bits(rng.standard_normal((16 * TT_STEPS, n)), kind)
    out = xp.full((64, n), np.nan, dtype=np.float32)
    wgmma_tt_kernel(kind, n, trans_b, broken)[1, 128](xp.asarray(at_bits), xp.asarray(b_bits), out)
    out = out.get() if hasattr(out, "get") else out
    return out, at.T, b.T  # assert_product takes A as m × k and B as n × k


TT_CASES = [("bf16", 64, True), ("f16", 128, True), ("bf16", 32, False)]


def test_mn_major_a_in_the_ptx():
    """The transposed forms emit the PTX's ``imm-trans-a`` / ``imm-trans-b`` immediates (docstrings both builds
    carry), and the default stays K-major."""
    assert "p, 1, 1, 1, 1``" in H.wgmma(64, "bf16", trans_a=True, trans_b=True).__doc__
    assert "p, 1, 1, 1, 0``" in H.wgmma(64, "bf16", trans_a=True).__doc__
    assert "p, 1, 1, 0, 0``" in H.wgmma(64, "bf16").__doc__
    assert H.wgmma(64, "bf16") is H.wgmma_m64n64k16_bf16


# The register-A and MN-major-A forms share their checks: (form, kind, n, trans_b) rows.
FORMS = {"rs": run_wgmma_rs, "tt": run_wgmma_tt}
FORM_CASES = [("rs", *case) for case in RS_CASES] + [("tt", *case) for case in TT_CASES]
FORM_GPU_CASES = FORM_CASES + [("rs", "f16", 256, True), ("rs", "bf16", 192, True), ("tt", "f16", 64, False)]


@sim_only
@pytest.mark.parametrize("form,kind,n,trans_b", FORM_CASES)
def test_wgmma_forms_match_numpy(rng, form, kind, n, trans_b):
    out, a, b = FORMS[form](rng, kind, n, trans_b)
    assert_product(out, a, b)


@sim_only
@pytest.mark.parametrize("form,broken", [("rs", "a_rows"), ("tt", "k_major_a")])
def test_wgmma_form_tests_catch_a_wrong_operand_read(rng, form, broken):
    """A register fragment with its rows swapped, or an MN-major tile read as K-major, must fail the check."""
    out, a, b = FORMS[form](rng, "bf16", 64, True, broken=broken)
    with pytest.raises(AssertionError):
        assert_product(out, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("form,kind,n,trans_b", FORM_GPU_CASES)
def test_wgmma_forms_on_gpu(rng, xp, form, kind, n, trans_b):
    if compute_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 (Hopper) GPU")
    out, a, b = FORMS[form](rng, kind, n, trans_b, xp=xp)
    assert_product(out, a, b)


@sim_only
def test_setmaxnreg_takes_an_allowed_count():
    """``setmaxnreg`` takes a multiple of 8 from 24 to 256 registers per thread; anything else is refused."""
    for count in (24, 168, 240, 256):
        H.setmaxnreg_inc(count)
        H.setmaxnreg_dec(count)
    for bad in (16, 100, 264):
        with pytest.raises(ValueError, match="multiple of 8 from 24 to 256"):
            H.setmaxnreg_dec(bad)


# ----------------------------------------------------------------------------
# Bulk reductions: cp.reduce.async.bulk .add.f32 from shared memory
# ----------------------------------------------------------------------------

ROWS, COLS, PITCH = 8, 12, 16  # a staging tile of 8 rows × 12 float32, rows 16 floats (64 bytes) apart
STAGE = ROWS * PITCH  # a shared array's size must be a constant when the kernel is typed
ALIGN = None if SIMULATOR else 16  # the bulk copy engine reads 16-byte aligned shared memory


@kernel
def _bulk_rows(src, dst, rounds, fence):
    """Each of ROWS threads stages one row of ``src`` (plus ``round``) in shared memory, and thread r + 1 (mod ROWS)
    adds that row into ``dst[r]`` by one bulk reduction per round — another thread's stores, so fence and barrier
    matter; the tile is restaged every round, so the read wait matters."""
    tid = cuda.threadIdx.x
    stage = cuda.shared.array(STAGE, numba.float32, alignment=ALIGN)
    base = I.global_address(dst, (0, 0))
    for rnd in range(rounds):
        H.bulk_wait_group_read(0)  # my previous reduction has read its row ...
        cuda.syncthreads()  # ... and everybody's has: the tile may be rewritten
        for c in range(COLS):
            stage[tid * PITCH + c] = src[tid, c] + numba.float32(rnd)
        if fence:
            H.fence_proxy_async()
        cuda.syncthreads()
        r = (tid + ROWS - 1) % ROWS
        H.bulk_reduce_add_f32(base + r * dst.strides[0], stage, r * PITCH, 4 * COLS)
        H.bulk_commit_group()
    H.bulk_wait_group(0)


def test_bulk_reduce_adds_rows_from_shared_memory(rng, xp):
    """Every round's staged rows land in dst, added to what was there; columns past COLS stay untouched."""
    src = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    dst0 = rng.standard_normal((ROWS, COLS + 4)).astype(np.float32)
    if not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("cp.reduce.async.bulk needs sm_90")
    want = dst0.astype(np.float64)
    d_src, d_dst = xp.asarray(src), xp.asarray(dst0.copy())
    _bulk_rows[1, ROWS](d_src, d_dst, 3, True)
    got = d_dst.get() if hasattr(d_dst, "get") else d_dst
    want[:, :COLS] += 3 * src + (0 + 1 + 2)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@kernel
def _bulk_one_lane(src, dst):
    """A warp stages 32 × 4 floats (one run, lane by lane) and lane 0 alone adds the whole run into ``dst``: the
    reduction predicated on ``lane == 0``, every lane executing it, the wait and the commit."""
    lane = cuda.threadIdx.x
    stage = cuda.shared.array(128, numba.float32, alignment=ALIGN)
    for i in range(4):
        stage[32 * i + lane] = src[32 * i + lane]
    H.fence_proxy_async()
    cuda.syncthreads()  # every lane's stores, before lane 0 hands the run over
    H.bulk_reduce_add_f32_where(lane == 0, I.global_address(dst, 0), stage, 0, 4 * 128)
    H.bulk_commit_group()
    H.bulk_wait_group(0)


def test_bulk_reduce_where_one_lane_issues(rng, xp):
    """Only the lanes whose predicate holds start the reduction: the run is added once, not 32 times."""
    if not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("cp.reduce.async.bulk needs sm_90")
    src = rng.standard_normal(128).astype(np.float32)
    dst0 = rng.standard_normal(128).astype(np.float32)
    d_dst = xp.asarray(dst0.copy())
    _bulk_one_lane[1, 32](xp.asarray(src), d_dst)
    got = d_dst.get() if hasattr(d_dst, "get") else d_dst
    np.testing.assert_allclose(got, dst0.astype(np.float64) + src, rtol=1e-6, atol=1e-6)


@sim_only
def test_simulator_refuses_unfenced_or_misaligned_bulk_reductions(rng):
    src = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    with pytest.raises(RuntimeError, match="fence_proxy_async"):
        _bulk_rows[1, ROWS](src, np.zeros((ROWS, COLS), np.float32), 1, False)

    @kernel
    def odd_size(dst):
        stage = cuda.shared.array(16, numba.float32)
        H.fence_proxy_async()
        H.bulk_reduce_add_f32(I.global_address(dst, 0), stage, 0, 20)

    with pytest.raises(ValueError, match="multiple of 16"):
        odd_size[1, 1](np.zeros(16, np.float32))
