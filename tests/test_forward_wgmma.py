"""The Hopper forward kernel (nbflash.forward_wgmma) against the float64 textbook formula.

In the simulator the tiles are one warpgroup (64 queries) × 16 keys, so short
odd sequences cross every edge (ragged query and key tiles, causal diagonals in
both directions, rows that see no key), and every wgmma runs through the
emulation of :mod:`nbflash.hopper`, which reads the swizzled shared tiles
through their descriptors as the hardware does: a wrong descriptor, panel
step or fragment index fails here.  The error must stay within twice that of a
naive attention in the same 16-bit precision (the flash-attn rule).  Without a
GPU, every GPU configuration is compiled for sm_90a and assembled, with nothing
in local memory and no spills.  On a GPU the same tests run where it is a
Hopper (compute capability 9.x), and check that other GPUs refuse the backend.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types

import numpy as np
import pytest
from offline import OFFLINE_PARTS, TESTS, find_nvdisasm, offline_json_rows, part_of
from test_forward_tc import run_and_check, to_kind

import nbflash
from nbflash import forward_wgmma as W
from nbflash import intrinsics as I
from nbflash import tma as TMA
from nbflash._device import SIMULATOR, compute_capability

hopper = pytest.mark.skipif(not SIMULATOR and (compute_capability() or (0, 0))[0] != 9,
                            reason="wgmma needs a Hopper GPU (or the simulator)")
launch = W.launch_forward_wgmma

# Simulator tiles: 64 queries (one warpgroup) × 16 keys.
SEQLENS = [(1, 1), (17, 20), (70, 37), (7, 40)]
# (kind, pipeline): the overlapped pipeline in both kinds, the plain one in one (its copies are kind-blind).
KIND_PIPELINES = [("float16", "overlap"), ("bfloat16", "overlap"), ("bfloat16", "plain")]


@pytest.fixture(autouse=True)
def copies_land_at_their_wait(monkeypatch):
    """In the simulator each cp.async copy lands only at the wait that covers it (NaN until then), and each TMA
    box only when a thread first sees its mbarrier's phase complete: a tile read before its wait and barrier, or
    refilled while still read, fails these tests."""
    monkeypatch.setattr(I, "SIM_CP_ASYNC_LANDS_AT_WAIT", True)
    monkeypatch.setattr(TMA, "SIM_TMA_LANDS_AT_WAIT", True)


@hopper
@pytest.mark.parametrize("n_q,n_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind,pipeline", KIND_PIPELINES)
def test_forward_wgmma_matches_reference(xp, rng, n_q, n_k, causal, kind, pipeline):
    cfg = dataclasses.replace(W.choose_config(64, kind, copies="cp.async"), pipeline=pipeline)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, heads=1, launch=launch)


@hopper
@pytest.mark.parametrize("d", [40, 96, 176, 256])
def test_forward_wgmma_padded_and_paneled_head_dims(xp, rng, d):
    """D padded to whole 64-column panels (40 → 64, 96 → 128, 176 → 192) and several panels: the k-steps of
    S = Q Kᵀ cross panels, and P V reads V's panels through the descriptor's leading byte offset."""
    run_and_check(xp, rng, 21, 35, d, "bfloat16", True, cfg=W.choose_config(d, "bfloat16"), heads=1, launch=launch)


@hopper
@pytest.mark.parametrize("pipeline", ["plain", "overlap", "pingpong"])
def test_forward_wgmma_two_warpgroups_bshd(xp, rng, pipeline):
    """Two warpgroups per block (128 queries), 32-key tiles, on strided bshd views; in every pipeline, the
    pingpong one taking turns through named barriers."""
    cfg = W.WGConfig(128, 32, 64, "float16", pipeline)
    run_and_check(xp, rng, 130, 45, 64, "float16", True, cfg=cfg, layout="bshd", batch=2, heads=1, launch=launch)


@hopper
@pytest.mark.parametrize("pipeline,stages,kind,causal,n_q,n_k", [
    ("ws", 2, "bfloat16", True, 130, 75), ("ws", 3, "float16", False, 70, 83), ("ws", 4, "bfloat16", True, 9, 100),
    ("ws-overlap", 3, "float16", True, 130, 75), ("ws-overlap", 4, "bfloat16", False, 40, 110)])
@pytest.mark.parametrize("copies", ["cp.async", "tma"])
def test_forward_wgmma_warp_specialized(xp, rng, pipeline, stages, kind, causal, n_q, n_k, copies):
    """The ws pipelines: a producer warpgroup copies K/V tiles into ``stages`` buffers and hands them over through
    named barriers (FULL / EMPTY), the two warpgroups take turns (ws-overlap: each also overlaps its softmax with
    its own P V).  Copies land only at the producer's wait, so a
    stage read before its FULL handshake or refilled before its EMPTY one is NaN here.  Sizes cross the stages
    more than once (up to 7 key tiles of 16), with ragged tails, a query block whose rows see no key, and bshd."""
    # setmaxnreg (the producer's registers to the consumers) on the GPU's ws-overlap default, and on one ws pipeline
    regs = copies == "tma" and (pipeline, stages) in (("ws-overlap", 3), ("ws", 2))
    cfg = W.WGConfig(128, 16, 64, kind, pipeline, stages=stages, copies=copies, setmaxnreg=regs)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", heads=1, launch=launch)


@hopper
@pytest.mark.parametrize("pipeline,stages,kind,causal,n_q,n_k,batch,heads", [
    ("ws-overlap", 3, "bfloat16", True, 130, 75, 2, 2),  # 8 causal items in pairs, 2 pairs per block
    ("ws-overlap", 4, "float16", False, 130, 45, 1, 3),  # 6 items, 3 per block
    ("ws", 2, "float16", True, 300, 40, 1, 2),  # items that see no key; a pair that spans two heads
])
def test_forward_wgmma_persistent(xp, rng, pipeline, stages, kind, causal, n_q, n_k, batch, heads):
    """Persistent ws blocks (one per multiprocessor; the simulator has 2): each block takes several work items, the
    producer copies the next item's tiles and its Q_i while the consumers finish the item before, the stages and
    the turns run on across items, and an item that sees no key only writes its rows."""
    cfg = W.WGConfig(128, 16, 64, kind, pipeline, stages=stages, copies="tma", setmaxnreg=True, persistent=True)
    n_qt = -(-n_q // 128)
    blocks = W.work_grid(cfg, batch, heads, n_q, causal)[0]
    if SIMULATOR:
        assert blocks == 2 and -(-n_qt * batch * heads // (2 if causal else 1)) > blocks  # several chunks a block
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", batch=batch, heads=heads,
                  launch=launch)


@hopper
@pytest.mark.parametrize("pipeline,stages,kind,causal,n_q,n_k,batch,heads,persistent,split", [
    ("ws-overlap", 3, "bfloat16", True, 200, 75, 2, 1, True, False),  # 4 causal items: a pair per block, ragged
    ("ws-overlap", 2, "float16", False, 130, 60, 1, 1, False, True),  # the only item sees no key past row 191
    ("ws", 2, "float16", True, 9, 100, 1, 1, False, False),  # rows that see no key in every warpgroup
])
def test_forward_wgmma_three_consumers(xp, rng, pipeline, stages, kind, causal, n_q, n_k, batch, heads, persistent,
                                       split):
    """``block_m=192``: three consumer warpgroups take turns in a ring (0 → 1 → 2 → 0) over named barriers
    TURN_0 … TURN_0 + 2, with the FULL / EMPTY barriers after them and ``setmaxnreg``'s three-way split.  A
    warpgroup that skipped its turn's wait, or a ring that ended with a hand-over nobody took, hangs or fails here;
    a wrong row offset of the third warpgroup's Q (rows 128 … 191) fails the check."""
    cfg = W.WGConfig(192, 16, 64, kind, pipeline, stages=stages, copies="tma", setmaxnreg=True,
                     persistent=persistent, split_kv=split)
    assert cfg.threads == 512 and cfg.register_split == (32, 160)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", batch=batch, heads=heads,
                  launch=launch)


@hopper
@pytest.mark.parametrize("pipeline,stages,kind,causal,n_q,n_k,batch,heads,persistent", [
    ("ws-overlap", 2, "bfloat16", True, 130, 75, 1, 1, False),  # 2 stages: K_j refilled while V_j is still read
    ("ws", 2, "float16", False, 70, 83, 1, 1, False),
    ("ws-overlap", 4, "float16", False, 40, 110, 1, 1, False),  # named barriers up to 15 (VEMPTY + 3)
    ("ws-overlap", 2, "bfloat16", True, 130, 75, 2, 2, True),  # stages and turns across items, in pairs
])
def test_forward_wgmma_split_kv(xp, rng, pipeline, stages, kind, causal, n_q, n_k, batch, heads, persistent):
    """``split_kv``: K_j and V_j land on their own mbarriers and are released on their own named barriers (K once
    S_j has landed, V once P_j V_j has), so the producer refills K_{j+2} while V_j is still read.  A consumer that
    skips the wait for V reads the previous tile's V here (the boxes land when a thread first sees their phase):
    that mutation failed these cases by an error of 5.1 against a bound of 0.007."""
    cfg = W.WGConfig(128, 16, 64, kind, pipeline, stages=stages, copies="tma", setmaxnreg=True,
                     persistent=persistent, split_kv=True)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", batch=batch, heads=heads,
                  launch=launch)


@hopper
@pytest.mark.parametrize("d,kind,causal,n_q,n_k,layout", [
    (256, "bfloat16", True, 130, 45, "bshd"),  # four panels; causal, ragged, rows that see no key
    (176, "float16", False, 70, 53, "bhsd"),  # padded to three panels (the third a quarter zeros)
])
def test_forward_wgmma_ws_wide_head_dims(xp, rng, d, kind, causal, n_q, n_k, layout):
    """D > 128 on the ws-overlap kernel with TMA (2 split stages, persistent blocks, ``setmaxnreg``): one box per
    panel of each tile, S = Q Kᵀ's k-steps unrolled across the panels (``ss_product(unrolled=True)``), the
    producer and consumers on :data:`~nbflash.forward_wgmma.WIDE_REGISTER_SPLIT`.  Not a pick yet (untimed)."""
    cfg = W.WGConfig(128, 16, d, kind, "ws-overlap", stages=2, copies="tma", setmaxnreg=True, persistent=True,
                     split_kv=True)
    assert cfg.register_split == W.WIDE_REGISTER_SPLIT
    assert 128 * cfg.register_split[0] + 256 * cfg.register_split[1] <= 384 * 168  # what the launch holds
    run_and_check(xp, rng, n_q, n_k, d, kind, causal, cfg=cfg, layout=layout, heads=1, launch=launch)


@hopper
@pytest.mark.parametrize("block_m,pipeline,stages,seam,kind,causal,n_q,n_k,batch,heads,persistent,split", [
    # persistent causal pairs, ragged: seams within and across chunks, the first masked tile at the seam
    (128, "ws-overlap", 3, True, "bfloat16", True, 200, 75, 2, 1, True, False),
    # 5 non-causal items on 2 blocks: Q buffers refilled (items 3, 4), one-tile items (n_k <= block_n)
    (128, "ws-overlap", 3, True, "float16", False, 300, 16, 1, 2, True, False),
    # items that see no key after items with keys (the previous item finished alone), split K/V: per head the
    # items are query tiles 2 (keys), 0 (none), 1 (keys); two blocks, chunks of two
    (128, "ws-overlap", 2, True, "float16", True, 300, 150, 1, 2, True, True),
    # three consumers, two Q buffers without the seam (the ws pipeline and ws-overlap)
    (192, "ws-overlap", 3, False, "bfloat16", False, 200, 45, 2, 1, True, False),
    (128, "ws", 2, False, "float16", True, 200, 75, 2, 1, True, False),
    # three consumers with the seam, one block per chunk (a causal pair: query tiles 2 and 0, then 1 alone)
    (192, "ws-overlap", 3, True, "float16", True, 400, 390, 1, 1, False, False),
])
def test_forward_wgmma_two_q_buffers(xp, rng, block_m, pipeline, stages, seam, kind, causal, n_q, n_k, batch, heads,
                                     persistent, split):
    """``q_buffers=2``: the producer copies each item's Q_i into the buffer the item before last used (after
    QEMPTY + u), so consumers find it landed; ``seam=True``: an item's last P V and the next item's S_0 share one
    turn, the previous item's O written after it.  A seam that wrote the new item's rows, reused the wrong Q buffer
    or rescaled the new item's O by the old rows' factors fails the check; a release left untaken hangs."""
    cfg = W.WGConfig(block_m, 16, 64, kind, pipeline, stages=stages, copies="tma", setmaxnreg=True,
                     persistent=persistent, split_kv=split, q_buffers=2, seam=seam)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", batch=batch, heads=heads,
                  launch=launch)


@hopper
@pytest.mark.parametrize("block_m,pipeline,stages,kind,causal,n_q,n_k,batch,heads,extra,launches", [
    # causal pairs, ragged, 4 chunks on 2 blocks; a second launch on the counter the first one left
    (128, "ws-overlap", 3, "bfloat16", True, 200, 75, 2, 2, {}, 2),
    # three consumers, 6 non-causal items; the seam across dynamically taken items
    (192, "ws-overlap", 3, "float16", False, 400, 45, 1, 2, {"q_buffers": 2, "seam": True}, 1),
    # the ws pipeline, split K/V; items that see no key (query tiles past the keys, causal)
    (128, "ws", 2, "float16", True, 300, 150, 1, 2, {"split_kv": True}, 1),
    # causal items one at a time, longest first (no pairs), ragged, query tile 0 sees no key; the seam between them
    (128, "ws-overlap", 3, "float16", True, 260, 130, 1, 2, {"causal_pairs": False, "q_buffers": 2, "seam": True}, 1),
])
def test_forward_wgmma_dynamic_scheduler(xp, rng, monkeypatch, block_m, pipeline, stages, kind, causal, n_q, n_k,
                                         batch, heads, extra, launches):
    """``dynamic=True``: a persistent block takes its first chunk by its index and the next ones off the work
    counter (the issuing thread fetches, publishes each in a slot on an mbarrier, every other thread reads it and
    releases the slot).  A block that missed a chunk or took one twice fails the check (the outputs start as NaN);
    the last block must set the counter back to zero, which is asserted after every launch.  The first case
    launches twice on one counter, as launches on one stream do (one simulated launch of each of the others is
    enough: the assertion already sees the counter the next launch would find)."""
    cfg = W.WGConfig(block_m, 16, 64, kind, pipeline, stages=stages, copies="tma", setmaxnreg=True, persistent=True,
                     dynamic=True, **extra)
    chunks = -(-(-(-n_q // block_m) * batch * heads) // (2 if causal and cfg.causal_pairs else 1))
    if SIMULATOR:
        assert W.work_grid(cfg, batch, heads, n_q, causal)[0] == 2 < chunks  # chunks handed out at run time
    counter = xp.zeros(2, np.int32)
    monkeypatch.setattr(W, "work_counter", lambda cfg: counter)
    for _ in range(launches):
        run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", batch=batch, heads=heads,
                      launch=launch)
        assert counter.tolist() == [0, 0]  # the last block set it back


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="real tiles on a Hopper GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_forward_wgmma_dynamic_scheduler_streams(xp, rng, causal):
    """On the GPU each stream takes its own pair of work counters from the device's pool, and the kernel leaves
    it at zero: launches on two streams, twice each, at real tiles (several chunks per block)."""
    import cupy as cp

    cfg = W.WGConfig(192, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", setmaxnreg=True,
                     persistent=True, dynamic=True)
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    for s in streams * 2:
        with s:
            run_and_check(xp, rng, 1000, 1100, 64, "bfloat16", causal, cfg=cfg, batch=4, heads=16,
                          launch=functools.partial(launch, stream=s.ptr))
    device = cp.cuda.Device().id
    assert W._counters[(device, streams[0].ptr)] is not W._counters[(device, streams[1].ptr)]
    for s in streams:
        s.synchronize()
        assert W._counters[(device, s.ptr)].tolist() == [0, 0]


def test_dynamic_scheduler_needs_persistent_blocks():
    with pytest.raises(ValueError, match="persistent"):
        W.WGConfig(128, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", dynamic=True)


def test_causal_items_one_at_a_time():
    """``causal_pairs=False``: a causal chunk is one work item (the grid counts items, not pairs; the items run
    longest first); refused where causal items are not paired (no TMA producer)."""
    cfg = W.WGConfig(128, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", causal_pairs=False)
    assert W.work_grid(cfg, 2, 3, 1000, True) == (2 * 3 * 8, 1, 1)
    assert W.work_grid(dataclasses.replace(cfg, causal_pairs=True), 2, 3, 1000, True) == (2 * 3 * 8 // 2, 1, 1)
    assert W.work_grid(cfg, 2, 3, 1000, False) == (2 * 3 * 8, 1, 1)
    with pytest.raises(ValueError, match="causal_pairs"):
        W.WGConfig(128, 128, 64, "bfloat16", "overlap", causal_pairs=False)


@pytest.mark.skipif(not W.supported_device()[0], reason="a device without wgmma is refused before the count")
def test_ws_launch_counts_tiles_in_32_bits():
    """The ws kernels count a block's key tiles in 32 bits (``stage_of``, ``use_parity``): a launch with 2^32 or
    more (query tile, key tile) pairs is refused by ``can_implement``, before any launch."""
    cfg = W.WGConfig(128, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma")
    big = types.SimpleNamespace(shape=(256, 64, 2**17, 64))  # 2^14 · 2^10 · 2^10 = 2^34 pairs
    ok, why = W.can_implement(cfg, big, big, big, big)
    assert not ok and "2^32" in why and str(2**34) in why


@hopper
@pytest.mark.parametrize("copies,kind,causal,n_q,n_k", [("tma", "bfloat16", True, 130, 75),
                                                        ("cp.async", "float16", False, 70, 83)])
def test_forward_wgmma_softmax_pinned(xp, rng, copies, kind, causal, n_q, n_k):
    """ws-overlap with ``pin_softmax=True``: the same steps, with the rescale and P_j's packing taken through
    ``f32_after`` the row sums (``pv_landed``); a different kernel on the GPU, the same results."""
    cfg = W.WGConfig(128, 16, 64, kind, "ws-overlap", stages=3, copies=copies, setmaxnreg=copies == "tma",
                     pin_softmax=True)
    run_and_check(xp, rng, n_q, n_k, 64, kind, causal, cfg=cfg, layout="bshd", heads=1, launch=launch)


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="real tiles on a Hopper GPU")
@pytest.mark.parametrize("n_q,n_k,d,causal,batch,heads,kind", [
    (1025, 1025, 64, True, 2, 16, "bfloat16"),  # 288 items, 144 causal pairs: more chunks than multiprocessors
    (1100, 1100, 128, False, 2, 16, "float16"),  # 288 items, some blocks take 3
    (2100, 2100, 64, False, 1, 20, "float16"),  # the 128 × 192 ws-overlap tiles, 340 items
    (300, 131, 128, True, 1, 4, "bfloat16"),  # items that see no key
    (2000, 3000, 128, True, 1, 2, "float16"),  # seqlen_q < seqlen_k: every row sees keys, a ragged last key tile
    (1100, 1300, 256, True, 2, 16, "bfloat16"),  # above D = 128: 2 split stages, 128 × 64 tiles
    (1300, 1100, 176, False, 2, 16, "float16"),  # a padded 192: 128 × 96 tiles, a zero quarter panel
])
def test_forward_wgmma_persistent_real_tiles(xp, rng, n_q, n_k, d, causal, batch, heads, kind):
    """The GPU's persistent picks at their own tiles, against float64: every block takes several work items."""
    cfg = W.choose_config(d, kind, simulator=False, long_keys=n_k >= W.WSO_MIN_KEYS_D64)
    assert cfg.persistent and cfg.copies == "tma"
    run_and_check(xp, rng, n_q, n_k, d, kind, causal, cfg=cfg, batch=batch, heads=heads, launch=launch)


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="real tiles on a Hopper GPU")
@pytest.mark.parametrize("n_q,n_k,batch,heads,kind,layout", [
    (2100, 2100, 2, 3, "float16", "bhsd"),  # 11 query tiles a head, the last one 180 rows of 192
    (2000, 2500, 1, 4, "bfloat16", "bshd"),  # seqlen_q < seqlen_k, a ragged last key tile; strided views
])
def test_forward_wgmma_three_consumers_real_tiles(xp, rng, n_q, n_k, batch, heads, kind, layout):
    """The GPU's pick for long non-causal calls at D = 64 (three consumer warpgroups, 192 × 128 tiles, persistent
    blocks with the dynamic scheduler, :func:`config_for`) at its own tiles, against
    float64; and the same tiles with one block per item."""
    q = xp.empty((batch, heads, n_q, 64), np.float16)
    kv = xp.empty((batch, heads, n_k, 64), np.float16)
    cfg = W.config_for(64, kind, q, kv, kv, False)
    assert (cfg.block_m, cfg.block_n, cfg.persistent, cfg.dynamic) == (192, 128, True, True)
    for c in (cfg, dataclasses.replace(cfg, persistent=False, dynamic=False)):
        run_and_check(xp, rng, n_q, n_k, 64, kind, False, cfg=c, batch=batch, heads=heads, layout=layout, launch=launch)


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="real tiles on a Hopper GPU")
@pytest.mark.parametrize("n_q,n_k,batch,heads,kind,layout", [
    (2100, 2100, 1, 20, "bfloat16", "bhsd"),  # 17 query tiles a head in causal pairs, a ragged last tile of each
    (1500, 4000, 2, 3, "float16", "bshd"),  # seqlen_q < seqlen_k: every row sees keys; strided views
])
def test_forward_wgmma_seam_pick_real_tiles(xp, rng, n_q, n_k, batch, heads, kind, layout):
    """The GPU's pick for causal calls at D = 64 from WSO_MIN_KEYS_D64 to SEAM_MAX_KEYS keys (128 × 192 tiles,
    persistent, two Q_i buffers and the seam step, :func:`config_for`) at its own tiles, against float64."""
    q = xp.empty((batch, heads, n_q, 64), np.float16)
    kv = xp.empty((batch, heads, n_k, 64), np.float16)
    cfg = W.config_for(64, kind, q, kv, kv, True)
    assert (cfg.block_m, cfg.block_n, cfg.persistent, cfg.q_buffers, cfg.seam) == (128, 192, True, 2, True)
    run_and_check(xp, rng, n_q, n_k, 64, kind, True, cfg=cfg, batch=batch, heads=heads, layout=layout, launch=launch)


@pytest.mark.parametrize("n_qt", [1, 2, 5, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_work_items_cover_every_tile_once(n_qt, causal):
    """The work items are every (query tile, head, batch) once, head by head; causal pairs (a persistent block's
    chunk) cost about the same: the longest tile with the shortest, and so on."""
    heads, batch = 3, 2
    items = [W.work_item(i, n_qt, heads, causal, causal) for i in range(n_qt * heads * batch)]
    assert sorted(items) == sorted((qt, h, b) for qt in range(n_qt) for h in range(heads) for b in range(batch))
    assert [(b, h) for _, h, b in items] == sorted((b, h) for _, h, b in items)  # head by head
    if causal:
        for bh in range(heads * batch):
            tiles = [qt for qt, *_ in items[bh * n_qt:(bh + 1) * n_qt]]
            sums = {tiles[u] + tiles[u + 1] for u in range(0, n_qt - 1, 2)}
            assert sums <= {n_qt - 1}, tiles  # (n_qt - 1 - u) + u
        assert [W.work_item(i, n_qt, 1, True, False)[0] for i in range(n_qt)] == list(range(n_qt))[::-1]
    else:
        assert [qt for qt, *_ in items[:n_qt]] == list(range(n_qt))


@hopper
@pytest.mark.parametrize("cfg,causal,n_q,n_k,growth", [
    # half the values by the polynomial (2 of the 4 of a thread's row here); causal, ragged, rows that see no key
    (W.WGConfig(128, 16, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", setmaxnreg=True, persistent=True,
                poly_exp2=2), True, 130, 75, 0.0),
    # every value, fp16, the cp.async producer
    (W.WGConfig(128, 16, 64, "float16", "ws-overlap", stages=3, copies="cp.async", poly_exp2=8), False, 70, 83, 0.0),
    # every value, three consumers; the lazy rescale, whose exponents reach +8, on scores growing along the keys
    (W.WGConfig(192, 16, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", setmaxnreg=True, lazy_rescale=True,
                poly_exp2=8), True, 200, 90, 0.4),
], ids=["half-bf16-causal", "all-fp16", "all-lazy-growing"])
def test_forward_wgmma_polynomial_exponentials(xp, rng, cfg, causal, n_q, n_k, growth):
    """``poly_exp2``: a share of the softmax's exponentials by :func:`~nbflash.intrinsics.ex2_poly` on the FMA
    units.  Masked scores (-inf) must still give P = 0, rows that see no key O = 0 and lse = -inf, and the
    results stay within the flash-attn rule (lse within 1e-5)."""
    run_and_check(xp, rng, n_q, n_k, 64, cfg.input_kind, causal, cfg=cfg, layout="bshd", heads=1, launch=launch,
                  **({"key_growth": growth} if growth else {}))


def test_poly_exp2_counts_of_eight():
    for bad in (-1, 9):
        with pytest.raises(ValueError, match="poly_exp2"):
            W.WGConfig(128, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", poly_exp2=bad)


@hopper
@pytest.mark.parametrize("cfg", [
    W.WGConfig(64, 16, 64, "bfloat16", "overlap", copies="cp.async", lazy_rescale=True),
    W.WGConfig(128, 16, 64, "float16", "ws-overlap", stages=3, copies="tma", setmaxnreg=True, lazy_rescale=True),
    W.WGConfig(64, 16, 64, "float16", "overlap", copies="cp.async"),
], ids=["overlap-lazy", "ws-overlap-lazy", "overlap"])
def test_forward_wgmma_rescales_when_the_max_grows(xp, rng, cfg):
    """Scores growing along the keys (key j scaled by 1 + 0.4 j): the (opt-in) lazy rescale must rescale O at
    later key tiles too, here where O is rescaled after P_{j-1} V_{j-1} was issued (softmax_rows and
    rescale_rows apart); and the default, which rescales at every tile."""
    run_and_check(xp, rng, 40, 70, 64, cfg.input_kind, True, cfg=cfg, heads=1, launch=launch, key_growth=0.4)


def test_tma_configuration_rules():
    """Only the ws pipelines (whose producer issues the copies) take ``copies="tma"``; on the GPU the ws-overlap
    pipeline copies with TMA at every head dim (128 × 192 tiles at D <= 64 for long sequences, 128 × 128 up to
    D = 128; above it 2 stages with K and V on their own mbarriers, 128 × 96 tiles at a padded 192, 128 × 64 at
    256, persistent), and ``copies="cp.async"`` names the best configuration without it."""
    with pytest.raises(ValueError, match="producer"):
        W.WGConfig(128, 16, 64, "float16", "plain", copies="tma")
    with pytest.raises(ValueError, match="copies"):
        W.WGConfig(128, 16, 64, "float16", "ws", copies="bulk")
    for d in (40, 64):
        for long_keys, causal, block_m, block_n in ((False, True, 128, 128), (False, False, 128, 128),
                                                    (True, True, 128, 192), (True, False, 192, 128)):
            cfg = W.choose_config(d, "bfloat16", simulator=False, long_keys=long_keys, causal=causal)
            want = ("ws-overlap", "tma", block_m, block_n, 3, True)
            assert (cfg.pipeline, cfg.copies, cfg.block_m, cfg.block_n, cfg.stages, cfg.setmaxnreg) == want
            # three consumers (long non-causal calls): persistent blocks take their chunks off the work counter
            assert cfg.persistent and cfg.dynamic == (block_m == 192)
    for d in (72, 96, 128):
        for long_keys, causal in ((False, True), (True, True), (True, False)):
            cfg = W.choose_config(d, "bfloat16", simulator=False, long_keys=long_keys, causal=causal)
            assert (cfg.pipeline, cfg.copies, cfg.block_n, cfg.stages, cfg.setmaxnreg) == ("ws-overlap", "tma", 128, 3,
                                                                                          True)
    for d in (64, 128):  # TMA picks: persistent blocks unless asked not to; the same compiled kernel either way
        cfg = W.choose_config(d, "bfloat16", simulator=False)
        assert cfg.persistent and not W.choose_config(d, "bfloat16", simulator=False, persistent=False).persistent
        assert W.forward_wgmma_kernel(cfg) is W.forward_wgmma_kernel(dataclasses.replace(cfg, persistent=False))
    assert not W.choose_config(128, "float16", simulator=False, copies="cp.async").persistent
    assert W.choose_config(64, "float16", simulator=False, copies="cp.async").pipeline == "plain"
    assert W.choose_config(128, "float16", simulator=False, copies="cp.async").copies == "cp.async"
    for d, block_n in ((136, 96), (176, 96), (192, 96), (200, 64), (256, 64)):
        for long_keys, causal in ((False, True), (True, True), (True, False)):
            cfg = W.choose_config(d, "bfloat16", simulator=False, long_keys=long_keys, causal=causal)
            want = ("ws-overlap", "tma", 128, block_n, 2, True, True, True)
            assert (cfg.pipeline, cfg.copies, cfg.block_m, cfg.block_n, cfg.stages, cfg.setmaxnreg, cfg.split_kv,
                    cfg.persistent) == want, d
            assert cfg.register_split == W.WIDE_REGISTER_SPLIT and W.shared_bytes(cfg) <= 227 * 1024
    wide = W.choose_config(256, "float16", simulator=False, copies="cp.async")  # overlap: no producer
    assert (wide.pipeline, wide.copies, wide.block_n) == ("overlap", "cp.async", 64)


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="config_for picks on a Hopper GPU")
@pytest.mark.parametrize("d", [64, 128, 176, 256])
def test_config_for_persistent_rule(d):
    """On the GPU, :func:`config_for` gives TMA picks persistent blocks except for long non-causal calls (but the
    three-consumer kernel's, which keep them with the dynamic scheduler, and those above D = 128, which keep them
    at every length: measured faster at 16k keys too), the long-sequence tiles at D = 64 from
    WSO_MIN_KEYS_D64 keys, and the causal ones the seam step below SEAM_MAX_KEYS; the grid is then one block per
    multiprocessor."""
    import cupy as cp

    for n_k in (W.WSO_MIN_KEYS_D64 - 8, W.WSO_MIN_KEYS_D64, W.SEAM_MAX_KEYS - 8, W.SEAM_MAX_KEYS,
                W.PERSISTENT_MAX_KEYS):
        q = cp.empty((1, 2, 256, d), cp.float16)
        kv = cp.empty((1, 2, n_k, d), cp.float16)
        for causal in (False, True):
            cfg = W.config_for(d, "float16", q, kv, kv, causal)
            three = d == 64 and n_k >= W.WSO_MIN_KEYS_D64 and not causal  # 192 × 128 tiles
            assert three == W.three_consumers(d, n_k >= W.WSO_MIN_KEYS_D64, causal)
            assert cfg.copies == "tma" and cfg.block_m == (192 if three else 128), (n_k, causal)
            assert cfg.persistent == (causal or three or d > 128 or n_k < W.PERSISTENT_MAX_KEYS), (n_k, causal)
            assert cfg.dynamic == three, (n_k, causal)  # the three-consumer kernel's only
            wide = d == 64 and not three and n_k >= W.WSO_MIN_KEYS_D64  # 128 × 192 tiles
            if d == 64 and not three:
                assert cfg.block_n == (192 if wide else 128)
            seam = wide and causal and n_k < W.SEAM_MAX_KEYS
            assert (cfg.seam, cfg.q_buffers) == ((True, 2) if seam else (False, 1)), (n_k, causal)
    cfg = W.choose_config(d, "float16", simulator=False)
    assert W.work_grid(cfg, 8, 16, 4096, False) == (W.multiprocessor_count(), 1, 1)
    assert W.work_grid(dataclasses.replace(cfg, persistent=False), 8, 16, 4096, True) == (8 * 16 * 32 // 2, 1, 1)


@hopper
@pytest.mark.slow
@pytest.mark.parametrize("d,long_keys,causal", [(64, False, True), (64, True, True), (64, True, False),
                                                (128, False, True)])
def test_forward_wgmma_gpu_configuration(xp, rng, d, long_keys, causal):
    """The tiles the GPU uses (at D = 64 all three: short sequences, long causal ones, long non-causal ones with
    three consumers), at a size that crosses them."""
    cfg = W.choose_config(d, "bfloat16", simulator=False, long_keys=long_keys, causal=causal)
    run_and_check(xp, rng, cfg.block_m + 7, cfg.block_n + 5, d, "bfloat16", causal, cfg=cfg, heads=1, launch=launch)


@hopper
def test_api_backend_wgmma(xp, rng):
    """``backend="wgmma"`` through nbflash.attention: the plan says so, the result matches the SIMT kernel's."""
    q, k, v = (xp.asarray(to_kind(rng.standard_normal((1, 2, n, 64)).astype(np.float32), "float16")[0])
               for n in (19, 33, 33))
    plan = nbflash.which_backend(q, k, v, causal=True, backend="wgmma")
    assert plan.backend == "wgmma" and isinstance(plan.config, W.WGConfig)
    o, lse = nbflash.attention(q, k, v, causal=True, backend="wgmma", return_lse=True)
    o_ref, lse_ref = nbflash.attention(q, k, v, causal=True, backend="simt", return_lse=True)
    host = (lambda a: a) if xp is np else (lambda a: a.get())
    np.testing.assert_allclose(host(o).astype(np.float32), host(o_ref).astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(host(lse), host(lse_ref), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(SIMULATOR or (compute_capability() or (0, 0))[0] != 9, reason="real tiles on a Hopper GPU")
def test_api_dynamic_scheduler_pick(xp, rng):
    """nbflash.attention's pick for a long non-causal call at D = 64 (three consumers, the dynamic scheduler) through
    the recorded launch: its work counter made per replay for the call's stream; three calls in a row, against the
    SIMT kernel."""
    q, k, v = (xp.asarray(rng.standard_normal((2, 8, n, 64)).astype(np.float16)) for n in (2100, 2200, 2200))
    plan = nbflash.which_backend(q, k, v)
    assert plan.backend == "wgmma" and plan.config.dynamic and plan.config.block_m == 192
    o_ref = nbflash.attention(q, k, v, backend="simt").get().astype(np.float32)
    for _ in range(3):
        o = nbflash.attention(q, k, v)
        np.testing.assert_allclose(o.get().astype(np.float32), o_ref, atol=2e-3)


def test_backend_wgmma_refuses_what_it_cannot_run(xp):
    q = xp.zeros((1, 1, 8, 64), dtype=np.float32) + 1
    with pytest.raises(ValueError, match="wgmma"):
        nbflash.attention(q, q, q, backend="wgmma")  # float32: no tensor cores
    q16 = xp.zeros((1, 1, 8, 36), dtype=np.float16) + 1
    with pytest.raises(ValueError, match="wgmma"):
        nbflash.attention(q16, q16, q16, backend="wgmma")  # head dim not a multiple of 8
    if not SIMULATOR and compute_capability()[0] != 9:
        q16 = xp.zeros((1, 1, 8, 64), dtype=np.float16) + 1
        with pytest.raises(ValueError, match="compute capability 9"):
            nbflash.attention(q16, q16, q16, backend="wgmma")


def test_config_validation_and_shared_memory():
    for bad in (dict(block_m=96), dict(block_n=24), dict(head_dim=36), dict(head_dim=264), dict(input_kind="float32")):
        args = dict(block_m=64, block_n=16, head_dim=64, input_kind="float16") | bad
        with pytest.raises(ValueError, match=next(iter(bad))):
            W.WGConfig(**args)
    # Q, K and V tiles of whole 64-column panels: 128 × 128 at D = 128 is 3 × 32 KB (plain pipeline), and one
    # more K and V buffer (overlapped).
    assert W.shared_bytes(W.WGConfig(128, 128, 128, "float16", "plain")) == 3 * 32 * 1024
    assert W.shared_bytes(W.WGConfig(128, 128, 128, "float16", "overlap")) == 5 * 32 * 1024
    assert W.shared_bytes(W.WGConfig(128, 128, 40, "float16", "plain")) == 3 * 16 * 1024  # 40 pads to one panel
    with pytest.raises(ValueError, match="pipeline"):
        W.WGConfig(64, 16, 64, "float16", "triple")
    with pytest.raises(ValueError, match="two warpgroups"):
        W.WGConfig(64, 16, 64, "float16", "pingpong")
    with pytest.raises(ValueError, match="stages"):
        W.WGConfig(128, 16, 64, "float16", "ws", stages=5)
    with pytest.raises(ValueError, match="stages"):
        W.WGConfig(128, 16, 64, "float16", "overlap", stages=3)
    with pytest.raises(ValueError, match="setmaxnreg"):
        W.WGConfig(128, 16, 64, "float16", "overlap", setmaxnreg=True)  # no producer to take registers from
    with pytest.raises(ValueError, match="persistent"):
        W.WGConfig(128, 16, 64, "float16", "ws", copies="cp.async", persistent=True)  # only the TMA producer loops
    with pytest.raises(ValueError, match="persistent"):
        W.WGConfig(128, 16, 64, "float16", "overlap", persistent=True)
    with pytest.raises(ValueError, match="stages"):
        W.WGConfig(128, 16, 64, "float16", "ws-overlap", stages=2, copies="tma")  # 2 stages only with split_kv
    with pytest.raises(ValueError, match="split_kv"):
        W.WGConfig(128, 16, 64, "float16", "ws", stages=2, split_kv=True)  # K and V on mbarriers: TMA only
    with pytest.raises(ValueError, match="split_kv"):
        W.WGConfig(128, 16, 64, "float16", "overlap", split_kv=True)
    with pytest.raises(ValueError, match="pin_softmax"):
        W.WGConfig(128, 16, 64, "float16", "ws", pin_softmax=True)  # no overlapped P V whose wait could move
    # FlashAttention-3's 128 × 176 tiles at D = 128 on 2 split stages: Q (32 KB) and two 44 KB K and V tiles each.
    wide = W.WGConfig(128, 176, 128, "bfloat16", "ws-overlap", stages=2, copies="tma", split_kv=True)
    assert W.shared_bytes(wide) == 32 * 1024 + 4 * 176 * 256 == 212992
    ws = W.WGConfig(128, 128, 128, "bfloat16", "ws", stages=3)
    assert ws.threads == 3 * 128  # two consumer warpgroups and the producer warpgroup
    assert W.shared_bytes(ws) == (1 + 2 * 3) * 32 * 1024  # Q and three K, V stages: 224 KB, under Hopper's 227
    # Three consumer warpgroups (192 query rows): ws pipelines only; one turn barrier each, so 4 split stages
    # (1 + 3 turns + 4 FULL + 4 EMPTY + QEMPTY + 4 VEMPTY = 17 ids) no longer fit the 16 named barriers.
    three = W.WGConfig(192, 128, 64, "bfloat16", "ws-overlap", stages=4, copies="tma", setmaxnreg=True)
    assert (three.threads, three.turns, three.named_barriers, three.register_split) == (512, 3, 13, (32, 160))
    assert 128 * three.register_split[0] + 384 * three.register_split[1] <= 65536
    assert W.shared_bytes(three) == 192 * 128 + 2 * 4 * 128 * 128  # Q (24 KB), four 16 KB K and V stages
    with pytest.raises(ValueError, match="named barriers"):
        W.WGConfig(192, 128, 64, "bfloat16", "ws-overlap", stages=4, copies="tma", split_kv=True)
    two = W.WGConfig(128, 128, 64, "bfloat16", "ws-overlap", stages=4, copies="tma", split_kv=True)
    assert two.named_barriers == 16  # two consumers: every id in use
    with pytest.raises(ValueError, match="two warpgroups"):
        W.WGConfig(192, 64, 64, "float16", "pingpong")
    with pytest.raises(ValueError, match="128 or 192"):
        W.WGConfig(64, 64, 64, "float16", "ws")
    k_off, v_off, end = W.shared_offsets(W.WGConfig(192, 64, 96, "bfloat16"))
    assert k_off * 2 % 1024 == 0 and v_off * 2 % 1024 == 0  # every swizzled tile starts 1024-byte aligned
    # Two Q_i buffers: one more release id (QEMPTY + 1) and one more Q tile of shared memory, ahead of K and V.
    q2 = W.WGConfig(192, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", q_buffers=2, seam=True)
    one = dataclasses.replace(q2, q_buffers=1, seam=False)
    assert q2.named_barriers == one.named_barriers + 1 == 12
    assert W.shared_offsets(q2)[0] == 2 * 192 * 64 and W.shared_bytes(q2) == W.shared_bytes(one) + 192 * 64 * 2
    with pytest.raises(ValueError, match="named barriers"):  # two consumers, 4 split stages: 17 ids
        dataclasses.replace(two, q_buffers=2)
    with pytest.raises(ValueError, match="q_buffers"):
        W.WGConfig(128, 16, 64, "float16", "ws", stages=2, copies="tma", q_buffers=3)
    with pytest.raises(ValueError, match="Q_i buffers"):
        W.WGConfig(128, 16, 64, "float16", "ws", stages=2, q_buffers=2)  # cp.async: one item per block, one Q
    with pytest.raises(ValueError, match="seam"):
        W.WGConfig(128, 16, 64, "float16", "ws", stages=2, copies="tma", q_buffers=2, seam=True)  # no overlap
    with pytest.raises(ValueError, match="seam"):
        W.WGConfig(128, 16, 64, "float16", "ws-overlap", stages=3, copies="tma", seam=True)  # Q'_0 needs its buffer


_PTX_SCRIPT = r"""
import importlib, json, re, subprocess, sys, tempfile
sys.path.insert(0, sys.argv[1])
from offline import part_of
from nbflash._device import SIMULATOR, compile_ptx_and_ltoir_offline, compile_ptx_offline, ptxas_info
assert not SIMULATOR
module, nvdisasm, part, parts = sys.argv[2], sys.argv[3] or None, int(sys.argv[4]), int(sys.argv[5])


def overlap(cubin):
    # The most MUFU.EX2 between a wait for all but one wgmma group and the next wait for all (the softmax of S_j
    # under P_{j-1} V_{j-1}), whether ptxas closed an empty group with a dummy HGMMA, every MUFU.EX2, and the
    # polynomial exponentials (one FADD of -1.5 * 2^23 each, intrinsics.ex2_poly).
    if not (nvdisasm and cubin):
        return None, None, None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, f.name], capture_output=True, text=True, check=True).stdout
    best, count = 0, None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            count = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and count is not None:
            best, count = max(best, count), None
        elif "MUFU.EX2" in line and count is not None:
            count += 1
    return (best, bool(re.search(r"HGMMA\.64x8x16\.\w+ RZ, gdesc\[URZ\]", sass)), sass.count("MUFU.EX2"),
            sass.count(", -12582912 ;"))

targets = importlib.import_module(module).compile_targets()
for (name, cfg, kern, sig, fastmath), where in zip(targets, part_of(targets, parts)):
    if where != part:
        continue
    bounds = kern.targetoptions.get("launch_bounds")  # as the kernel is compiled for the GPU (ws: 168 registers)
    options = dict(cc=(9, 0, "a"), fastmath=fastmath, **({"launch_bounds": bounds} if bounds else {}))
    # setmaxnreg is honoured only in a whole-program link, as numba-cuda links on a GPU (link-time optimisation):
    # then ptxas reads the LTO IR; the PTX (NVVM's from the same compile) is what the regular expressions read.
    lto = getattr(cfg, "setmaxnreg", False)
    ptx, ltoir = (compile_ptx_and_ltoir_offline(kern.py_func, sig, **options) if lto
                  else (compile_ptx_offline(kern.py_func, sig, **options), None))
    info = ptxas_info(ltoir or ptx, "sm_90a", check=False)
    overlapped_ex2, dummy_hgmma, ex2, poly_ex2 = overlap(info.get("cubin"))
    print(json.dumps(dict(name=name, config=repr(cfg), ok=info["ok"], log=info["log"][-1500:], lto=lto,
                          overlapped_ex2=overlapped_ex2, dummy_hgmma=dummy_hgmma, ex2=ex2, poly_ex2=poly_ex2,
                          notes=sorted(set(re.findall(r"\((C75\d\d)\)", info["log"]))),
                          setmaxnreg=sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32 (\d+)", ptx))),
                          registers=info["registers"], spill=info["spill_bytes"],
                          serialized=bool(re.search(r"wgmma.mma_async instructions are serialized", info["log"])),
                          local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
                          shapes=sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx))),
                          a_in_registers=bool(re.search(r"wgmma\.mma_async[^;]*\},\s*\{%r", ptx)),
                          a_in_shared=bool(re.search(r"wgmma\.mma_async[^;]*\},\s*%rd", ptx)))), flush=True)
"""


@functools.cache
def offline_rows(module: str, part: int) -> list[tuple[tuple, dict]]:
    """Part ``part`` of ``module``'s GPU configurations (its ``compile_targets()``), each compiled for sm_90a and
    assembled by ptxas in a subprocess with the simulator off: ``(target, row)`` pairs, one per kernel."""
    targets = importlib.import_module(module).compile_targets()
    mine = [t for t, where in zip(targets, part_of(targets), strict=True) if where == part]
    rows = offline_json_rows(_PTX_SCRIPT, TESTS, module, find_nvdisasm() or "", str(part), str(OFFLINE_PARTS),
                             timeout=1800)
    assert len(rows) == len(mine) > 0, (len(rows), len(mine))
    for (name, cfg, *_), row in zip(mine, rows, strict=True):
        assert (row["name"], row["config"]) == (name, repr(cfg)), row
    return list(zip(mine, rows, strict=True))


@pytest.mark.offline
@pytest.mark.parametrize("part", range(OFFLINE_PARTS))
def test_gpu_configurations_compile_for_sm90a_without_local_memory(part):
    pairs = offline_rows("nbflash.forward_wgmma", part)
    for (_, cfg, *_), row in pairs:
        assert row["ok"], row["log"]
        assert row["local"] == 0 and row["spill"] in (0, None), row
        assert not row["serialized"], row  # ptxas would wait for each wgmma before the next (its C75xx notes)
        if cfg.setmaxnreg:  # both moves are in the code, and ptxas kept them (no C7504 / C7507 "ignored")
            dec, inc = cfg.register_split
            assert row["lto"] and row["setmaxnreg"] == [["dec", str(dec)], ["inc", str(inc)]] and not row["notes"], row
        assert set(row["shapes"]) == {f"m64n{cfg.block_n}k16", f"m64n{cfg.d_pad}k16"}, row
        assert row["a_in_shared"] and row["a_in_registers"], row  # S = Q Kᵀ from shared; O += P V with P in registers
        if cfg.pipeline == "ws-overlap" and row["overlapped_ex2"] is not None:
            # No empty wgmma group (before 2026-12-05 a dummy HGMMA closed one, and no exponential ran between the
            # wait for S_j and the wait for P_{j-1} V_{j-1}).  With pin_softmax, every exponential of a tile
            # (BLOCK_N / 2 a thread) is between those waits; unpinned, ptxas pulls the second wait up into the
            # softmax (0-8 exponentials before it, offline), which measured faster (the module docstring).
            assert not row["dummy_hgmma"], row
            if cfg.pin_softmax:
                assert row["overlapped_ex2"] >= cfg.block_n // 2, row
        if cfg.poly_exp2 and row["ex2"] is not None:
            # poly_exp2 = 3: 3 of every 8 of the tiles' exponentials leave the special-function unit for the
            # polynomial (the rescale factors' stay), in the same kernel otherwise.
            base = next(r for (_, c, *_), r in pairs if c == dataclasses.replace(cfg, poly_exp2=0))  # same part
            assert base["poly_ex2"] == 0 and row["poly_ex2"] == base["ex2"] - row["ex2"] > 0, (row, base)
            assert 0.9 * 3 * base["ex2"] < 8 * row["poly_ex2"] <= 3 * base["ex2"], (row, base)
        if cfg.pipeline == "overlap" and cfg.d_pad <= 192 and row["overlapped_ex2"] is not None:
            # The "overlap" pipeline's tile 0 peeled (2026-12-06): no empty group either, up to 12 k-steps of
            # S = Q Kᵀ (at 16, D = 256, NVVM keeps them a loop and its back edge still brings one).
            assert not row["dummy_hgmma"], row
