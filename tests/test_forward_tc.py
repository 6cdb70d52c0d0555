"""The tensor-core forward kernel (nbflash.forward_tc) against the float64 textbook formula.

In the simulator the tiles are 32 queries (2 warps) × 16 keys, so short odd
sequences cross every edge: ragged query and key tiles, causal diagonals in
both directions, rows that see no key.  The error must stay within twice that
of a naive attention in the same 16-bit precision (the flash-attn rule).
Both K/V pipelines (``kv_pipeline="double"``, the default, and FlashAttention-2's
``"split"``) go through the same checks; their copies and barriers do not
depend on the element type, so the split pipeline's odd-size matrix runs in one
of the two.  Without a GPU, every GPU configuration (and the sweep candidates
of ``EXTRA_TARGETS``) is compiled and assembled for sm_90, with nothing in
local memory and no spills.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from nbflash import forward_tc as F
from nbflash import intrinsics as I
from nbflash._device import SIMULATOR, cuda, kernel, numba, syncwarp
from nbflash._device import launch as launch_kernel
from nbflash._tiles import make_padded_offset, make_tc_tile_copier, make_tc_tile_storer
from nbflash.reference import attention_ref, causal_mask


def to_kind(x, kind):
    """float32 → (kernel input: float16, or bfloat16 bits as uint16; its exact float64 values)."""
    if kind == "float16":
        bits = x.astype(np.float16)
        return bits, bits.astype(np.float64)
    bits = I.f32_to_bf16_bits(x)
    return bits, I.bf16_bits_to_f32(bits).astype(np.float64)


def from_kind(o, kind):
    return o.astype(np.float64) if kind == "float16" else I.bf16_bits_to_f32(o).astype(np.float64)


def round_to(x, kind):
    """Round float64 values to ``kind`` and back (the naive reference's every step)."""
    return to_kind(np.asarray(x, dtype=np.float32), kind)[1]


def naive_attention(q, k, v, causal, scale, kind):
    """Attention with every intermediate rounded to 16 bits: the error budget's yardstick."""
    s = round_to(round_to(np.einsum("bhid,bhjd->bhij", q, k), kind) * scale, kind)
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = round_to(np.exp(s - np.where(np.isfinite(m), m, 0)), kind)
    l = p.sum(-1, keepdims=True)
    p = round_to(np.divide(p, l, out=np.zeros_like(p), where=l > 0), kind)
    return round_to(np.einsum("bhij,bhjd->bhid", p, v), kind)


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


#: A NaN of each input kind (float16 NaN; bfloat16 NaN as its uint16 bits), to poison outputs before a launch.
NAN_BITS = {"float16": np.float16(np.nan), "bfloat16": np.uint16(0x7FC0)}


def run_and_check(xp, rng, n_q, n_k, d, kind, causal, cfg=None, layout="bhsd", batch=1, heads=2, launch=None,
                  key_growth=0.0):
    """Run the kernel on ``xp`` arrays (NumPy in the simulator, CuPy on a GPU) and check o and lse.

    ``launch``: the kernel's launcher (``launch(cfg, q, k, v, o, lse, scale, causal)``), by default this
    module's; the wgmma forward's tests pass theirs.  ``key_growth``: key j is scaled by 1 + key_growth · j,
    so that the scores, and every row's running max, keep growing from one key tile to the next.
    """
    cfg = cfg or F.choose_config(d, kind)
    launch = launch or F.launch_forward_tc
    shape = (lambda n: (batch, heads, n, d)) if layout == "bhsd" else (lambda n: (batch, n, heads, d))
    x_q, x_k, x_v = (rng.standard_normal(shape(n)).astype(np.float32) for n in (n_q, n_k, n_k))
    growth = (1 + key_growth * np.arange(n_k, dtype=np.float32))[:, None]  # per key row
    x_k = x_k * (growth if layout == "bhsd" else growth[:, None])
    (q, qv), (k, kv), (v, vv) = (to_kind(x, kind) for x in (x_q, x_k, x_v))
    q, k, v = (xp.asarray(x) for x in (q, k, v))
    o = xp.full(q.shape, NAN_BITS[kind], dtype=q.dtype)  # poisoned: every element must be written
    canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
    lse = xp.full((batch, heads, n_q), np.nan, dtype=np.float32)
    scale = 1 / math.sqrt(d)
    launch(cfg, canon(q), canon(k), canon(v), canon(o), lse, scale, causal)

    qv, kv, vv = canon(qv), canon(kv), canon(vv)
    ref_o, ref_lse = attention_ref(qv, kv, vv, causal=causal, scale=scale)
    out = from_kind(canon(_host(o)), kind)
    lse = _host(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    err = np.abs(out - ref_o).max()
    naive_err = np.abs(naive_attention(qv, kv, vv, causal, scale, kind) - ref_o).max()
    assert err <= 2 * naive_err + 1e-6, (err, naive_err)
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen)  # rows that see no key: lse = -inf ...
    assert np.all(out[~seen] == 0)  # ... and o = 0
    # S is exact products summed in fp32: lse is as good as fp32 arithmetic allows.
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)


# Simulator tiles: 32 queries × 16 keys.
SEQLENS = [(1, 1), (17, 20), (33, 16), (40, 7), (7, 40)]
# (kind, kv_pipeline): the default pipeline in both kinds, the split one in one (its copies are kind-blind).
KIND_PIPELINES = [("float16", "double"), ("bfloat16", "double"), ("bfloat16", "split")]


def with_pipeline(cfg, kv_pipeline):
    return dataclasses.replace(cfg, kv_pipeline=kv_pipeline)


@pytest.mark.parametrize("n_q,n_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind,kv_pipeline", KIND_PIPELINES)
def test_forward_tc_matches_reference(xp, rng, n_q, n_k, causal, kind, kv_pipeline):
    cfg = with_pipeline(F.choose_config(64, kind), kv_pipeline)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg)


@pytest.mark.parametrize("kv_pipeline", ["double", "split"])
def test_forward_tc_bshd_strided_views(xp, rng, kv_pipeline):
    cfg = with_pipeline(F.choose_config(64, "float16"), kv_pipeline)
    run_and_check(xp, rng, 19, 23, 64, "float16", True, cfg=cfg, layout="bshd", batch=2, heads=1)


@pytest.mark.parametrize("d,q_in_regs,kv_pipeline", [(24, True, "double"), (40, False, "double"), (40, False, "split")])
def test_forward_tc_padded_head_dims(xp, rng, d, q_in_regs, kv_pipeline):
    """D not a multiple of 16: zero padding columns in shared memory, never written back; Q from registers or
    re-read from shared memory."""
    cfg = F.TCConfig(32, 16, d, "bfloat16", q_in_regs=q_in_regs, kv_pipeline=kv_pipeline)
    run_and_check(xp, rng, 21, 35, d, "bfloat16", True, cfg=cfg, heads=1)


@pytest.mark.parametrize("kv_pipeline", ["double", "split"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_forward_tc_two_m_tiles_per_warp(xp, rng, kind, kv_pipeline):
    """FlashAttention-2's warp layout: 2 warps × 2 m-tiles of 16 rows, every K/V fragment feeding both."""
    cfg = F.TCConfig(64, 16, 32, kind, m_tiles=2, kv_pipeline=kv_pipeline)
    run_and_check(xp, rng, 70, 37, 32, kind, True, cfg=cfg, heads=1)


@pytest.mark.parametrize("m_tiles,d", [(1, 40), (2, 64)])
def test_forward_tc_stores_o_from_registers(xp, rng, m_tiles, d):
    """``stage_o=False``: O leaves the registers by one 32-bit store per pair of outputs (the wgmma forward's
    epilogue), instead of through shared memory by 16-byte chunks (the default, which every other test runs)."""
    cfg = F.TCConfig(32 * m_tiles, 16, d, "float16", m_tiles=m_tiles, kv_pipeline="split", stage_o=False)
    run_and_check(xp, rng, 45, 19, d, "float16", True, cfg=cfg, heads=1)


@pytest.mark.parametrize("kind,kv_pipeline", KIND_PIPELINES)
def test_forward_tc_pv_in_two_loop_nests(xp, rng, kind, kv_pipeline):
    """One warp of FlashAttention-2's D = 128 layout (2 m-tiles, 64 keys, Q re-read from shared memory): 128
    products per key tile in O += P V, so they run as two loop nests over the two halves of the keys."""
    cfg = F.TCConfig(32, 64, 128, kind, q_in_regs=False, m_tiles=2, kv_pipeline=kv_pipeline)
    run_and_check(xp, rng, 45, 101, 128, kind, True, cfg=cfg, heads=1)


@pytest.mark.parametrize("d,q_in_regs,qk_unroll,kind", [(48, False, 2, "bfloat16"), (64, True, 1, "float16")])
def test_forward_tc_qk_unrolled(xp, rng, d, q_in_regs, qk_unroll, kind):
    """S = Q Kᵀ as straight-line groups of k-steps (``qk_unroll``), the last group shorter when the k-steps do
    not divide (D = 48: 3 k-steps in groups of 2); Q from registers or re-read per k-step."""
    cfg = F.TCConfig(32, 16, d, kind, q_in_regs=q_in_regs, qk_unroll=qk_unroll, kv_pipeline="split")
    run_and_check(xp, rng, 37, 21, d, kind, True, cfg=cfg, heads=1)


@pytest.mark.parametrize("lazy_rescale", [True, False])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_forward_tc_rescales_when_the_max_grows(xp, rng, kind, lazy_rescale):
    """Scores that grow along the keys (key j scaled by 1 + 0.4 j): a row's max passes its reference by more
    than ``RESCALE_SLACK_LOG2`` at later key tiles too, so the lazy rescale must rescale O there (and keeps the
    stale reference, with P up to 2^8, at the tiles in between); the eager one rescales at every tile."""
    cfg = F.TCConfig(32, 16, 32, kind, m_tiles=2, kv_pipeline="split", lazy_rescale=lazy_rescale)
    run_and_check(xp, rng, 33, 70, 32, kind, False, cfg=cfg, heads=1, key_growth=0.4)
    run_and_check(xp, rng, 40, 51, 32, kind, True, cfg=cfg, heads=1, key_growth=0.4)


def test_lazy_rescale_moves_the_reference_only_past_the_slack():
    """The rule itself, on the row maxima of the growth test's scores: between some key tiles the max grows by
    less than the slack (the reference stays, P > 1), between others by more (O is rescaled)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((33, 32))
    k = rng.standard_normal((70, 32)) * (1 + 0.4 * np.arange(70))[:, None]
    s = q @ k.T / math.sqrt(32) * math.log2(math.e)
    tile_max = np.maximum.accumulate(np.stack([s[:, j:j + 16].max(1) for j in range(0, 70, 16)], 1), axis=1)
    steps = np.diff(tile_max, axis=1)
    assert (steps > F.RESCALE_SLACK_LOG2).any() and ((steps > 0) & (steps <= F.RESCALE_SLACK_LOG2)).any()


@pytest.mark.slow
@pytest.mark.parametrize("kv_pipeline", ["double", "split"])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_tc_gpu_configuration(xp, rng, d, kv_pipeline):
    """The tiles the GPU would use (4 warps; 64 or 32 keys), at a size that crosses them; in both pipelines."""
    cfg = with_pipeline(F.choose_config(d, "bfloat16", simulator=False), kv_pipeline)
    run_and_check(xp, rng, 70, cfg.block_n + 5, d, "bfloat16", True, cfg=cfg, heads=1)


SMEM_ALIGN = None if SIMULATOR else 16


@functools.cache
def copier_kernel(rows, threads, head_dim, chunks, pitch):
    """Copy rows [start, start + rows) of src[b, h] into a padded shared tile with the tensor-core tile copier
    (both its paths), then write the whole shared tile (padding columns and rows past the end included) out."""
    copy = make_tc_tile_copier(rows, threads, head_dim, chunks, make_padded_offset(pitch))
    size = rows * pitch

    @kernel
    def copy_tile(src, b, h, start, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(size, numba.uint16, alignment=SMEM_ALIGN)  # cp.async: 16-byte aligned rows
        for e in range(tid, size, threads):
            smem[e] = 0xAAAA  # what the copy must overwrite
        cuda.syncthreads()
        copy(smem, 0, src, b, h, start, src.shape[2], tid)
        I.cp_async_commit()
        I.cp_async_wait_all()
        cuda.syncthreads()  # every thread's copies are visible
        for e in range(tid, size, threads):
            out[e // pitch, e % pitch] = smem[e]

    return copy_tile


@pytest.mark.parametrize("head_dim,chunks,threads", [(64, 8, 32), (40, 6, 32), (40, 8, 32), (24, 4, 64)])
@pytest.mark.parametrize("start,seqlen", [(0, 16), (16, 37), (32, 37), (0, 5)])
def test_tc_tile_copier_whole_and_ragged_tiles(xp, rng, head_dim, chunks, threads, start, seqlen):
    """A whole tile (the short path: one address, row strides) and a ragged one (rows past the end zero-filled),
    head-dim padding zero-filled, threads a multiple of the chunk count or not; a strided (bshd) source."""
    rows, pitch = 16, 8 * chunks + 8
    data = rng.integers(1, 2**16, size=(2, seqlen, 3, head_dim), dtype=np.uint16)  # (batch, seq, head, dim)
    src = xp.asarray(data).transpose(0, 2, 1, 3)  # the kernel's (batch, head, seq, dim) view: rows H·D apart
    out = xp.zeros((rows, pitch), dtype=np.uint16)
    launch_kernel(copier_kernel(rows, threads, head_dim, chunks, pitch), 1, threads, 0, 0, src, 1, 2, start, out)
    out = _host(out)
    want = np.full((rows, pitch), 0xAAAA, dtype=np.uint16)
    want[:, : 8 * chunks] = 0
    n = max(0, min(rows, seqlen - start))
    want[:n, :head_dim] = data[1, start : start + n, 2]
    np.testing.assert_array_equal(out, want)


@functools.cache
def storer_kernel(rows, head_dim, pitch):
    """Fill a padded shared tile from ``tile`` (padding included), then store rows [start, start + rows) of
    dst[b, h] from it with the tensor-core tile storer, by one warp."""
    store = make_tc_tile_storer(rows, 32, head_dim, make_padded_offset(pitch))
    size = rows * pitch

    @kernel
    def store_tile(tile, dst, b, h, start):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(size, numba.uint16, alignment=SMEM_ALIGN)  # 16-byte aligned rows
        for e in range(lane, size, 32):
            smem[e] = tile[e // pitch, e % pitch]
        syncwarp()  # every lane's part of the tile is visible to the warp
        store(smem, 0, dst, b, h, start, dst.shape[2], lane)

    return store_tile


@pytest.mark.parametrize("head_dim,chunks", [(64, 8), (128, 16), (40, 6), (24, 4)])
@pytest.mark.parametrize("rows,start,seqlen", [(16, 0, 16), (32, 16, 37), (16, 32, 37), (32, 0, 5)])
def test_tc_tile_storer_whole_and_ragged_tiles(xp, rng, head_dim, chunks, rows, start, seqlen):
    """Whole tiles and ragged ones (rows past the end not written), chunks per row dividing the warp's 32 lanes
    (one address, row strides) or not (D = 40, 24), a strided (bshd) destination; the head-dim padding of the
    shared rows and every element outside the tile's rows stay untouched."""
    pitch = 8 * chunks + 8
    tile = rng.integers(0, 2**16, size=(rows, pitch), dtype=np.uint16)
    poison = np.uint16(0xAAAA)
    dst = xp.full((2, seqlen, 3, head_dim), poison, dtype=np.uint16)  # (batch, seq, head, dim)
    launch_kernel(storer_kernel(rows, head_dim, pitch), 1, 32, 0, 0, xp.asarray(tile), dst.transpose(0, 2, 1, 3),
                  1, 2, start)
    want = np.full((2, seqlen, 3, head_dim), poison, dtype=np.uint16)
    n = max(0, min(rows, seqlen - start))
    want[1, start : start + n, 2] = tile[:n, :head_dim]
    np.testing.assert_array_equal(_host(dst), want)


@functools.cache
def slice_storer_kernel(rows, head_dim, slice_cols, pitch):
    """As :func:`storer_kernel`, the tile being a slice of ``slice_cols`` columns written from column ``col0``."""
    store = make_tc_tile_storer(rows, 32, head_dim, make_padded_offset(pitch), slice_cols=slice_cols)
    size = rows * pitch

    @kernel
    def store_tile(tile, dst, b, h, start, col0):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(size, numba.uint16, alignment=SMEM_ALIGN)  # 16-byte aligned rows
        for e in range(lane, size, 32):
            smem[e] = tile[e // pitch, e % pitch]
        syncwarp()  # every lane's part of the tile is visible to the warp
        store(smem, 0, dst, b, h, start, dst.shape[2], lane, col0)

    return store_tile


@pytest.mark.parametrize("head_dim,slice_cols,col0", [(256, 128, 128), (136, 128, 128), (136, 128, 0), (40, 64, 0)])
def test_tc_tile_storer_slices(xp, rng, head_dim, slice_cols, col0):
    """``slice_cols``: the tile is a block's slice of the head dim, written from column ``col0``; chunks at or past
    the head dim (a last slice that is one chunk of data, a head dim padded to a panel) are skipped, and the
    other slices' columns stay untouched."""
    rows, start, seqlen = 16, 16, 29  # a ragged tile: 13 rows written
    pitch = slice_cols + 8
    tile = rng.integers(0, 2**16, size=(rows, pitch), dtype=np.uint16)
    poison = np.uint16(0xAAAA)
    dst = xp.full((2, seqlen, 3, head_dim), poison, dtype=np.uint16)  # (batch, seq, head, dim)
    launch_kernel(slice_storer_kernel(rows, head_dim, slice_cols, pitch), 1, 32, 0, 0, xp.asarray(tile),
                  dst.transpose(0, 2, 1, 3), 1, 2, start, col0)
    want = np.full((2, seqlen, 3, head_dim), poison, dtype=np.uint16)
    cols = min(slice_cols, head_dim - col0)
    want[1, start:seqlen, 2, col0 : col0 + cols] = tile[: seqlen - start, :cols]
    np.testing.assert_array_equal(_host(dst), want)


def test_split_pipeline_shared_memory():
    """One K and one V buffer instead of two each: FlashAttention-2's 128 x 64 tiles need 68 KB at D = 128
    (102 KB double buffered) and 36 KB at D = 64 (54 KB)."""
    for d, double_kb, split_kb in ((64, 54, 36), (128, 102, 68)):
        cfg = F.TCConfig(128, 64, d, "float16", q_in_regs=d == 64, m_tiles=2)
        split = with_pipeline(cfg, "split")
        assert (F.shared_bytes(cfg), F.shared_bytes(split)) == (double_kb * 1024, split_kb * 1024)
        assert F.shared_bytes(cfg) - F.shared_bytes(split) == 2 * 64 * cfg.pitch * 2  # one K and one V buffer
    with pytest.raises(ValueError, match="kv_pipeline"):
        F.TCConfig(32, 16, 64, "float16", kv_pipeline="triple")
    with pytest.raises(ValueError, match="qk_unroll"):
        F.TCConfig(32, 16, 64, "float16", qk_unroll=-1)


def test_can_implement_rejects_misaligned_rows():
    cfg = F.TCConfig(32, 16, 64, "float16")
    q = np.zeros((1, 1, 8, 68), dtype=np.float16)[..., :64]  # 136-byte rows: not a multiple of 16 bytes
    ok, why = F.can_implement(cfg, q)
    assert not ok and "multiples of 16" in why
    ok, why = F.can_implement(cfg, np.zeros((1, 1, 8, 128), dtype=np.float16)[..., ::2])
    assert not ok and "contiguous" in why
    base = np.zeros((1, 1, 8, 72), dtype=np.float16)
    ok, why = F.can_implement(cfg, base[..., 1:65])  # 144-byte rows, but the first element 2 bytes off
    assert not ok and "aligned" in why
    for d in (36, 264):
        with pytest.raises(ValueError, match="head_dim"):
            F.TCConfig(32, 16, d, "float16")
    with pytest.raises(ValueError, match="scale must be positive"):
        q = np.zeros((1, 1, 8, 64), dtype=np.float16)
        F.launch_forward_tc(cfg, q, q, q, q.copy(), np.zeros((1, 1, 8), np.float32), -0.5, False)


# Sweep candidates (benchmarks/tc_sweep.py) that are not defaults but must stay in registers too:
# (block_m, block_n, head_dim, q_in_regs, m_tiles, kv_pipeline), each in float16 and bfloat16.
EXTRA_TARGETS = [
    (64, 64, 128, True, 1, "double"),  # the D = 128 default before FA2's 128 x 64 fitted
    (128, 64, 64, True, 2, "split"),  # the D = 64 and D = 128 defaults in FlashAttention-2's split K/V pipeline
    (128, 64, 128, False, 2, "split"),
]

_PTX_SCRIPT = r"""
import json, re, sys
from nbflash import forward_tc as F
from nbflash._device import SIMULATOR, compile_ptx_offline, ptxas_info
assert not SIMULATOR
part, parts = int(sys.argv[1]), int(sys.argv[2])
extra = [F.TCConfig(bm, bn, d, kind, q_in_regs=qr, m_tiles=mt, kv_pipeline=kp)
         for bm, bn, d, qr, mt, kp in json.loads(sys.argv[3]) for kind in ("float16", "bfloat16")]
targets = F.compile_targets() + [("flash_forward_tc", c, F.forward_tc_kernel(c), F.kernel_signature(c), True)
                                 for c in extra]
for i, (name, cfg, kern, sig, fastmath) in enumerate(targets):
    if i % parts != part:
        continue
    ptx = compile_ptx_offline(kern.py_func, sig, cc=(9, 0), fastmath=fastmath)
    info = ptxas_info(ptx, "sm_90")
    print(json.dumps(dict(config=repr(cfg), head_dim=cfg.head_dim, block_n=cfg.block_n, m_tiles=cfg.m_tiles,
                          local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
                          regs=info["registers"], spill_bytes=info["spill_bytes"], stack=info["stack_bytes"],
                          shared=F.shared_bytes(cfg), kv_pipeline=cfg.kv_pipeline,
                          mma=ptx.count("mma.sync.aligned.m16n8k16"), ldmatrix=ptx.count("ldmatrix.sync"),
                          cp_async=ptx.count("cp.async.cg.shared.global"))), flush=True)
"""


@pytest.mark.offline
def test_forward_tc_compiles_for_sm90_in_registers():
    """Every GPU configuration, and the extra sweep candidates: NVVM → PTX → ptxas (nvJitLink), no local
    memory, no spills, loops unrolled."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PTX_SCRIPT, str(i), "2", json.dumps(EXTRA_TARGETS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-4000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(rows) == len(F.compile_targets()) + 2 * len(EXTRA_TARGETS)
    for row in rows:
        assert row["local"] == 0 and row["spill_bytes"] == 0 and row["stack"] == 0, row
        d, bn, mt = -(-row["head_dim"] // 16) * 16, row["block_n"], row["m_tiles"]
        # Fully unrolled: every 16×8×16 product of S = Q Kᵀ and of O += P V is its own instruction.
        # (O's columns past the head dim are never stored: NVVM drops their products.)
        if "q_in_regs=False" in row["config"]:
            continue  # its k-step loop (Q re-read each step) may stay a loop: registers only, checked above
        # Each m-tile of a warp has its own products; K and V fragments are shared between them.
        assert row["mma"] == mt * ((bn // 8) * (d // 16) + -(-row["head_dim"] // 8) * (bn // 16)), row
        assert row["ldmatrix"] == mt * (d // 16) + (bn // 16) * (d // 16) + (bn // 16) * (d // 16), row


# ----------------------------------------------------------------------------
# Through the public API: backend selection
# ----------------------------------------------------------------------------


def test_attention_backend_tensor_core_matches_simt_and_reference(xp, rng):
    """nbflash.attention(backend="tensor_core") on float16, bshd, causal, seqlen_q ≠ seqlen_k."""
    import nbflash

    q, k, v = (xp.asarray(rng.standard_normal((1, n, 2, 32)).astype(np.float16)) for n in (19, 37, 37))
    before = [_host(x).copy() for x in (q, k, v)]
    assert nbflash.which_backend(q, k, v, layout="bshd", backend="tensor_core").backend == "tensor_core"
    o, lse = nbflash.attention(q, k, v, causal=True, layout="bshd", return_lse=True, backend="tensor_core")
    o_simt, lse_simt = nbflash.attention(q, k, v, causal=True, layout="bshd", return_lse=True, backend="simt")
    for x, b in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(_host(x), b)  # inputs untouched
    tr = lambda x: _host(x).astype(np.float64).transpose(0, 2, 1, 3)  # noqa: E731
    ref_o, ref_lse = attention_ref(tr(q), tr(k), tr(v), causal=True, scale=1 / math.sqrt(32))
    naive = naive_attention(tr(q), tr(k), tr(v), True, 1 / math.sqrt(32), "float16")
    assert np.abs(tr(o) - ref_o).max() <= 2 * np.abs(naive - ref_o).max() + 1e-6
    assert np.abs(tr(o) - tr(o_simt)).max() < 2e-3
    np.testing.assert_allclose(_host(lse), ref_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_host(lse), _host(lse_simt), rtol=1e-5, atol=1e-5)


def test_which_backend_reasons(xp, rng):
    import nbflash

    def arr(d, dtype=np.float16, n=8):
        return xp.asarray(rng.standard_normal((1, 1, n, d)).astype(dtype))

    q = arr(64)
    plan = nbflash.which_backend(q, q, q)
    # auto: tensor cores only on a real sm_80+ GPU (Hopper: the wgmma kernel), never in the simulator
    hopper = not nbflash.SIMULATOR and nbflash._device.compute_capability()[0] == 9
    assert plan.backend == ("simt" if nbflash.SIMULATOR else "wgmma" if hopper else "tensor_core"), plan
    forced = nbflash.which_backend(q, q, q, backend="simt")
    assert (forced.backend, forced.reason) == ("simt", "requested")
    assert nbflash.which_backend(q, q, q, backend="tensor_core").backend == "tensor_core"
    f32 = arr(64, np.float32)
    assert "float16 and bfloat16" in nbflash.which_backend(f32, f32, f32).reason
    with pytest.raises(ValueError, match="tensor_core.*float16 and bfloat16"):
        nbflash.attention(f32, f32, f32, backend="tensor_core")
    odd = arr(36)
    assert nbflash.which_backend(odd, odd, odd).backend == "simt"
    with pytest.raises(ValueError, match="multiple of 8"):
        nbflash.attention(odd, odd, odd, backend="tensor_core")
    with pytest.raises(ValueError, match="scale"):
        nbflash.attention(q, q, q, scale=-1.0, backend="tensor_core")
    with pytest.raises(ValueError, match="backend must be one of"):
        nbflash.attention(q, q, q, backend="cuda")


@pytest.mark.parametrize("d", [40, 64, 96, 128, 200, 256])
def test_choose_config_fits_the_device_shared_memory(d):
    """On a GPU with less shared memory per block the choice steps down to tiles that fit, never to none."""
    best = F.choose_config(d, "float16", simulator=False)
    assert F.choose_config(d, "float16", simulator=False, max_shared=227 * 1024) == best
    for limit in (163 * 1024, 99 * 1024, 64 * 1024):  # A100, sm_86/sm_89, a small budget
        cfg = F.choose_config(d, "float16", simulator=False, max_shared=limit)
        smallest = F.TCConfig(64, 32, d, "float16", q_in_regs=False)
        assert F.shared_bytes(cfg) <= limit or cfg == best and F.shared_bytes(smallest) > limit, (d, limit, cfg)
    if d == 128:  # the split 128 x 64 needs 68 KB: sm_86/sm_89 (99 KB) keep it, a 64 KB budget steps down
        assert best.kv_pipeline == "split" and 64 * 1024 < F.shared_bytes(best) <= 99 * 1024
        assert F.choose_config(128, "float16", simulator=False, max_shared=99 * 1024) == best
        small = F.choose_config(128, "float16", simulator=False, max_shared=64 * 1024)
        assert small == F.TCConfig(64, 32, 128, "float16", q_in_regs=False)
