"""The Hopper backward (nbflash.backward_wgmma) against the float64 textbook gradients.

In the simulator both kernels run one warpgroup (64 keys in dK/dV, 64 queries in
dQ) against 16-row streamed tiles, every product through the wgmma emulation
of :mod:`nbflash.hopper` (swizzled tiles read through descriptors, K- and
N-major, P and dS from registers), and each cp.async copy lands only at its
wait.  Short odd sequences cross every edge: ragged tiles of both kinds, causal
diagonals in both directions, rows and whole tiles that see no key.  Each
gradient must stay within twice the error of a naive backward in the same
16-bit precision (the flash-attn rule), and the inputs stay unchanged.
Without a GPU, every GPU configuration is compiled for sm_90a and assembled,
with nothing in local memory and no spills.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from offline import OFFLINE_PARTS
from test_backward_tc import check_against_reference, run_backward, unchunked_gradients
from test_forward_wgmma import offline_rows

import nbflash
from nbflash import backward_wgmma as B
from nbflash import intrinsics as I
from nbflash import tma as T
from nbflash._device import SIMULATOR, compute_capability

hopper = pytest.mark.skipif(not SIMULATOR and (compute_capability() or (0, 0))[0] != 9,
                            reason="wgmma needs a Hopper GPU (or the simulator)")


def launch(cfg, do, q, k, v, o, lse, dq, dk, dv, scale, causal, deterministic):
    B.launch_backward_wgmma(cfg, do, q, k, v, o, lse, dq, dk, dv, scale, causal, deterministic=deterministic)


@pytest.fixture(autouse=True)
def copies_land_at_their_wait(monkeypatch):
    monkeypatch.setattr(I, "SIM_CP_ASYNC_LANDS_AT_WAIT", True)
    monkeypatch.setattr(T, "SIM_TMA_LANDS_AT_WAIT", True)


# (kind, causal, seqlen_q, seqlen_k, head dim, layout)
CASES = [
    ("float16", True, 20, 37, 64, "bhsd"),  # causal, fewer queries: the last query sees every key
    ("bfloat16", True, 70, 20, 64, "bshd"),  # causal, more queries: rows see no key, a whole key tile 2 of 2
    ("bfloat16", False, 37, 70, 40, "bhsd"),  # D padded to a panel; two key tiles of 64
    ("float16", False, 1, 1, 64, "bhsd"),  # one query, one key
    ("float16", True, 33, 35, 96, "bhsd"),  # two panels: the k-steps cross them, dK/dV/dQ read them N-major
]


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,layout", CASES)
def test_backward_wgmma_matches_reference(xp, rng, kind, causal, n_q, n_k, d, layout):
    cfg = B.choose_config(d, kind)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, True, layout=layout, heads=1, cfg=cfg,
                                      launch=launch)
    check_against_reference(got, values, scale, causal, kind)


@hopper
@pytest.mark.slow
def test_backward_wgmma_two_warpgroups(xp, rng):
    """Two warpgroups (128 keys / queries per block) against 32-row streamed tiles; the keys cross a block edge."""
    cfg = B.WGBackwardConfig(128, 32, 64, "bfloat16")
    got, values, scale = run_backward(xp, rng, 70, 129, 64, "bfloat16", True, True, heads=1, cfg=cfg, launch=launch)
    check_against_reference(got, values, scale, True, "bfloat16")


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d", [("float16", True, 70, 37, 64), ("bfloat16", False, 37, 70, 40)])
def test_backward_wgmma_three_stages(xp, rng, kind, causal, n_q, n_k, d):
    """Three buffers per streamed tile (each tile's gradient products left in flight across the next tile's
    barrier): over five streamed tiles in one kernel and three in the other, the tile buffers rotate modulo 3
    and the lse2 / D buffers modulo 2.  The simulator runs each wgmma when it is issued, so the overlap
    itself is exercised on the GPU (this test there, the tile sweep's checks at up to 2048 rows)."""
    cfg = B.WGBackwardConfig(64, 16, d, kind, dkdv_stages=3, dq_stages=3)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, True, heads=1, cfg=cfg, launch=launch)
    check_against_reference(got, values, scale, causal, kind)


# The warp-specialised dK/dV kernel (``dkdv_ws``): a producer warpgroup copies by TMA, the consumers wait on
# mbarriers and hand the stages back by named barriers.  (kind, causal, seqlen_q, seqlen_k, head dim, block_m,
# stages, layout)
WS_CASES = [
    ("bfloat16", True, 70, 37, 64, 64, 2, "bshd"),  # five query tiles through two stages; rows that see no key
    ("float16", False, 37, 20, 40, 64, 3, "bhsd"),  # D padded to a panel (zero columns from the TMA); 3 stages
    ("bfloat16", False, 20, 33, 96, 64, 4, "bhsd"),  # two panels; fewer query tiles (2) than stages (4)
]


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,block_m,stages,layout", WS_CASES)
def test_backward_wgmma_warp_specialized(xp, rng, kind, causal, n_q, n_k, d, block_m, stages, layout):
    """Q_i, dO_i and the tile's lse2 / D land by TMA (one box of both rows, zeros past the last query) in
    ``stages`` buffers that rotate; K_j, V_j once on their own mbarrier.  The simulator lands each box only
    when its mbarrier's phase completes, so a consumer that read a stage before its wait would see old bytes."""
    cfg = B.WGBackwardConfig(block_m, 16, d, kind, dkdv_stages=stages, dkdv_ws=True)
    assert cfg.dkdv_threads == 2 * block_m + 128  # the consumers, then the producer
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, True, layout=layout, heads=1, cfg=cfg,
                                      launch=launch)
    check_against_reference(got, values, scale, causal, kind)


# The atomic dQ route (step 1e): 64-query streamed tiles, the M of its wgmma.  (kind, causal, seqlen_q,
# seqlen_k, head dim, block_m, layout)
ATOMIC_CASES = [
    ("bfloat16", True, 70, 37, 64, 64, "bshd"),  # two query tiles, the second ragged; rows that see no key
    ("float16", False, 37, 70, 40, 64, "bhsd"),  # D padded to a panel; two key blocks add into the same dQ rows
    ("bfloat16", False, 33, 70, 96, 128, "bhsd"),  # two warpgroups, a panel of dQ's columns each; a ragged block
    # three query tiles: ws reuses the first dSᵀ buffer (tile 2 after tile 1's barrier), the others refill a stage
    ("float16", False, 150, 70, 64, 128, "bshd"),
]


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,block_m,layout", ATOMIC_CASES)
@pytest.mark.parametrize("ws,bulk,mn", [(False, False, False), (True, False, False), (True, True, False),
                                         (False, False, True), (True, True, True)])
def test_backward_wgmma_atomic_dq(xp, rng, kind, causal, n_q, n_k, d, block_m, layout, ws, bulk, mn):
    """dQ by float32 atomics inside the dK/dV kernel: dSᵀ through a shared tile, read back transposed by
    ldmatrix as the A operand of ``dQ_i += dS K_j`` (K_j N-major), each warpgroup adding its panel of
    columns into the padded accumulator; then the SIMT conversion.  ``ws``: the warp-specialised kernel, its
    consumers meeting at a named barrier over two alternating dSᵀ tiles.  ``bulk``: each warp stages its part
    of dQ_i in shared memory and one bulk reduction per warp and tile adds it into an accumulator in fragment
    order, read back by ``backward_tc``'s tiled conversion (the simulator performs a reduction only at the wait
    that covers its read, so a staging rewritten too early, or never waited for, gives a wrong dq).  ``mn``: the
    dSᵀ tile stored swizzled and read MN-major by the dQ wgmma itself (``ds_mn_major``).  (Its proxy fence is
    not tested here: the simulator's check is per block and passes once any thread has fenced, which the
    kernel's other fences do; the GPU tests run it.)"""
    cfg = B.WGBackwardConfig(block_m, 64, d, kind, dkdv_ws=ws, bulk_dq=bulk, ds_mn_major=mn)
    assert B.takes_atomic(cfg)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, False, layout=layout, heads=1, cfg=cfg,
                                      launch=launch)
    check_against_reference(got, values, scale, causal, kind)


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,overlap", [("bfloat16", True, 150, 130, True),
                                                          ("float16", False, 130, 70, False)])
def test_backward_wgmma_atomic_dq_chunk_split(xp, rng, kind, causal, n_q, n_k, overlap):
    """D = 64 with 128-query streamed tiles: the two consumer warpgroups split dQ_i's 64-query chunks (one each)
    instead of warpgroup 0 computing all of it; bulk reductions; ``overlap``: the dQ product issued while dV
    and dK still run (the tile's stage handed back after all three)."""
    cfg = B.WGBackwardConfig(128, 128, 64, kind, dkdv_ws=True, bulk_dq=True, dq_overlap=overlap, dq_chunk_split=True)
    assert cfg.dq_cols == 64
    got, values, scale = run_backward(xp, rng, n_q, n_k, 64, kind, causal, False, heads=1, cfg=cfg, launch=launch)
    check_against_reference(got, values, scale, causal, kind)


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,bulk,mn", [
    ("bfloat16", True, 150, 130, 128, True, False),  # three query tiles: a stage refilled after its late release
    ("float16", False, 70, 37, 120, False, True),  # D padded to 128; dS read MN-major; rows that see no key
])
def test_backward_wgmma_atomic_dq_dk_last(xp, rng, kind, causal, n_q, n_k, d, bulk, mn):
    """``dk_last``: the ws kernel's tile ends with dQ's product, then dK's, and waits only for dQ's; dK's runs on
    into the next tile and is waited for with its Sᵀ, which hands the stage back a tile late (the last one after
    the loop).  Copies land only at their mbarrier wait here, so a stage refilled before dK has read it, or a
    release miscounted, gives a wrong dk or a hang."""
    cfg = B.WGBackwardConfig(128, 64, d, kind, dkdv_ws=True, bulk_dq=bulk, ds_mn_major=mn, dk_last=True)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, False, heads=1, cfg=cfg, launch=launch)
    check_against_reference(got, values, scale, causal, kind)


# The head dim cut into slices of gradient columns, one block each (as above D = 128 on the GPU).  (kind, causal,
# seqlen_q, seqlen_k, head dim, d_slice); dQ by its own kernel (the atomic route takes no slices).
SLICED = [
    ("bfloat16", True, 37, 35, 128, 64),  # two slices of one panel
    ("float16", False, 20, 33, 136, 128),  # padded 192: two slices of two panels, the last one zero
]


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,d_slice", SLICED)
def test_backward_wgmma_head_dim_slices(xp, rng, kind, causal, n_q, n_k, d, d_slice):
    cfg = B.WGBackwardConfig(64, 16, d, kind, d_slice=d_slice)
    assert cfg.slices == 2
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, True, heads=1, cfg=cfg, launch=launch)
    check_against_reference(got, values, scale, causal, kind)


def test_atomic_route_needs_64_query_tiles():
    cfg = B.WGBackwardConfig(64, 16, 64, "float16")
    assert not B.takes_atomic(cfg)
    with pytest.raises(ValueError, match="block_n a multiple of 64"):
        B.dkdv_wgmma_kernel(cfg, True)
    if SIMULATOR:
        x = np.zeros((1, 1, 16, 64), np.float16)
        lse = np.zeros((1, 1, 16), np.float32)
        with pytest.raises(ValueError, match="block_n a multiple of 64"):
            B.launch_backward_wgmma(cfg, x, x, x, x, x, lse, x.copy(), x.copy(), x.copy(), 0.125, False,
                                    deterministic=False)


# The last step: dK, dV staged over the K_j, V_j tiles (dQ over Q_i, dO_i) and written in 16-byte chunks.  (kind,
# causal, seqlen_q, seqlen_k, head dim, block_m, block_n, d_slice, ws, deterministic, layout)
STAGED_CASES = [
    # ws, atomic dQ by bulk reductions, two warpgroups: one block of 70 keys, the rows past the end not written
    ("bfloat16", True, 150, 70, 64, 128, 64, 0, True, False, "bshd"),
    # D padded to a panel: 5 chunks of 8 per row; causal, more queries: rows that see no key get dQ = 0
    ("float16", True, 45, 37, 40, 64, 16, 0, False, True, "bhsd"),
    ("bfloat16", True, 20, 33, 96, 64, 16, 0, True, True, "bhsd"),  # ws, dQ by its own kernel; 12-chunk rows
    ("float16", False, 20, 33, 136, 64, 16, 128, False, True, "bhsd"),  # slices: the second one a single chunk
]


@hopper
@pytest.mark.parametrize("kind,causal,n_q,n_k,d,block_m,block_n,d_slice,ws,det,layout", STAGED_CASES)
def test_backward_wgmma_last_step(xp, rng, kind, causal, n_q, n_k, d, block_m, block_n, d_slice, ws, det, layout):
    """Both kernels' last step through shared memory: the dK/dV kernel's consumers meet, each warp packs its 16
    keys' rows of dK · scale, then dV, over the K_j, V_j tiles and writes whole 16-byte chunks of them — of its
    slice's columns, skipping head-dim padding and keys past the end; the dQ kernel (``det``) the same with dQ
    over Q_i, dO_i.  (Outputs are poisoned first, so a chunk left unwritten fails too.)"""
    cfg = B.WGBackwardConfig(block_m, block_n, d, kind, d_slice=d_slice, dkdv_ws=ws, bulk_dq=not det)
    got, values, scale = run_backward(xp, rng, n_q, n_k, d, kind, causal, det, layout=layout, heads=1, cfg=cfg,
                                      launch=launch)
    check_against_reference(got, values, scale, causal, kind)


@hopper
def test_gradients_need_rows_of_whole_chunks(xp):
    """The kernels write dq, dk and dv in 16-byte chunks of rows (their last step): gradients whose rows are not
    16 bytes apart, or whose data does not start on 16 bytes, are refused by name before any launch, and the
    gradients are left as they were."""
    cfg = B.WGBackwardConfig(64, 16, 64, "float16")
    x, lse, cases = unchunked_gradients(xp)
    assert B.can_implement(cfg, x, x, x, x, x, x, x, x) == (True, "")
    for name, grads, words in cases:
        ok, why = B.can_implement(cfg, x, x, x, x, x, *grads)
        assert not ok and why.startswith(name) and words in why, why
        with pytest.raises(ValueError, match=f"cannot run: {name}"):
            B.launch_backward_wgmma(cfg, x, x, x, x, x, lse, *grads, 0.125, False)
        assert all(bool((gr == 1).all()) for gr in grads)  # nothing written


@hopper
def test_api_backward_wgmma(xp, rng):
    """``backend="wgmma"`` through nbflash.attention_backward: the same gradients as the SIMT backward."""
    q, k, v, do = (xp.asarray(rng.standard_normal((1, 2, n, 64)).astype(np.float16)) for n in (19, 33, 33, 19))
    o, lse = nbflash.attention(q, k, v, causal=True, return_lse=True, backend="simt")
    plan = nbflash.api.plan_backward(64, "float16", 0.125, do, q, k, v, o, "wgmma")
    assert plan.backend == "wgmma" and isinstance(plan.config, B.WGBackwardConfig)
    got = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, backend="wgmma")
    want = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, backend="simt")
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(host(g).astype(np.float32), host(w).astype(np.float32), atol=4e-3, rtol=2e-2)


@pytest.mark.parametrize("backend,head_dim,ws,default", [
    ("simt", 16, "", False), ("tensor_core", 16, "", True), ("tensor_core", 64, "", None),
    ("tensor_core", 72, "", False), ("tensor_core", 128, "", False), ("wgmma", 16, "", True),
    ("wgmma", 64, "ws", True), ("wgmma", 128, "ws", True), ("wgmma", 64, "bulk", False), ("wgmma", 40, "bulk", False),
    ("wgmma", 72, "bulk", False), ("wgmma", 128, "bulk", False)])
def test_default_dq_route(monkeypatch, backend, head_dim, ws, default):
    """``deterministic=None`` takes the dQ route ``attention_backward`` documents for each kernel family (atomic for
    SIMT; for mma.sync deterministic up to a padded D of 64 unless its atomic tiles there are the warp grid, as on
    sm_90 (``None`` above: read from its configuration), atomic above; for wgmma deterministic, but atomic where
    the warp-specialised dK/dV kernel adds dQ by bulk reductions, as measured), and an explicit ``True``/``False``
    reaches the launcher as given (wgmma: where the configuration has the atomic route)."""
    api = nbflash.api
    seen = []

    def record(cfg, *args, deterministic, **kw):
        seen.append(deterministic)

    monkeypatch.setattr(api._bwd, "launch_backward", record)
    monkeypatch.setattr(api._bwd_tc, "launch_backward_tc", record)
    monkeypatch.setattr(api._bwd_wg, "launch_backward_wgmma", record)
    monkeypatch.setattr(api._bwd_wg, "can_implement", lambda *a, **kw: (True, ""))
    cfg = {"simt": object(), "tensor_core": nbflash.backward_tc.TCBackwardConfig(16, 32, head_dim, "float16"),
           "wgmma": B.WGBackwardConfig(128 if ws else 64, 64, head_dim, "float16", dkdv_ws=bool(ws),
                                       bulk_dq=ws == "bulk")}[backend]
    if default is None:
        default = not nbflash.backward_tc.choose_config(head_dim, "float16", atomic=True).grid
    plan = api.Plan(backend, cfg, "test")
    x = np.zeros((1, 1, 4, 16), np.float16)
    for choice in (None, True, False):
        api.run_backward(plan, x, x, x, x, x, x, x, x, x, 0.25, False, deterministic=choice, stream=0)
    assert seen == [default, True, False]
    if backend == "wgmma":
        assert B.prefers_atomic(cfg) == (not default)


def test_config_validation():
    for bad in (dict(block_m=96), dict(block_n=24), dict(head_dim=264), dict(head_dim=36), dict(input_kind="float32"),
                dict(dq_stages=4), dict(dkdv_stages=1), dict(dkdv_stages=4), dict(d_slice=96),
                dict(dkdv_stages=5, dkdv_ws=True), dict(bulk_dq=True)):
        args = dict(block_m=64, block_n=16, head_dim=64, input_kind="float16") | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            B.WGBackwardConfig(**args)
    # The GPU defaults up to D = 128: two consumer warpgroups and a producer, registers moved by setmaxnreg; one
    # lse2 / D buffer per stage.  Without TMA (config_for's fallback) the previous picks.
    ws = B.choose_config(128, "bfloat16", simulator=False)
    assert ws.dkdv_ws and ws.setmaxnreg and ws.dkdv_threads == 384 and ws.column_buffers == ws.dkdv_stages == 2
    assert B.choose_config(64, "bfloat16", simulator=False) == B.WGBackwardConfig(128, 64, 64, "bfloat16", dq_stages=3,
                                                                                  dkdv_ws=True, bulk_dq=True,
                                                                                  dq_overlap=True)
    assert ws.bulk_dq and not ws.dq_overlap and B.prefers_atomic(ws)  # (D = 128: ptxas would serialise the overlap)
    assert B.choose_config(64, "bfloat16", simulator=False, ws=False) == B.WGBackwardConfig(64, 64, 64, "bfloat16")
    assert not B.choose_config(128, "bfloat16", simulator=False, ws=False).dkdv_ws
    four = B.WGBackwardConfig(128, 64, 128, "float16", dkdv_stages=4, dkdv_ws=True)  # four Q_i, dO_i buffers, four
    assert B.shared_bytes(four) == (64 + 4 * 32) * 1024 + 4 * 2 * 64 * 4  # lse2 / D buffers
    # Each kernel has its own stages: the ws dK/dV kernel 2 (K_j, V_j 64 KB, Q_i, dO_i 2 · 32 KB), the dQ kernel 3.
    assert B.shared_bytes(ws, "dkdv") == (64 + 2 * 32) * 1024 + 2 * 2 * 64 * 4
    assert B.shared_bytes(ws, "dq") == (64 + 3 * 32) * 1024 + 2 * 2 * 64 * 4
    # step 1e with ws: two alternating dSᵀ tiles of 128 keys × (64 + 8) queries; bulk_dq: + dQ_i's float32 staging
    red = B.WGBackwardConfig(128, 64, 128, "bfloat16", dkdv_ws=True)
    assert B.shared_bytes(red, "dkdv_atomic") == B.shared_bytes(red, "dkdv") + 2 * 128 * 72 * 2
    # ds_mn_major: 128 × 64 each, unpadded (swizzled), from a 1024-byte line (the dK/dV layout's 132,096 B is one)
    mn = B.WGBackwardConfig(128, 64, 128, "bfloat16", dkdv_ws=True, ds_mn_major=True)
    assert B.shared_bytes(mn, "dkdv") == 132_096 == 129 * 1024
    assert B.shared_bytes(mn, "dkdv_atomic") == B.shared_bytes(mn, "dkdv") + 2 * 128 * 64 * 2
    assert B.ds_panel_bytes(mn) == 128 * 128 and B.ds_pitch(mn) == 64
    odd = B.WGBackwardConfig(64, 16, 40, "bfloat16")  # 16-query tiles: a layout that ends off a 1024-byte line
    assert B.shared_offsets(odd, odd.dkdv_stages)[-1] * 2 % 1024 != 0 and B.dq_staging(odd)[0] * 2 % 1024 != 0
    assert B.dq_staging(dataclasses.replace(odd, block_n=64, ds_mn_major=True))[0] * 2 % 1024 == 0
    with pytest.raises(ValueError, match="ds_mn_major"):
        B.WGBackwardConfig(64, 16, 40, "bfloat16", ds_mn_major=True)  # 16-query tiles: no atomic route
    bulk = B.WGBackwardConfig(128, 64, 128, "bfloat16", dkdv_ws=True, bulk_dq=True)
    assert B.shared_bytes(bulk, "dkdv_atomic") == B.shared_bytes(red, "dkdv_atomic") + 64 * 128 * 4 <= 227 * 1024
    assert bulk.dq_cols == 64 and bulk.dq_tiles.warp_tile == (16, 64) and bulk.dq_tiles.rows == 64
    # D = 64: one 64-column panel, all of it computed by warpgroup 0 (64-query tiles) or a 64-query chunk by each
    one = B.WGBackwardConfig(128, 64, 64, "bfloat16", bulk_dq=True)
    assert one.dq_tiles.warp_tile == (16, 64)
    with pytest.raises(ValueError, match="dq_chunk_split"):
        B.WGBackwardConfig(128, 64, 64, "bfloat16", dq_chunk_split=True)  # one chunk: nothing to split
    with pytest.raises(ValueError, match="dq_chunk_split"):
        B.WGBackwardConfig(128, 128, 128, "bfloat16", dq_chunk_split=True)  # the warpgroups split the columns
    with pytest.raises(ValueError, match="dq_overlap"):
        B.WGBackwardConfig(128, 64, 64, "bfloat16", dq_overlap=True)  # the ws kernel's
    with pytest.raises(ValueError, match="dk_last"):
        B.WGBackwardConfig(128, 64, 128, "bfloat16", bulk_dq=True, dk_last=True)  # the ws kernel's
    with pytest.raises(ValueError, match="dk_last"):
        B.WGBackwardConfig(128, 64, 64, "bfloat16", dkdv_ws=True, dk_last=True)  # D = 64: warpgroup 0 alone on dQ
    with pytest.raises(ValueError, match="dk_last"):
        B.WGBackwardConfig(128, 128, 128, "bfloat16", dkdv_ws=True, dk_last=True)  # two 64-query chunks
    assert B.WGBackwardConfig(128, 64, 128, "bfloat16", dkdv_ws=True, bulk_dq=True, dk_last=True).dk_last
    with pytest.raises(ValueError, match="needs d_slice"):
        B.WGBackwardConfig(64, 16, 136, "float16")
    # Above D = 128: two slices of 128 columns; auto takes them where both slices are whole (D > 192, measured
    # faster than the mma.sync backward), and keeps the mma.sync backward at a padded 192 (not timed).
    big = B.choose_config(256, "bfloat16", simulator=False)
    assert (big.block_m, big.block_n, big.d_slice, big.slices, big.d_smem) == (64, 64, 128, 2, 256)
    assert B.shared_bytes(big) == 192 * 1024 + 2 * 2 * 64 * 4
    assert not B.takes_atomic(big)  # slices: dQ by its own kernel only (ptxas serialised the atomic kernel's wgmmas)
    with pytest.raises(ValueError, match="one slice"):
        B.dkdv_wgmma_kernel(big, True)
    assert B.choose_config(192, "bfloat16", simulator=False).d_smem == 256  # padded 192: a zero panel
    assert B.takes_head_dim(256) and not B.takes_head_dim(264) and B.AUTO_MAX_HEAD_DIM == 128
    assert [d for d in range(8, 265, 8) if B.auto_takes_head_dim(d)] == [*range(8, 129, 8), *range(200, 257, 8)]
    # K, V (or Q, dO) once, Q, dO (or K, V) twice: 128 × 64 tiles at D = 128 are 2 · 32 + 4 · 16 KB.
    assert B.shared_bytes(B.WGBackwardConfig(128, 64, 128, "float16")) == 128 * 1024 + 2 * 2 * 64 * 4  # + lse2, D
    three = B.WGBackwardConfig(128, 64, 128, "float16", dq_stages=3)  # a third streamed buffer of each: + 32 KB
    assert B.shared_bytes(three, "dq") == (128 + 32) * 1024 + 2 * 2 * 64 * 4
    assert B.shared_bytes(three, "dkdv") == 128 * 1024 + 2 * 2 * 64 * 4  # (the dK/dV kernel keeps 2)


@pytest.mark.offline
@pytest.mark.parametrize("part", range(OFFLINE_PARTS))
def test_gpu_configurations_compile_for_sm90a_without_local_memory(part):
    for _, row in offline_rows("nbflash.backward_wgmma", part):
        assert row["ok"], row["log"]
        assert row["local"] == 0 and row["spill"] in (0, None), row
        assert not row["serialized"], row  # ptxas would wait for each wgmma before the next (its C75xx notes)
        assert row["a_in_shared"] and row["a_in_registers"], row  # S-like products; dV, dK, dQ with A in registers
