"""TMA and mbarriers (:mod:`nbflash.tma`): boxes land where the layout says, zeros outside, phases flip.

* Simulator and GPU (``@pytest.mark.gpu``, Hopper): one block loads two boxes of
  a 4-D tensor with ``cp.async.bulk.tensor`` through one mbarrier (phase 0,
  then phase 1), every thread waits on the barrier, and the raw shared bytes
  are compared with NumPy's box placed by
  :func:`nbflash.hopper.kmajor_sw128_offset` (or densely, unswizzled) —
  rows and columns past the tensor must be zero.  Both layouts: ``bhsd``
  arrays and ``bshd`` strided views.
* Host: :func:`make_tensor_map` refuses what the TMA cannot describe.
* Simulator: waiting on a barrier never initialised, or a misaligned swizzled
  destination, is an error.
* Offline (no GPU, simulator off, in a subprocess): the kernel compiles and
  ptxas assembles it for sm_90, with the PTX instructions named in the docs.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
from offline import TESTS, offline_json_rows

from nbflash import hopper as H
from nbflash import tma as T
from nbflash._device import SIMULATOR, cuda, kernel, numba

sim_only = pytest.mark.skipif(not SIMULATOR, reason="simulator test")


@functools.cache
def tma_kernel(rows, cols, swizzle, threads=64):
    """Two TMA loads of boxes of rows × cols into two shared tiles, through one mbarrier; raw copy out."""
    BOX = rows * cols
    BYTES = 2 * BOX
    SMEM_ELEMS = 2 * BOX  # the two tiles
    SMEM_ALIGN = None if SIMULATOR else 1024  # a 128-byte-swizzle box must land 1024-byte aligned

    @kernel
    def tma_tiles(tmap, coords, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(SMEM_ELEMS, numba.uint16, alignment=SMEM_ALIGN)
        bars = cuda.shared.array(1, numba.uint64)
        if tid == 0:
            T.mbarrier_init(bars, 0, 1)  # one arrival per phase: thread 0's arrive_expect_tx
            T.fence_mbarrier_init()
        cuda.syncthreads()  # the initialised barrier is visible to every thread before anyone waits on it
        for phase in range(2):
            if tid == 0:
                T.mbarrier_arrive_expect_tx(bars, 0, BYTES)
                T.tma_load_4d(smem, phase * BOX, tmap, coords[phase, 0], coords[phase, 1], coords[phase, 2],
                              coords[phase, 3], bars, 0)
            while not T.mbarrier_try_wait_parity(bars, 0, phase):
                pass
            for i in range(tid, BOX, threads):
                out[phase, i] = smem[phase * BOX + i]
            # Every thread has seen this phase complete before thread 0 starts the next one on the same
            # barrier (a phase of the same parity must not complete under a thread still waiting for this one).
            cuda.syncthreads()

    return tma_tiles


def expected_box(x_bits, b, h, row0, col0, rows, cols, swizzle):
    """The shared image of a box, 16-bit words: zeros outside x, chunks swizzled as the map says."""
    box = np.zeros((rows, cols), np.uint16)
    for r in range(rows):
        for c in range(cols):
            rr, cc = row0 + r, col0 + c
            if 0 <= rr < x_bits.shape[2] and 0 <= cc < x_bits.shape[3]:
                box[r, c] = x_bits[b, h, rr, cc]
    image = np.zeros(rows * cols, np.uint16)
    for r in range(rows):
        for c in range(cols):
            at = H.kmajor_sw128_offset(r, c) // 2 if swizzle == H.SWIZZLE_128B else r * cols + c
            image[at] = box[r, c]
    return image


def run_tma(rng, xp, layout, d, seqlen, rows, cols, swizzle, coords):
    shape = (2, 3, seqlen, d) if layout == "bhsd" else (2, seqlen, 3, d)
    bits = rng.integers(1, 2**15, size=shape, dtype=np.uint16)  # never zero: a zero can only be fill
    x_host = bits if layout == "bhsd" else bits.transpose(0, 2, 1, 3)
    x = xp.asarray(bits) if layout == "bhsd" else xp.asarray(bits).transpose(0, 2, 1, 3)
    x = x.view(xp.float16)  # any 16-bit type: the map copies words
    tmap = T.make_tensor_map(x, rows, cols, swizzle)
    out = xp.full((2, rows * cols), 0xFFFF, dtype=np.uint16)  # poison: a word never written stays 0xFFFF
    tma_kernel(rows, cols, swizzle)[1, 64](tmap.map, xp.asarray(np.array(coords, np.int32)), out)
    out = out.get() if hasattr(out, "get") else np.asarray(out)
    for phase in range(2):
        col0, row0, h, b = coords[phase]
        want = expected_box(np.ascontiguousarray(x_host), b, h, row0, col0, rows, cols, swizzle)
        np.testing.assert_array_equal(out[phase], want, err_msg=f"box {phase} at {coords[phase]}")
    return out


# (layout, D, seqlen, box rows, box cols, swizzle, two boxes as (column, row, head, batch))
CASES = [
    ("bhsd", 128, 100, 64, 64, H.SWIZZLE_128B, [(64, 64, 2, 1), (0, 0, 0, 0)]),  # rows 100..127: zeros
    ("bshd", 64, 37, 16, 64, H.SWIZZLE_128B, [(0, 32, 1, 0), (0, 8, 2, 1)]),  # strided view; ragged tail
    ("bhsd", 40, 21, 8, 40, H.SWIZZLE_NONE, [(0, 16, 0, 1), (0, 0, 1, 0)]),  # no swizzle, D = 40
]


@sim_only
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-sw{c[5]}")
def test_tma_boxes_in_the_simulator(rng, case):
    run_tma(rng, np, *case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[1]}-sw{c[5]}")
def test_tma_boxes_on_gpu(rng, xp, case):
    from nbflash._device import compute_capability

    if compute_capability()[0] != 9:
        pytest.skip("TMA needs a Hopper GPU (compute capability 9.x)")
    run_tma(rng, xp, *case)


def test_the_expected_image_is_swizzled():
    """The swizzled and plain images differ (so the GPU comparison tells the two layouts apart)."""
    x = np.arange(1, 1 + 8 * 64, dtype=np.uint16).reshape(1, 1, 8, 64)
    sw = expected_box(x, 0, 0, 0, 0, 8, 64, H.SWIZZLE_128B)
    plain = expected_box(x, 0, 0, 0, 0, 8, 64, H.SWIZZLE_NONE)
    assert sorted(sw) == sorted(plain) and not np.array_equal(sw, plain)
    assert np.array_equal(sw[:8], plain[:8])  # row 0 is not permuted ...
    assert np.array_equal(sw[64:72], plain[72:80])  # ... row 1's chunk 0 holds its logical chunk 1


@pytest.mark.parametrize(
    "shape,box,swizzle,match",
    [
        ((2, 3, 10, 64), (16, 32), H.SWIZZLE_128B, "64 elements"),
        ((2, 3, 10, 64), (0, 64), H.SWIZZLE_128B, "box_rows"),
        ((2, 3, 10, 64), (16, 12), H.SWIZZLE_NONE, "multiple of 8"),
        ((3, 10, 64), (16, 64), H.SWIZZLE_128B, "4-D"),
        ((2, 3, 0, 64), (16, 64), H.SWIZZLE_128B, "empty"),
        ((2, 3, 10, 64), (16, 64), 7, "swizzle"),
    ],
)
def test_make_tensor_map_refuses(xp, shape, box, swizzle, match):
    with pytest.raises(ValueError, match=match):
        T.make_tensor_map(xp.ones(shape, np.float16), *box, swizzle)


def test_make_tensor_map_refuses_bad_strides_and_dtype(xp):
    with pytest.raises(ValueError, match="16-bit"):
        T.make_tensor_map(xp.ones((1, 1, 8, 64), np.float32), 8, 64)
    with pytest.raises(ValueError, match="contiguous"):
        T.make_tensor_map(xp.ones((1, 1, 64, 8), np.float16).transpose(0, 1, 3, 2), 8, 64)
    with pytest.raises(ValueError, match="multiples of 16"):
        T.make_tensor_map(xp.ones((1, 1, 8, 12), np.float16)[..., :8], 8, 8, H.SWIZZLE_NONE)


@sim_only
def test_simulator_refuses_waiting_on_an_uninitialised_barrier():
    @kernel
    def no_init(out):
        bars = cuda.shared.array(1, numba.uint64)
        out[0] = T.mbarrier_try_wait_parity(bars, 0, 0)

    with pytest.raises(RuntimeError, match="before mbarrier_init"):
        no_init[1, 1](np.zeros(1, np.int32))


@sim_only
def test_simulator_refuses_a_misaligned_swizzled_destination(rng):
    x = np.ones((1, 1, 8, 64), np.float16)
    tmap = T.make_tensor_map(x, 8, 64)

    @kernel
    def misaligned(tmap_bytes):
        smem = cuda.shared.array(2048, numba.uint16)
        bars = cuda.shared.array(1, numba.uint64)
        T.mbarrier_init(bars, 0, 1)
        T.mbarrier_arrive_expect_tx(bars, 0, 1024)
        T.tma_load_4d(smem, 64, tmap_bytes, 0, 0, 0, 0, bars, 0)  # 128 bytes in: not 1024-byte aligned

    with pytest.raises(ValueError, match="1024-byte aligned"):
        misaligned[1, 1](tmap.map)


@sim_only
def test_simulator_phase_waits_for_bytes_and_arrivals():
    """A phase completes only when every arrival came and every announced byte landed."""
    @kernel
    def phases(out):
        bars = cuda.shared.array(1, numba.uint64)
        T.mbarrier_init(bars, 0, 2)
        T.mbarrier_arrive_expect_tx(bars, 0, 0)
        out[0] = T.mbarrier_try_wait_parity(bars, 0, 0)  # one of two arrivals: not yet
        T.mbarrier_arrive(bars, 0)
        out[1] = T.mbarrier_try_wait_parity(bars, 0, 0)  # both: phase 0 complete
        out[2] = T.mbarrier_try_wait_parity(bars, 0, 1)  # phase 1 is not
        T.mbarrier_arrive_expect_tx(bars, 0, 256)
        T.mbarrier_arrive(bars, 0)
        out[3] = T.mbarrier_try_wait_parity(bars, 0, 1)  # arrivals done, 256 bytes still missing

    out = np.full(4, 7, np.int32)
    phases[1, 1](out)
    assert out.tolist() == [0, 1, 0, 0]


# ----------------------------------------------------------------------------
# Offline: PTX and ptxas for sm_90, in a subprocess without the simulator
# ----------------------------------------------------------------------------

_OFFLINE_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
from numba import types
import test_tma as t
from nbflash._device import SIMULATOR, compile_ptx_offline, ptxas_info
from nbflash import hopper as H
assert not SIMULATOR
sig = (types.Array(types.uint8, 1, "C"), types.Array(types.int32, 2, "C"), types.Array(types.uint16, 2, "C"))
ptx = compile_ptx_offline(t.tma_kernel(64, 64, H.SWIZZLE_128B).py_func, sig, cc=(9, 0))
info = ptxas_info(ptx, "sm_90", check=False)
print(json.dumps(dict(ok=info["ok"], log=info["log"][-2000:], spill_bytes=info["spill_bytes"],
                      ops=sorted(set(re.findall(r"\b(?:cp\.async\.bulk\.tensor|mbarrier|fence\.mbarrier_init)[.a-z0-9_:]*",
                                                ptx))))), flush=True)
"""


def test_tma_compiles_and_assembles_for_sm90():
    row = offline_json_rows(_OFFLINE_SCRIPT, TESTS)[-1]
    assert row["ok"], row["log"]
    assert row["spill_bytes"] in (0, None), row
    for op in ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
               "mbarrier.init.shared.b64", "mbarrier.arrive.expect_tx.shared::cta.b64",
               "mbarrier.try_wait.parity.shared::cta.b64", "fence.mbarrier_init.release.cluster"):
        assert op in row["ops"], (op, row["ops"])


def test_ptx_names_in_docstrings():
    for fn, ptx in [(T.tma_load_4d, "cp.async.bulk.tensor.4d"), (T.mbarrier_init, "mbarrier.init"),
                    (T.mbarrier_arrive_expect_tx, "mbarrier.arrive.expect_tx"),
                    (T.mbarrier_try_wait_parity, "mbarrier.try_wait.parity"), (T.mbarrier_arrive, "mbarrier.arrive"),
                    (T.fence_mbarrier_init, "fence.mbarrier_init")]:
        assert ptx in fn.__doc__, fn
    assert re.search(r"cuTensorMapEncodeTiled", T.__doc__)


# ----------------------------------------------------------------------------
# The TMA forward behind nbflash.attention: tensor maps per pointer set
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("d,layout,causal,n", [(128, "bhsd", True, 200), (64, "bshd", False, 1100),
                                               (96, "bshd", True, 200)])
def test_attention_tma_maps_follow_every_call(rng, d, layout, causal, n):
    """On Hopper nbflash.attention's forward copies with TMA, whose tensor maps hold addresses: one recorded
    call signature, replayed on new buffers, on freed-and-reused memory, on another stream, and captured into a
    CUDA graph on buffers never seen before (the maps copied inside the capture), then called outside the graph on
    those buffers, reads each call's own data."""
    import cupy as cp

    import nbflash
    from nbflash.reference import attention_ref

    shape = (2, 3, n, d) if layout == "bhsd" else (2, n, 3, d)
    bhsd = (lambda a: a) if layout == "bhsd" else (lambda a: a.transpose(0, 2, 1, 3))

    def fresh():
        return [cp.asarray(rng.standard_normal(shape)).astype(cp.float16) for _ in range(3)]

    def check(qkv, o, what):
        want, _ = attention_ref(*(bhsd(cp.asnumpy(a).astype(np.float64)) for a in qkv), causal=causal)
        err = float(np.abs(bhsd(cp.asnumpy(o).astype(np.float64)) - want).max())
        assert err < 4e-3, f"{what}: max error {err:.2e}"

    first = fresh()
    plan = nbflash.which_backend(*first, causal=causal, layout=layout)
    assert plan.backend == "wgmma" and plan.config.copies == "tma", plan
    check(first, nbflash.attention(*first, causal=causal, layout=layout), "first call")
    second = fresh()
    check(second, nbflash.attention(*second, causal=causal, layout=layout), "new buffers")
    del first
    reused = fresh()  # CuPy's pool may hand the freed buffers back: same addresses, other data
    check(reused, nbflash.attention(*reused, causal=causal, layout=layout), "reused memory")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        third = fresh()
        o = nbflash.attention(*third, causal=causal, layout=layout)
        stream.synchronize()
    check(third, o, "another stream")
    o = nbflash.attention(*third, causal=causal, layout=layout)  # maps made on `stream`, used on the default one
    check(third, o, "maps of another stream")

    torch = pytest.importorskip("torch")
    import nbflash.torch as nbt

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on other buffers: compiles and records, but leaves q, k, v unseen
        nbt.attention(*(x.clone() for x in (q, k, v)), causal=causal, layout=layout)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        o = nbt.attention(q, k, v, causal=causal, layout=layout)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        check([cp.asarray(x) for x in (q, k, v)], cp.asarray(o), "graph replay")
    # Maps first copied inside the capture serve an ordinary call too (copied again outside it).
    for x in (q, k, v):
        x.copy_(torch.randn_like(x))
    o = nbt.attention(q, k, v, causal=causal, layout=layout)
    check([cp.asarray(x) for x in (q, k, v)], cp.asarray(o), "after the capture")
