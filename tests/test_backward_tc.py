"""The tensor-core backward (nbflash.backward_tc) against the float64 textbook gradients.

In the simulator the dK/dV kernel has 2 warps (32 keys) and streams 16-query
tiles, the dQ kernel 32 queries and 16-key tiles, so short odd sequences cross
every edge: ragged tiles of both kinds, causal diagonals in both directions,
rows and whole tiles that see no key.  Every gradient must stay within twice
the error of a naive backward computed in the same 16-bit precision (the
flash-attn rule).  Without a GPU, every GPU configuration is compiled and
assembled for sm_80 and sm_90, with nothing in local memory and no spills.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
from offline import TESTS, offline_json_rows

from nbflash import backward_tc as T
from nbflash import intrinsics as I
from nbflash._device import SIMULATOR, compute_capability, cuda
from nbflash.reference import attention_backward_ref, attention_ref, causal_mask


def to_kind(x, kind):
    """float32 → (kernel input: float16, or bfloat16 bits as uint16; its exact float64 values)."""
    if kind == "float16":
        bits = np.asarray(x, dtype=np.float32).astype(np.float16)
        return bits, bits.astype(np.float64)
    bits = I.f32_to_bf16_bits(x)
    return bits, I.bf16_bits_to_f32(bits).astype(np.float64)


def from_kind(x, kind):
    return x.astype(np.float64) if kind == "float16" else I.bf16_bits_to_f32(x).astype(np.float64)


def round_to(x, kind):
    """Round float64 values to ``kind`` and back (the naive backward's every step)."""
    return to_kind(np.asarray(x, dtype=np.float32), kind)[1]


def naive_backward(do, q, k, v, causal, scale, kind):
    """The textbook backward with every intermediate rounded to 16 bits: the error budget's yardstick."""

    def r(x):
        return round_to(x, kind)

    s = r(r(np.einsum("bhid,bhjd->bhij", q, k)) * scale)
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = r(np.exp(s - np.where(np.isfinite(m), m, 0)))
    l = p.sum(-1, keepdims=True)
    p = r(np.divide(p, l, out=np.zeros_like(p), where=l > 0))
    o = r(np.einsum("bhij,bhjd->bhid", p, v))
    dv = r(np.einsum("bhij,bhid->bhjd", p, do))
    dp = r(np.einsum("bhid,bhjd->bhij", do, v))
    ds = r(p * (dp - r((do * o).sum(-1, keepdims=True))))
    dq = r(r(np.einsum("bhij,bhjd->bhid", ds, k)) * scale)
    dk = r(r(np.einsum("bhij,bhid->bhjd", ds, q)) * scale)
    return dq, dk, dv


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


NAN_BITS = {"float16": np.float16(np.nan).view(np.uint16), "bfloat16": np.uint16(0x7FC0)}


def run_backward(xp, rng, n_q, n_k, d, kind, causal, deterministic, *, layout="bhsd", batch=1, heads=2, cfg=None,
                 launch=None):
    """Run the backward on ``xp`` arrays; return the float64 ``(dq, dk, dv)`` (bhsd) and the inputs' float64 values.

    ``launch(cfg, do, q, k, v, o, lse, dq, dk, dv, scale, causal, deterministic)``: the launcher, by default
    this module's (the wgmma backward's tests pass theirs).

    Checks on the way: outputs are poisoned with NaN before the run, inputs are
    unchanged after it.
    """
    cfg = cfg or T.choose_config(d, kind)
    shape = (lambda n: (batch, heads, n, d)) if layout == "bhsd" else (lambda n: (batch, n, heads, d))
    canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
    (q, qv), (k, kv), (v, vv), (do, dov) = (
        to_kind(rng.standard_normal(shape(n)).astype(np.float32), kind) for n in (n_q, n_k, n_k, n_q)
    )
    scale = 1 / math.sqrt(d)
    o, lse = attention_ref(canon(qv), canon(kv), canon(vv), causal=causal, scale=scale)
    o = to_kind(o, kind)[0]  # bhsd, as the forward would store it
    o = o if layout == "bhsd" else np.ascontiguousarray(o.transpose(0, 2, 1, 3))
    inputs = [xp.asarray(x) for x in (do, q, k, v, o, np.ascontiguousarray(lse, dtype=np.float32))]
    before = [_host(x).copy() for x in inputs]
    grads = [xp.empty_like(x) for x in inputs[1:4]]
    for g in grads:
        g.view(np.uint16)[...] = NAN_BITS[kind]  # poison: every element must be written
    do, q, k, v, o, lse = inputs
    dq, dk, dv = grads
    views = (canon(x) for x in (do, q, k, v, o))
    (launch or T.launch_backward_tc)(cfg, *views, lse, canon(dq), canon(dk), canon(dv), scale, causal, deterministic)
    for x, x0 in zip(inputs, before, strict=True):
        assert np.array_equal(_host(x).view(np.uint8), x0.view(np.uint8)), "an input was modified"
    got = tuple(from_kind(canon(_host(g)), kind) for g in grads)
    return got, tuple(canon(x) for x in (dov, qv, kv, vv)), scale


def check_against_reference(got, values, scale, causal, kind):
    """Each gradient within 2× the naive 16-bit error (+ 1e-4: the naive one can be exact).

    Rows that see no key get dq exactly 0, keys that no query sees dk = dv = 0.
    """
    do, q, k, v = values
    ref = attention_backward_ref(do, q, k, v, causal=causal, scale=scale)
    naive = naive_backward(do, q, k, v, causal, scale, kind)
    for name, g, want, base in zip(("dq", "dk", "dv"), got, ref, naive, strict=True):
        assert np.all(np.isfinite(g)), f"{name}: not finite"
        err = np.abs(g - want).max()
        naive_err = np.abs(base - want).max()
        assert err <= 2 * naive_err + 1e-4, f"{name}: error {err:.2e}, naive {kind} {naive_err:.2e}"
    if causal:
        blind = ~causal_mask(q.shape[2], k.shape[2]).any(axis=1)  # query rows that see no key
        assert np.all(got[0][:, :, blind] == 0)
        dead = ~causal_mask(q.shape[2], k.shape[2]).any(axis=0)  # keys no query sees
        assert np.all(got[1][:, :, dead] == 0) and np.all(got[2][:, :, dead] == 0)


# (kind, deterministic, causal, seqlen_q, seqlen_k, head dim, layout).  Simulator tiles: dK/dV 32 keys ×
# 16 queries, dQ 32 queries × 16 keys; D = 32 re-reads K and V by ldmatrix, D = 16 keeps them in registers.
CASES = [
    ("float16", True, True, 20, 37, 16, "bhsd"),  # causal, fewer queries: the last query sees every key
    ("float16", False, True, 37, 20, 32, "bhsd"),  # causal, more queries: rows 0..16 see no key
    ("bfloat16", True, False, 37, 20, 32, "bshd"),
    ("bfloat16", False, True, 20, 37, 16, "bshd"),
    ("float16", False, False, 1, 1, 16, "bhsd"),  # one query, one key
    ("bfloat16", True, True, 45, 13, 16, "bhsd"),  # whole query tiles see no key
    ("float16", False, False, 19, 21, 48, "bhsd"),  # atomic dQ of D = 48 in three 16-column units
    ("float16", True, True, 19, 21, 40, "bshd"),  # D = 40 padded to 48 in shared memory: columns 40..47 not written
    ("bfloat16", False, False, 21, 19, 8, "bhsd"),  # D = 8: half of every k-step is padding
]


@pytest.mark.parametrize(
    "kind,deterministic,causal,n_q,n_k,d,layout",
    CASES,
    ids=[
        f"{c[0]}-{'det' if c[1] else 'atomic'}-{'causal' if c[2] else 'full'}-{c[3]}x{c[4]}-D{c[5]}-{c[6]}"
        for c in CASES
    ],
)
def test_backward_tc_matches_reference(xp, rng, kind, deterministic, causal, n_q, n_k, d, layout):
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, deterministic, layout=layout)
    check_against_reference(got, values, scale, causal, kind)


@pytest.fixture
def lagging_warp(monkeypatch):
    """In the simulator, the last warp of a block reads shared memory slowly: every ``ldmatrix`` of its lanes
    first sleeps 20 ms, so the other warps run ahead to their next barrier.  A copy started over a
    buffer that a lagging warp still reads then poisons (with :data:`~nbflash.intrinsics.SIM_CP_ASYNC_LANDS_AT_WAIT`)
    what it reads: the simulator's round-robin scheduling, which keeps warps in step, would seldom show that."""
    if not SIMULATOR:
        pytest.skip("a simulator schedule")
    import threading
    import time

    def lagging(read):
        def slow_read(smem, offset):
            me = threading.current_thread()
            if me.thread_id // 32 == me._manager._block_dim[0] // 32 - 1:
                time.sleep(0.02)
            return read(smem, offset)

        return slow_read

    monkeypatch.setattr(I, "SIM_CP_ASYNC_LANDS_AT_WAIT", True)
    for name in ("ldmatrix_x4", "ldmatrix_x4_trans"):
        monkeypatch.setattr(I, name, lagging(getattr(I, name)))


# The dK/dV kernel in FlashAttention-2's warp grid (TCBackwardConfig.warps_keys): (kind, deterministic, causal,
# seqlen_q, seqlen_k, head dim, block_m, block_n, warps_keys, warps_dq_rows).  4 warps in the simulator.
GRID = [
    ("bfloat16", False, True, 70, 45, 32, 32, 64, 2, 2),  # 2 × 2 warps: 32 keys × 16 queries (Sᵀ), × 16 columns
    ("float16", True, True, 45, 70, 32, 32, 64, 2, 2),  # deterministic: the dQ kernel after the grid dK/dV kernel
    ("float16", False, False, 37, 50, 32, 32, 64, 4, 2),  # 4 × 1: a warp's Sᵀ spans the tile's queries
    ("bfloat16", False, True, 50, 37, 40, 64, 64, 4, 4),  # D = 40 padded to 48: three column tiles, one half padding
]


@pytest.mark.parametrize("kind,deterministic,causal,n_q,n_k,d,block_m,block_n,warps_keys,warps_dq_rows", GRID,
                         ids=[f"{c[0]}-{'det' if c[1] else 'atomic'}-{'causal' if c[2] else 'full'}-{c[3]}x{c[4]}"
                              f"-D{c[5]}-{c[6]}x{c[7]}g{c[8]}{c[9]}" for c in GRID])
def test_backward_tc_grid_layout(xp, rng, kind, deterministic, causal, n_q, n_k, d, block_m, block_n, warps_keys,
                                 warps_dq_rows):
    cfg = T.TCBackwardConfig(block_m, block_n, d, kind, kv_in_registers=False, warps_keys=warps_keys,
                             warps_dq_rows=warps_dq_rows)
    assert cfg.grid
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, deterministic, heads=1, cfg=cfg)
    check_against_reference(got, values, scale, causal, kind)


# bulk_dq: (kind, causal, seqlen_q, seqlen_k, head dim, block_m, block_n, warps_keys, warps_dq_rows).
BULK = [
    ("bfloat16", True, 70, 45, 32, 32, 64, 2, 2),  # 2 × 2 warps stage 16 queries × 16 columns each; ragged rows
    ("float16", False, 37, 50, 40, 64, 64, 4, 4),  # 4 × 1: columns 40..47 padding (staged, added, not read back)
    ("bfloat16", False, 50, 37, 64, 64, 64, 4, 1),  # 1 × 4: 64 queries × 16 columns a warp
    ("float16", True, 45, 70, 64, 32, 64, 2, 1),  # 1 × 4 over 32 queries: 2 × 2 accumulator tiles a warp
]


@pytest.mark.parametrize("kind,causal,n_q,n_k,d,block_m,block_n,warps_keys,warps_dq_rows", BULK,
                         ids=[f"{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}x{c[3]}-D{c[4]}-{c[5]}x{c[6]}g{c[7]}{c[8]}b"
                              for c in BULK])
def test_backward_tc_grid_bulk_dq(xp, rng, kind, causal, n_q, n_k, d, block_m, block_n, warps_keys, warps_dq_rows):
    """Atomic dQ of the grid layout through shared memory and the bulk copy engine (``bulk_dq``; sm_90), the
    accumulator's tiles in fragment order and read back so by step 2'.  The simulator performs a bulk reduction
    only at the issuing lane's wait, reading the warp's staged values then: a part rewritten before that wait,
    the last tile not waited for before the kernel ends, lanes that had not all stored, or a value staged or
    read back at another place than :func:`dq_tile_position` gives a wrong dq."""
    if not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("cp.reduce.async.bulk needs sm_90")
    cfg = T.TCBackwardConfig(block_m, block_n, d, kind, kv_in_registers=False, warps_keys=warps_keys,
                             warps_dq_rows=warps_dq_rows, bulk_dq=True)
    assert cfg.dq_warp_tile == (block_m // warps_dq_rows, cfg.d_pad * warps_dq_rows * 16 // block_n)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, False, heads=2, cfg=cfg)
    check_against_reference(got, values, scale, causal, kind)


@pytest.mark.parametrize("bulk_dq", [False, True])
def test_backward_tc_grid_dq_before_dk(xp, rng, bulk_dq):
    """``dq_before_dk``: step 1g between the dV and dK products (FlashAttention-2's order), by red and by bulk
    reductions; ragged tiles both ways, causal."""
    if bulk_dq and not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("cp.reduce.async.bulk needs sm_90")
    cfg = T.TCBackwardConfig(32, 64, 32, "bfloat16", kv_in_registers=False, warps_keys=2, warps_dq_rows=2,
                             bulk_dq=bulk_dq, dq_before_dk=True)
    got, values, scale = run_backward(xp, rng, 70, 45, 32, "bfloat16", True, False, heads=1, cfg=cfg)
    check_against_reference(got, values, scale, True, "bfloat16")


@pytest.mark.skipif(SIMULATOR, reason="GPU tiles: hours in the simulator")
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backward_tc_atomic_default_is_bulk_dq_on_sm90(xp, rng, layout):
    """choose_config's atomic defaults at D = 64 and 128 (bulk_dq issued between the dV and dK products on sm_90,
    else red), ragged and causal with N_q ≠ N_k across several query tiles, both layouts, against float64."""
    for d, n_q in ((64, 1000), (128, 613)):
        cfg = T.choose_config(d, "bfloat16", atomic=True)
        assert cfg.bulk_dq == cfg.dq_before_dk == (compute_capability() >= (9, 0))
        got, values, scale = run_backward(xp, rng, n_q, 333, d, "bfloat16", True, False, layout=layout, heads=3,
                                          cfg=cfg)
        check_against_reference(got, values, scale, True, "bfloat16")


@pytest.mark.parametrize("warps_keys,warps_dq_rows,d", [(4, 2, 128), (4, 4, 40), (2, 1, 64)])
def test_bulk_dq_tile_layout_is_the_fragment_order(warps_keys, warps_dq_rows, d):
    """:func:`dq_tile_position` is a one-to-one map of a query tile's (query, column) onto its block_m · d_pad
    values, and value i of lane ``lane``'s accumulator tile n of warp w — placed by the PTX C-fragment layout
    (intrinsics._c_frag_index) and the warp grid of step 1g — lands at ``w · R · C + (4n + i) · 32 + lane``,
    where the kernel stores it."""
    block_m, block_n = 64, 128 if d == 128 else 64
    cfg = T.TCBackwardConfig(block_m, block_n, d, "bfloat16", kv_in_registers=False, warps_keys=warps_keys,
                             warps_dq_rows=warps_dq_rows, bulk_dq=True)
    position = T.dq_tile_position(cfg.dq_tiles)
    places = {position(r, c) for r in range(block_m) for c in range(cfg.d_pad)}
    assert places == set(range(block_m * cfg.d_pad))
    R, C = cfg.dq_warp_tile
    for w in range(cfg.warps):
        q0, c0 = R * (w // (cfg.d_pad // C)), C * (w % (cfg.d_pad // C))  # the warp's first query and column
        for m in range(R // 16):
            for n8 in range(C // 8):
                for lane in range(32):
                    for i in range(4):
                        row, col = I._c_frag_index(lane, i)
                        n = m * (C // 8) + n8  # as _make_tile_product numbers a warp's accumulator tiles
                        want = w * R * C + (4 * n + i) * 32 + lane
                        assert position(q0 + 16 * m + row, c0 + 8 * n8 + col) == want


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("warps_keys,warps_dq_rows,d,aligned", [(4, 4, 40, True), (2, 1, 64, True), (2, 1, 64, False)])
def test_bulk_dq_tile_convert_reads_the_fragment_order(xp, rng, kind, warps_keys, warps_dq_rows, d, aligned):
    """bulk_dq's step 2' (16-byte loads in the accumulator's fragment order, 16-byte stores): every dq value is
    the accumulator's value at :func:`dq_tile_position` times the scale, rounded to nearest even, bit for bit;
    the ragged last query tile and the head-dim padding (D = 40 in 48 columns) are not written past; a dq whose
    rows are not 16-byte aligned gets element stores."""
    block_m, n_q = 64, 77
    cfg = T.TCBackwardConfig(block_m, 64, d, kind, kv_in_registers=False, warps_keys=warps_keys,
                             warps_dq_rows=warps_dq_rows, bulk_dq=True)
    position = T.dq_tile_position(cfg.dq_tiles)
    tiles = -(-n_q // block_m)
    vals = (rng.standard_normal((1, 2, tiles * block_m, cfg.d_pad)) * 3).astype(np.float32)  # [row, col] values
    acc = np.empty_like(vals)
    for tile in range(tiles):
        at = np.array([[position(r, c) for c in range(cfg.d_pad)] for r in range(block_m)])
        flat = acc[:, :, tile * block_m:(tile + 1) * block_m].reshape(1, 2, -1)  # a view: the tile's run
        flat[:, :, at.ravel()] = vals[:, :, tile * block_m:(tile + 1) * block_m].reshape(1, 2, -1)
    scale = 0.7
    prod = vals[:, :, :n_q, :d] * np.float32(scale)
    want = prod.astype(np.float16).view(np.uint16) if kind == "float16" else I.f32_to_bf16_bits(prod)
    store = np.float16 if kind == "float16" else np.uint16
    flat = np.full(2 * n_q * d + 1, 0x7FFF, np.uint16).view(store)  # poisoned
    # On the device: the simulator copies host arrays into fresh (aligned) ones at every launch.
    flat = cuda.to_device(flat) if SIMULATOR else xp.asarray(flat)
    dq = (flat[:-1] if aligned else flat[1:]).reshape(1, 2, n_q, d)
    T.dq_tile_convert_kernel(cfg.dq_tiles)[(tiles, 2, 1), cfg.threads](xp.asarray(acc), dq, scale)
    out = flat.copy_to_host() if SIMULATOR else _host(flat)
    np.testing.assert_array_equal(out[:-1] if aligned else out[1:], want.ravel().view(store))
    assert out.view(np.uint16)[-1 if aligned else 0] == 0x7FFF  # nothing written past dq


@pytest.mark.parametrize("layout", ["registers", "grid", "grid-bulk"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_tc_one_barrier_schedule(xp, rng, lagging_warp, deterministic, layout):
    """Both kernels' one-barrier-per-tile schedule: a tile's copies (rows, and lse2, D) start right after the
    barrier that ends every warp's use of the buffer they refill, and a tile is read only after its wait and
    barrier.  Copies land late (NaN until their wait) and one warp lags, so either mistake gives NaN or stale
    gradients.  Ragged and causal, sized so that each kernel's lagging warp has real rows in a block of three
    or more tiles: 4 query tiles for the first key block, 4 key tiles for the last query block (a row past
    the end of the last query tile gets lse2 = 0: it must still add nothing).  The grid layout's dK/dV kernel
    has a second barrier per tile (Pᵀ, dSᵀ through shared memory): a warp that ran ahead into the next
    tile's step d, or read them before every warp wrote them, would corrupt dK, dV and dQ."""
    cfg, n_q, d = None, 61, 16
    if layout.startswith("grid"):  # 2 × 2 warps over 64 keys × 32 queries: queries 50..99 in 3 tiles for one key block
        if layout == "grid-bulk" and deterministic:
            pytest.skip("bulk_dq changes only the atomic route")
        cfg = T.TCBackwardConfig(32, 64, 32, "bfloat16", kv_in_registers=False, warps_keys=2, warps_dq_rows=2,
                                 bulk_dq=layout == "grid-bulk")
        n_q, d = 100, 32
    got, values, scale = run_backward(xp, rng, n_q, 50, d, "bfloat16", True, deterministic, cfg=cfg)
    check_against_reference(got, values, scale, True, "bfloat16")


@pytest.mark.parametrize("vector_red", [True, False], ids=["red-v2", "red-scalar"])
@pytest.mark.parametrize(
    "kind,causal,n_q,n_k,d,layout",
    [("float16", True, 37, 20, 32, "bshd"), ("bfloat16", False, 20, 37, 16, "bhsd")],
    ids=["float16-causal-37x20-D32-bshd", "bfloat16-full-20x37-D16-bhsd"],
)
def test_atomic_dq_by_vector_or_scalar_reductions(xp, rng, vector_red, kind, causal, n_q, n_k, d, layout):
    """Step 1g both ways: one red.global.add.v2.f32 per accumulator pair (sm_90's route) or two scalar ones."""
    if vector_red and not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("red.global.add.v2.f32 needs sm_90")
    cfg = dataclasses.replace(T.choose_config(d, kind), vector_red=vector_red)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, False, layout=layout, cfg=cfg)
    check_against_reference(got, values, scale, causal, kind)


def test_deterministic_variant_is_bitwise_repeatable(xp, rng):
    """Two runs of the deterministic variant give the same bits; the atomic variant agrees to rounding."""
    args = (19, 35, 16, "bfloat16", True)
    first, *_ = run_backward(xp, np.random.default_rng(7), *args, True)
    again, *_ = run_backward(xp, np.random.default_rng(7), *args, True)
    atomic, *_ = run_backward(xp, np.random.default_rng(7), *args, False)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(first, atomic, strict=True):  # dQ by another kernel; dK, dV the same arithmetic
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=1e-2)


@pytest.mark.slow
@pytest.mark.skipif(SIMULATOR and not os.environ.get("NBFLASH_SLOW"), reason="minutes in the simulator: NBFLASH_SLOW=1")
@pytest.mark.parametrize("d", [64, 128])
def test_backward_tc_gpu_configuration(xp, rng, d):
    """The tiles the GPU would use (4 warps; 64 keys × 64 queries), at a size that crosses them."""
    cfg = T.choose_config(d, "float16", simulator=False)
    got, values, scale = run_backward(xp, rng, 70, 69, d, "float16", True, False, heads=1, cfg=cfg)
    check_against_reference(got, values, scale, True, "float16")


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
def test_backward_tc_eight_warps(xp, rng, deterministic):
    """8 warps (128 keys per dK/dV block, 128 queries per dQ block), 32-row streamed tiles, K/V re-read.

    More threads than chunks in a 32-row tile copy, four dQ units of step 1g for eight warps; the
    smallest run that has them (256 simulated threads: about 10 s each).
    """
    cfg = T.TCBackwardConfig(32, 128, 32, "bfloat16", kv_in_registers=False)
    got, values, scale = run_backward(xp, rng, 37, 45, 32, "bfloat16", True, deterministic, heads=1, cfg=cfg)
    check_against_reference(got, values, scale, True, "bfloat16")


# (kind, deterministic, causal, seqlen_q, seqlen_k, head dim, d_slice): the head dim cut into slices of gradient
# columns, one block each, as at D > 128 on the GPU; the last slice may run past the padded head dim.
SLICED = [
    ("bfloat16", True, True, 21, 19, 24, 16),  # two slices of 16: padded 32, columns 24..31 not written
    ("float16", False, True, 21, 19, 40, 16),  # three slices, atomic dQ per slice
    ("float16", True, False, 19, 22, 40, 32),  # two slices of 32 over 64 shared columns (48 padded)
]


@pytest.mark.parametrize("kind,deterministic,causal,n_q,n_k,d,d_slice", SLICED,
                         ids=[f"{c[0]}-{'det' if c[1] else 'atomic'}-{'causal' if c[2] else 'full'}-{c[3]}x{c[4]}"
                              f"-D{c[5]}-slice{c[6]}" for c in SLICED])
def test_backward_tc_head_dim_slices(xp, rng, kind, deterministic, causal, n_q, n_k, d, d_slice):
    cfg = dataclasses.replace(T.choose_config(d, kind), d_slice=d_slice, kv_in_registers=False)
    assert cfg.slices > 1 and cfg.d_smem >= cfg.d_pad
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, deterministic, cfg=cfg)
    check_against_reference(got, values, scale, causal, kind)


# ``staged_out``: the last step through shared memory (dK, dV over the K_j, V_j tiles, dQ over Q_i), then whole
# 16-byte chunks of rows by the block.  (kind, deterministic, causal, seqlen_q, seqlen_k, head dim, layout, layout
# options): every layout of the dK/dV kernel, and the dQ kernel (deterministic) with one slice and with several.
STAGED = [
    ("float16", False, True, 37, 20, 32, "bhsd", dict(kv_in_registers=False)),  # rows that see no key; atomic
    ("bfloat16", True, False, 21, 19, 40, "bshd", dict(kv_in_registers=True)),  # D = 40 padded to 48; dQ kernel
    ("bfloat16", False, True, 70, 45, 32, "bhsd",  # grid layout 2 × 2: a warp's 32 keys × 16 columns, ragged keys
     dict(block_m=32, block_n=64, kv_in_registers=False, warps_keys=2, warps_dq_rows=2)),
    ("float16", False, False, 37, 50, 40, "bhsd",  # grid 4 × 1 with bulk dQ: the read wait after the stores
     dict(block_m=64, block_n=64, kv_in_registers=False, warps_keys=4, warps_dq_rows=4, bulk_dq=True)),
    ("bfloat16", True, True, 21, 19, 24, "bhsd", dict(d_slice=16, kv_in_registers=False)),  # slices: 16..23 written
    ("float16", False, True, 21, 19, 40, "bshd", dict(d_slice=16, kv_in_registers=False)),  # three slices, atomic
]


@pytest.mark.parametrize("kind,deterministic,causal,n_q,n_k,d,layout,options", STAGED,
                         ids=[f"{c[0]}-{'det' if c[1] else 'atomic'}-{'causal' if c[2] else 'full'}-{c[3]}x{c[4]}"
                              f"-D{c[5]}-{c[6]}-{'-'.join(f'{k}={v}' for k, v in c[7].items())}" for c in STAGED])
def test_backward_tc_staged_out(xp, rng, kind, deterministic, causal, n_q, n_k, d, layout, options):
    """Both kernels' last step through shared memory (``staged_out``): every warp packs its gradient pairs into
    the once-copied tiles after a block barrier, and the block writes whole 16-byte chunks of rows — of its
    slice, skipping head-dim padding and rows past the end.  (Outputs are poisoned first: a chunk left unwritten
    fails too.)"""
    if options.get("bulk_dq") and not SIMULATOR and compute_capability() < (9, 0):
        pytest.skip("cp.reduce.async.bulk needs sm_90")
    cfg = dataclasses.replace(T.choose_config(d, kind), staged_out=True, **options)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, deterministic, layout=layout, heads=2,
                                      cfg=cfg)
    check_against_reference(got, values, scale, causal, kind)


def unchunked_gradients(xp):
    """``(x, lse, cases)`` for the refusal of gradients the 16-byte chunk stores cannot write: ``x`` a (1, 1, 16,
    64) float16 input of ones, ``cases`` ``(name, (dq, dk, dv), words)`` with one of the three odd — rows 136 bytes
    apart, or data 2 bytes past an aligned start — and ``words`` what the refusal must say."""
    x = xp.ones((1, 1, 16, 64), xp.float16)
    odd_rows = xp.ones((1, 1, 16, 68), xp.float16)[..., :64]
    odd_start = xp.ones(16 * 64 + 1, xp.float16)[1:].reshape(1, 1, 16, 64)
    cases = []
    for odd, words in ((odd_rows, "16 bytes"), (odd_start, "16-byte aligned")):
        for i, name in enumerate(("dq", "dk", "dv")):
            grads = [x.copy() for _ in range(3)]
            grads[i] = odd
            cases.append((name, tuple(grads), words))
    return x, xp.zeros((1, 1, 16), xp.float32), cases


def test_staged_gradients_need_rows_of_whole_chunks(xp):
    """With ``staged_out`` the gradients are written in 16-byte chunks of rows: dq, dk or dv whose rows are not 16
    bytes apart, or whose data does not start on 16 bytes, are refused by name before any launch and left
    unwritten; without it any rows are written."""
    cfg = dataclasses.replace(T.choose_config(64, "float16"), staged_out=True)
    x, lse, cases = unchunked_gradients(xp)
    assert T.can_implement(cfg, x, x, x, x, x, x, x, x) == (True, "")
    for name, grads, words in cases:
        ok, why = T.can_implement(cfg, x, x, x, x, x, *grads)
        assert not ok and why.startswith(name) and words in why, why
        with pytest.raises(ValueError, match=name):
            T.launch_backward_tc(cfg, x, x, x, x, x, lse, *grads, 0.125, False, True)
        assert all(bool((gr == 1).all()) for gr in grads)  # nothing written
        assert T.can_implement(dataclasses.replace(cfg, staged_out=False), x, x, x, x, x, *grads) == (True, "")


def test_config_and_can_implement():
    for bad in (dict(block_n=48), dict(block_m=24), dict(head_dim=36), dict(head_dim=264), dict(d_slice=24),
                dict(d_slice=144), dict(input_kind="float32")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            T.TCBackwardConfig(**{**dict(block_m=16, block_n=32, head_dim=64, input_kind="float16"), **bad})
    # The grid layout: whole fragment tiles for every warp of both grids, one slice, K/V re-read.
    grid = dict(block_m=64, block_n=128, head_dim=128, input_kind="bfloat16", kv_in_registers=False)
    for bad, match in ((dict(warps_keys=3, warps_dq_rows=2), "warps_keys must divide"),
                       (dict(warps_keys=4, warps_dq_rows=0), "warps_dq_rows must divide"),
                       (dict(warps_keys=1, warps_dq_rows=2), "split the 4 16-query and 8 16-column"),
                       (dict(warps_keys=4, warps_dq_rows=8), "warps_dq_rows=8"),
                       (dict(warps_keys=4, warps_dq_rows=2, head_dim=40), "3 16-column"),
                       (dict(warps_keys=4, warps_dq_rows=2, kv_in_registers=True), "one slice")):
        with pytest.raises(ValueError, match=match):
            T.TCBackwardConfig(**{**grid, **bad})
    fa2 = T.TCBackwardConfig(**grid, warps_keys=4, warps_dq_rows=2)
    assert fa2.grid and not T.TCBackwardConfig(**grid).grid
    with pytest.raises(ValueError, match="bulk_dq"):
        T.TCBackwardConfig(**grid, bulk_dq=True)
    with pytest.raises(ValueError, match="dq_before_dk"):
        T.TCBackwardConfig(**grid, dq_before_dk=True)
    bulk = dataclasses.replace(fa2, bulk_dq=True)  # + the staging tile of dQ_i: 64 queries × 128 columns, float32
    assert T.shared_bytes(bulk, "dkdv_atomic") == 177152 + 64 * 128 * 4 and bulk.dq_warp_tile == (32, 32)
    assert T.shared_bytes(bulk, "dkdv") == 177152
    # K, V: 2 · 128 · 136; Q, dO: 2 · 2 · 64 · 136; lse2, D: 2 · 2 · 64 floats; Pᵀ, dSᵀ: 2 · 128 · 72 (16-bit)
    assert [T.shared_bytes(fa2, n) for n in ("dkdv", "dkdv_atomic")] == [177152, 177152]
    with pytest.raises(ValueError, match="needs d_slice"):  # more than 128 gradient columns per block
        T.TCBackwardConfig(16, 32, 144, "float16", kv_in_registers=False)
    with pytest.raises(ValueError, match="one slice"):
        T.TCBackwardConfig(16, 32, 144, "float16", kv_in_registers=True, d_slice=80)
    # Head dims above 128: slices of at most 128 columns; 32-query tiles of 128 keys (8 warps) where shared memory
    # allows, else of 64 keys (A100: 163 KB), else 16 × 32.
    for d, want in ((136, (80, 2)), (160, (80, 2)), (200, (112, 2)), (256, (128, 2))):
        big = T.choose_config(d, "bfloat16", simulator=False, cc=(9, 0), max_shared=227 * 1024)
        assert (big.d_slice, big.slices, big.block_m, big.block_n) == (*want, 32, 128), big
    big = T.choose_config(256, "bfloat16", simulator=False, cc=(9, 0), max_shared=227 * 1024)
    assert [T.shared_bytes(big, n) for n in T.KERNELS] == [203264, 213504, 202752]  # rows of 256 + 8 elements
    a100 = T.choose_config(256, "bfloat16", simulator=False, cc=(8, 0), max_shared=163 * 1024)
    assert (a100.block_m, a100.block_n) == (32, 64)
    assert [T.shared_bytes(a100, n) for n in T.KERNELS] == [135680, 140800, 135168]
    small = T.choose_config(256, "bfloat16", simulator=False, cc=(8, 6), max_shared=99 * 1024)
    assert (small.block_m, small.block_n) == (16, 32) and T.shared_bytes(small, "dkdv_atomic") <= 99 * 1024
    assert T.choose_config(40, "float16", simulator=False).d_smem == 48  # padded to the mma's k
    for bad_d in (36, 264):
        with pytest.raises(ValueError, match="multiples of 8 up to 256"):
            T.choose_config(bad_d, "float16", simulator=False)
    cfg = T.TCBackwardConfig(16, 32, 64, "float16")
    ok_array = np.zeros((1, 1, 8, 64), dtype=np.float16)
    assert T.can_implement(cfg, ok_array, ok_array, ok_array, ok_array) == (True, "")
    rows136 = np.zeros((1, 1, 8, 68), dtype=np.float16)[..., :64]  # 136-byte rows: not a multiple of 16 bytes
    ok, why = T.can_implement(cfg, ok_array, rows136)
    assert not ok and why.startswith("q") and "multiples of 16" in why
    ok, why = T.can_implement(cfg, np.zeros((1, 1, 8, 128), dtype=np.float16)[..., ::2])
    assert not ok and why.startswith("do") and "contiguous" in why
    shifted = np.zeros((1, 1, 8, 80), dtype=np.float16)[..., 3:67]  # rows fine, start 6 bytes in
    ok, why = T.can_implement(cfg, ok_array, ok_array, shifted)
    assert not ok and why.startswith("k") and "aligned" in why
    ok, why = T.can_implement(cfg, ok_array, ok_array, ok_array, ok_array, np.zeros((1, 1, 8, 64), np.float32))
    assert not ok and why.startswith("o") and "16-bit" in why
    # The shared-memory budgets written in the module docstring.
    d64, d128 = (T.choose_config(d, "float16", simulator=False) for d in (64, 128))
    assert [T.shared_bytes(d64, n) for n in T.KERNELS] == [56320, 65536, 55296]
    assert [T.shared_bytes(d128, n) for n in T.KERNELS] == [105472, 114688, 104448]
    # A GPU with less shared memory per block (sm_86/89: 99 KB) gets the D = 128 tiles that fit.
    small = T.choose_config(128, "float16", simulator=False, cc=(8, 6), max_shared=99 * 1024)
    assert (small.block_m, small.block_n) == (32, 64)
    assert [T.shared_bytes(small, n) for n in T.KERNELS] == [70144, 75264, 69632]
    assert T.choose_config(64, "float16", simulator=False, cc=(8, 6), max_shared=99 * 1024) == dataclasses.replace(
        d64, vector_red=False
    )
    # The atomic route above D = 64: 8 warps, 128 keys per block, where shared memory allows (else the 64 × 64 tiles);
    # before sm_90 dQ by red.global.add.
    a64, a128 = (T.choose_config(d, "bfloat16", simulator=False, cc=(8, 0), max_shared=227 * 1024, atomic=True)
                 for d in (64, 128))
    assert (a64.block_m, a64.block_n, a128.block_m, a128.block_n) == (128, 128, 64, 128)
    assert (a64.warps_keys, a64.warps_dq_rows, a128.warps_keys, a128.warps_dq_rows) == (4, 4, 4, 2)  # FA2's grids
    assert not (a64.bulk_dq or a64.dq_before_dk or a128.bulk_dq or a128.dq_before_dk)
    assert T.shared_bytes(a128, "dkdv_atomic") == 177152
    assert T.shared_bytes(a64, "dkdv_atomic") == 182272  # K, V 2·128·72; Q, dO 2·2·128·72; lse2, D; Pᵀ, dSᵀ 2·128·136
    # On sm_90: dQ by bulk reductions between the dV and dK products (+ the float32 staging tile of dQ_i), at D = 64
    # and 128; red where shared memory is short.
    for d, red, staged in ((64, a64, 128 * 64 * 4), (128, a128, 64 * 128 * 4)):
        hopper = T.choose_config(d, "bfloat16", simulator=False, cc=(9, 0), max_shared=227 * 1024, atomic=True)
        assert hopper == dataclasses.replace(red, vector_red=True, bulk_dq=True, dq_before_dk=True), d
        assert T.shared_bytes(hopper) == T.shared_bytes(red, "dkdv_atomic") + staged, d
        short = T.choose_config(d, "bfloat16", simulator=False, cc=(9, 0), max_shared=200 * 1024, atomic=True)
        assert short == dataclasses.replace(red, vector_red=True), d
    small64 = T.choose_config(64, "bfloat16", simulator=False, cc=(8, 0), max_shared=163 * 1024, atomic=True)
    assert small64 == T.choose_config(64, "bfloat16", simulator=False, cc=(8, 0), max_shared=163 * 1024)  # 64 × 64
    # Padded 96: 6 column tiles, dQ's warps 4 × 2; padded 80 (5 tiles) cannot be split: the register layout.
    a96, a72 = (T.choose_config(d, "bfloat16", simulator=False, cc=(9, 0), max_shared=227 * 1024, atomic=True)
                for d in (96, 72))
    assert (a96.warps_keys, a96.warps_dq_rows) == (4, 4) and not a72.grid and a72.block_n == 128
    assert not a96.bulk_dq and a96.dq_warp_tile == (a96.block_m // 4, 48)
    # Less shared memory (A100: 163 KB): the register layout's 64 × 128 tiles (155 KB), then the 64 × 64 ones.
    a100 = T.choose_config(128, "bfloat16", simulator=False, cc=(8, 0), max_shared=163 * 1024, atomic=True)
    assert not a100.grid and a100.block_n == 128 and not a100.bulk_dq
    assert T.shared_bytes(a100, "dkdv_atomic") == 158720  # K, V: 2 · 128 · 136; Q, dO: 2 · 2 · 64 · 136; dSᵀ 128 · 72
    fallback = T.choose_config(128, "bfloat16", simulator=False, cc=(8, 0), max_shared=150 * 1024, atomic=True)
    assert fallback == T.choose_config(128, "bfloat16", simulator=False, cc=(8, 0), max_shared=150 * 1024)
    # Vector reductions for the atomic dQ from sm_90 on; the simulator (no compute capability) takes the scalar ones.
    for sim in (False, True):
        assert T.choose_config(64, "float16", simulator=sim, cc=(9, 0)).vector_red
        assert not T.choose_config(64, "float16", simulator=sim, cc=(8, 0)).vector_red
    if SIMULATOR:
        assert not T.choose_config(64, "float16").vector_red


def ptx_jobs():
    """``(cc, target)`` of the PTX check: every target for sm_90 (the H200); for sm_80 the float16 ones and the
    grid layout's (one kind each), since the two kinds differ only in the mma's type and the final rounding."""
    return [(cc, target) for cc in (80, 90) for target in T.compile_targets(divmod(cc, 10))
            if cc == 90 or target[1].input_kind == "float16" or target[1].grid]


PTX_PARTS = 4  # separate tests, so that pytest-xdist spreads them over its workers

_PTX_SCRIPT = r"""
import json, re, sys
sys.path.insert(0, sys.argv[1])
from test_backward_tc import ptx_jobs
from nbflash._device import SIMULATOR, compile_ptx_offline, ptxas_info
assert not SIMULATOR
part, parts = int(sys.argv[2]), int(sys.argv[3])
for i, (cc, (name, cfg, kern, sig, fastmath)) in enumerate(ptx_jobs()):
    if i % parts != part:
        continue
    ptx = compile_ptx_offline(kern.py_func, sig, cc=divmod(cc, 10), fastmath=fastmath)
    info = ptxas_info(ptx, f"sm_{cc}")
    print(json.dumps(dict(kernel=name, sm=cc, head_dim=cfg.head_dim, d_pad=cfg.d_pad, slice_cols=cfg.slice_cols,
                          kind=cfg.input_kind,
                          block_m=cfg.block_m, block_n=cfg.block_n, vector_red=cfg.vector_red, grid=cfg.grid,
                          warps=cfg.warps, bulk_dq=cfg.bulk_dq,
                          bulk=ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32"),
                          local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
                          regs=info["registers"], spill_bytes=info["spill_bytes"],
                          mma=ptx.count("mma.sync.aligned.m16n8k16"),
                          atom=len(re.findall(r"\batom\.", ptx)),
                          red=len(re.findall(r"\bred\.global\.add\.f32", ptx)),
                          red_v2=len(re.findall(r"\bred\.global\.add\.v2\.f32", ptx)))), flush=True)
"""


@pytest.mark.offline
@pytest.mark.parametrize("part", range(PTX_PARTS))
def test_backward_tc_compiles_for_sm80_sm90_in_registers(part):
    """Every GPU configuration and kernel (a quarter of them per part): NVVM → PTX → ptxas (nvJitLink), no local
    memory, no spills."""
    # About 15 s a kernel on one core (the grid layout's 20–27 s): a part took about 3 minutes (four parts on
    # two workers, 6 minutes); the limit leaves room for a machine whose cores the other tests keep busy.
    rows = offline_json_rows(_PTX_SCRIPT, TESTS, str(part), str(PTX_PARTS), timeout=1800)
    jobs = ptx_jobs()
    assert len(rows) == len(jobs[part::PTX_PARTS])
    assert {cc for cc, _ in jobs} == {80, 90} and len(jobs) > len(T.compile_targets())  # both archs
    for row in sorted(rows, key=lambda r: (r["kernel"], r["head_dim"], r["kind"], r["sm"])):
        print(row)
        assert row["local"] == 0, row  # every register array really is in registers
        assert row["spill_bytes"] == 0, row
        assert row["regs"] <= 255, row
        d, d_pad, cols = row["head_dim"], row["d_pad"], row["slice_cols"]
        if row["kernel"] == "flash_backward_dq_convert_tiled_tc":  # bulk_dq's step 2': loads and stores only
            assert row["bulk_dq"] and (row["mma"], row["atom"], row["red"], row["red_v2"], row["bulk"]) == (0,) * 5, row
            continue
        if row["kernel"] == "flash_backward_dq_tc":  # unrolled: S, dP and dQ, every 16×8×16 piece
            keys = row["block_m"]
            if cols == d_pad:  # one slice: every k-step; no product for a dQ tile of padding (never stored)
                assert row["mma"] == 2 * (keys // 8) * (d_pad // 16) + (-(-d // 8)) * (keys // 16), row
            else:  # slices: each group of k-steps (one slice wide) unrolled, the loop over groups kept
                assert row["mma"] == 2 * (keys // 8) * (cols // 16) + (cols // 8) * (keys // 16), row
        if row["grid"]:  # every k-step unrolled (one device function each): the warp's share of every product
            m16, n16, d16 = row["block_m"] // 16, row["block_n"] // 16, d_pad // 16
            products = 4 * n16 * m16 * d16 + (m16 * d16 * n16 if row["kernel"].endswith("atomic_tc") else 0)
            assert row["mma"] == 2 * products // row["warps"], row  # two m16n8k16 per 16 × 16 × 16 piece
        # Atomic dQ by global reductions only (no generic-address atom): v2 pairs on sm_90, scalars on sm_80, or
        # (bulk_dq, sm_90) bulk reductions from shared memory.
        assert row["atom"] == 0, row
        assert row["vector_red"] == (row["sm"] >= 90), row
        assert not row["bulk_dq"] or row["sm"] >= 90, row
        reductions = (row["red_v2"] > 0, row["red"] > 0, row["bulk"] > 0)
        if row["kernel"] != "flash_backward_dkdv_atomic_tc":
            assert reductions == (False, False, False), row
        elif row["bulk_dq"]:
            assert reductions == (False, False, True), row
        else:
            assert reductions == ((True, False, False) if row["vector_red"] else (False, True, False)), row


def test_attention_backward_backend_choice(xp):
    """nbflash.attention_backward(backend=...): the tensor-core and SIMT backwards agree; bad requests are refused."""
    import nbflash

    rng = np.random.default_rng(7)
    q, k, v = (xp.asarray(rng.standard_normal((1, 1, n, 64)).astype(np.float16)) for n in (21, 35, 35))
    o, lse = nbflash.attention(q, k, v, causal=True, return_lse=True)
    do = xp.asarray(rng.standard_normal(q.shape).astype(np.float16))
    tc = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, backend="tensor_core")
    simt = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, backend="simt")
    for a, b in zip(tc, simt, strict=True):
        a, b = (np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64) for x in (a, b))
        assert np.abs(a - b).max() < 2e-2 * max(1.0, np.abs(b).max())
    plan = nbflash.api.plan_backward(64, "float16", 0.1, *(x for x in (do, q, k, v, o)), "auto")
    hopper = (nbflash._device.compute_capability() or (0, 0))[0] == 9
    assert plan.backend == ("simt" if nbflash.SIMULATOR else "wgmma" if hopper else "tensor_core"), plan
    f32 = xp.asarray(rng.standard_normal((1, 1, 8, 32)).astype(np.float32))
    o32, lse32 = nbflash.attention(f32, f32, f32, return_lse=True)
    with pytest.raises(ValueError, match="tensor_core.*float16 and bfloat16"):
        nbflash.attention_backward(o32, f32, f32, f32, o32, lse32, backend="tensor_core")
