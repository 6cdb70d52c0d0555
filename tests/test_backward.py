"""The backward pass (nbflash.backward) against the float64 reference, its input checks, and its PTX.

In the simulator the tiles are 8 × 8, so sequence lengths 1, 7 (prime), 9
(just past a tile) and 17 cover single, partial and several tiles.

float32 tests run twice (the ``copies`` fixture): with the plain tile loads,
and with the cp.async copies the API picks for aligned float32 rows — in the
simulator with each copy landing only at the wait that covers it, its tile
poisoned until then, so a missing wait or barrier shows in the gradients.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nbflash
from nbflash import backward as bw
from nbflash import intrinsics
from nbflash._tiles import TileConfig
from nbflash.api import backward_arrays
from nbflash.reference import attention_backward_ref, attention_ref, causal_mask

# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def _host(x):
    """A NumPy copy of a NumPy or CuPy array (or of a simulator device array)."""
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return x.get() if hasattr(x, "get") else np.array(x)


def _inputs(rng, xp, B, H, Nq, Nk, D, dtype, *, causal=False, scale=None, layout="bhsd"):
    """Random ``do, q, k, v`` and the forward's ``o`` (in ``dtype``) and ``lse``, in ``layout``.

    ``o`` and ``lse`` come from the float64 reference, rounded the way the
    forward kernel would store them, so these tests do not depend on it.
    """
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (Nq, Nk, Nk))
    do = rng.standard_normal((B, H, Nq, D))
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    o, lse = attention_ref(q, k, v, causal=causal, scale=scale)
    o = o.astype(dtype)
    lse = lse.astype(np.float64 if dtype == np.float64 else np.float32)
    if layout == "bshd":
        do, q, k, v, o = (x.transpose(0, 2, 1, 3).copy() for x in (do, q, k, v, o))
    return tuple(xp.asarray(x) for x in (do, q, k, v, o)) + (xp.asarray(lse),)


def _to_bhsd(x, layout):
    x = _host(x)
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def _reference(do, q, k, v, *, causal, scale=None, layout="bhsd"):
    """float64 ``(dq, dk, dv)`` in the ``bhsd`` layout."""
    args = (_to_bhsd(x, layout).astype(np.float64) for x in (do, q, k, v))
    return attention_backward_ref(*args, causal=causal, scale=scale)


def _naive_backward(do, q, k, v, *, causal, dtype):
    """The textbook backward computed entirely in ``dtype`` (the flash-attn rule's baseline)."""
    do, q, k, v = (np.asarray(x).astype(dtype) for x in (do, q, k, v))
    scale = dtype(1.0 / math.sqrt(q.shape[-1]))
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        s = np.where(causal_mask(q.shape[2], k.shape[2]), s, dtype(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, dtype(0))
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, l, out=np.zeros_like(p), where=l > 0)
    o = np.einsum("bhij,bhjd->bhid", p, v)
    dv = np.einsum("bhij,bhid->bhjd", p, do)
    dp = np.einsum("bhid,bhjd->bhij", do, v)
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhij,bhjd->bhid", ds, k) * scale
    dk = np.einsum("bhij,bhid->bhjd", ds, q) * scale
    return dq, dk, dv


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - b)))


@pytest.fixture
def late_copies(monkeypatch):
    """cp.async in the simulator lands at the wait that covers it (NaN until then): see nbflash.intrinsics."""
    monkeypatch.setattr(intrinsics, "SIM_CP_ASYNC_LANDS_AT_WAIT", True)


@pytest.fixture(params=["loads", "cp.async"])
def copies(request, monkeypatch):
    """How the API's kernels fill shared memory for a test's (aligned float32) inputs: plain loads
    (``bw.with_copies`` off), or cp.async (its choice, checked), landing late.  Returns the name."""
    if request.param == "loads":
        monkeypatch.setattr(bw, "with_copies", lambda cfg, *arrays: cfg)
        return request.param
    request.getfixturevalue("late_copies")
    choose = bw.with_copies

    def must_copy(cfg, *arrays):
        got = choose(cfg, *arrays)
        assert got.dkdv.async_copy and got.dq.async_copy, "these inputs should take cp.async"
        return got

    monkeypatch.setattr(bw, "with_copies", must_copy)
    return request.param


# ----------------------------------------------------------------------------
# Gradients against the reference
# ----------------------------------------------------------------------------

# (B, H, seqlen_q, seqlen_k, head_dim, causal)
SHAPES = [
    (1, 1, 1, 1, 8, False),  # one query, one key
    (1, 1, 1, 1, 8, True),
    (1, 2, 7, 7, 8, False),  # a prime: one partial tile
    (2, 1, 9, 9, 8, True),  # just past a tile boundary
    (1, 1, 17, 9, 40, False),  # seqlen_q != seqlen_k, head dim padded inside
    (1, 1, 5, 13, 8, True),  # causal, fewer queries: the last query sees every key
    (1, 1, 13, 5, 8, True),  # causal, more queries: rows 0..7 see no key
    (1, 1, 17, 2, 3, True),  # whole query tiles that see no key
    (1, 1, 9, 17, 64, True),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + ("-causal" if s[5] else ""))
def test_float64_matches_reference(rng, xp, shape, deterministic):
    B, H, Nq, Nk, D, causal = shape
    do, q, k, v, o, lse = _inputs(rng, xp, B, H, Nq, Nk, D, np.float64, causal=causal)
    dq, dk, dv = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    ref = _reference(do, q, k, v, causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        assert got.dtype == np.float64 and got.shape == want.shape, name
        got = _host(got)
        assert np.all(np.isfinite(got)), name
        assert _max_err(got, want) <= 1e-10 * (1 + np.abs(want).max()), name


def test_rows_without_keys_get_zero_dq(rng, xp, copies):
    # Causal with seqlen_q = 13 > seqlen_k = 5: query i sees keys j <= i - 8.
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 2, 13, 5, 8, np.float32, causal=True)
    assert np.all(np.isneginf(_host(lse)[:, :, :8]))
    for deterministic in (True, False):
        dq, dk, dv = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=deterministic)
        dq, dk, dv = (_host(x) for x in (dq, dk, dv))
        assert all(np.all(np.isfinite(x)) for x in (dq, dk, dv))
        assert np.all(dq[:, :, :8] == 0)
        assert np.any(dq[:, :, 8:] != 0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(9, 9), (7, 17), (17, 7)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32(rng, xp, seqlens, causal, deterministic, layout, copies):
    """Ragged tiles, N_q ≠ N_k, causal rows that see no key (17 × 7), both dQ routes and layouts."""
    Nq, Nk = seqlens
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 2, Nq, Nk, 40, np.float32, causal=causal, layout=layout)
    got = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout, deterministic=deterministic)
    ref = _reference(do, q, k, v, causal=causal, layout=layout)
    for name, g, want in zip(("dq", "dk", "dv"), got, ref, strict=True):
        assert g.dtype == np.float32, name
        assert _max_err(_to_bhsd(g, layout), want) <= 2e-5 * (1 + np.abs(want).max()), name


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize(
    "shape",
    [(1, 2, 9, 9, 40, True), (1, 1, 17, 7, 64, False), (1, 1, 7, 17, 8, True)],
    ids=lambda s: "x".join(map(str, s[:5])) + ("-causal" if s[5] else ""),
)
def test_float16_flash_attn_rule(rng, xp, shape, deterministic):
    """Error at most twice that of a naive float16 computation (plus a little slack)."""
    B, H, Nq, Nk, D, causal = shape
    do, q, k, v, o, lse = _inputs(rng, xp, B, H, Nq, Nk, D, np.float16, causal=causal)
    got = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=deterministic)
    ref = _reference(do, q, k, v, causal=causal)
    naive = _naive_backward(*(_host(x) for x in (do, q, k, v)), causal=causal, dtype=np.float16)
    for name, g, want, base in zip(("dq", "dk", "dv"), got, ref, naive, strict=True):
        assert g.dtype == np.float16, name
        err, naive_err = _max_err(_host(g), want), _max_err(base, want)
        assert err <= 2 * naive_err + 1e-3, f"{name}: error {err:.2e}, naive float16 {naive_err:.2e}"


def test_bfloat16_bits(rng, xp):
    """The bridge's route: bfloat16 as uint16 bits in, bits out."""

    def to_bits(x):  # round float32 to bfloat16, nearest even
        u = np.asarray(x, dtype=np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def from_bits(b):
        return (_host(b).astype(np.uint32) << 16).view(np.float32)

    Nq, Nk, D = 9, 7, 8
    q, k, v, do = (to_bits(rng.standard_normal((1, 1, n, D))) for n in (Nq, Nk, Nk, Nq))
    qf, kf, vf, dof = (from_bits(x) for x in (q, k, v, do))
    o, lse = attention_ref(qf, kf, vf, causal=True)
    o, lse = to_bits(o), lse.astype(np.float32)
    dq, dk, dv = backward_arrays(*(xp.asarray(x) for x in (do, q, k, v, o, lse)), causal=True, bf16_bits=True)
    ref = attention_backward_ref(dof, qf, kf, vf, causal=True)
    for name, g, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        assert g.dtype == np.uint16, name
        assert _max_err(from_bits(g), want) <= 2e-2 * (1 + np.abs(want).max()), name


@pytest.mark.parametrize("causal", [False, True])
def test_bshd_layout_and_strided_views(rng, xp, causal):
    B, H, Nq, Nk, D = 2, 3, 9, 7, 8
    do, q, k, v, o, lse = _inputs(rng, xp, B, H, Nq, Nk, D, np.float64, causal=causal, layout="bshd")
    ref = _reference(do, q, k, v, causal=causal, layout="bshd")
    dq, dk, dv = nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, layout="bshd")
    for g, want in zip((dq, dk, dv), ref, strict=True):
        assert g.shape == want.transpose(0, 2, 1, 3).shape
        assert _max_err(_to_bhsd(g, "bshd"), want) <= 1e-10

    # The same data as non-contiguous views (last axis still contiguous), in both layouts.
    def widened(x):
        w = xp.zeros(x.shape[:-1] + (2 * D,), dtype=x.dtype)
        w[..., 3 : 3 + D] = x
        return w[..., 3 : 3 + D]

    views = [widened(x) for x in (do, q, k, v, o)]
    assert not views[1].flags.c_contiguous
    dq2, dk2, dv2 = nbflash.attention_backward(*views, lse, causal=causal, layout="bshd")
    for g, g2 in zip((dq, dk, dv), (dq2, dk2, dv2), strict=True):
        assert np.array_equal(_host(g), _host(g2))
    bhsd_views = [x.transpose(0, 2, 1, 3) for x in views]  # bshd memory seen as bhsd: strided
    dq3, dk3, dv3 = nbflash.attention_backward(*bhsd_views, lse, causal=causal)
    for g, g3 in zip((dq, dk, dv), (dq3, dk3, dv3), strict=True):
        assert g3.flags.c_contiguous
        assert np.array_equal(_to_bhsd(g, "bshd"), _host(g3))


def test_deterministic_and_atomic_agree(rng, xp, copies):
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 2, 17, 9, 8, np.float32, causal=True)
    first = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    again = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    atomic = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=False)
    for a, b, c in zip(first, again, atomic, strict=True):
        a, b, c = _host(a), _host(b), _host(c)
        assert np.array_equal(a, b)  # bitwise repeatable
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("kind", ["float64", "float32", "float32-cp.async"])
def test_blocks_of_several_warps(rng, xp, deterministic, kind, request):
    """The API's simulator tiles fit in one warp; here 64 threads (two warps) share a tile.

    A row of Pᵀ/dS stays within one warp (a warp barrier suffices) while the
    atomic dQ step reads columns written by both warps (a block barrier); with
    cp.async every tile is copied by both warps, so each wait needs its barrier.
    """
    dtype = np.float64 if kind == "float64" else np.float32
    tile = TileConfig(16, 16, 16, 8, 8, kind.split("-")[0], "float64" if kind == "float64" else "float32")
    cfg = bw.BackwardConfig(dkdv=tile, dq=tile)
    if kind.endswith("cp.async"):
        cfg = bw.async_variant(cfg)
        request.getfixturevalue("late_copies")
    Nq, Nk, D = 19, 23, 12
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 2, Nq, Nk, D, dtype, causal=True)
    dq, dk, dv = (xp.empty_like(x) for x in (q, k, v))
    bw.launch_backward(cfg, q, k, v, o, do, lse, dq, dk, dv, 1 / math.sqrt(D), True, deterministic=deterministic)
    ref = _reference(do, q, k, v, causal=True)
    tol = 1e-10 if dtype == np.float64 else 2e-5
    for g, want in zip((dq, dk, dv), ref, strict=True):
        assert _max_err(_host(g), want) <= tol * (1 + np.abs(want).max())


@pytest.mark.parametrize("tiles_by", ["loads", "cp.async"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize("groups,interleave", [(2, False), (1, True), (2, True)], ids=["groups2", "interleave", "both"])
def test_split_groups_and_interleaved_columns(rng, xp, deterministic, groups, interleave, tiles_by, request):
    """Two thread groups splitting the dK/dV work (group 0: P, dV; group 1: dP, dS, dK; each half of
    dQ's columns in step 1e; with cp.async half a query tile apart), head-dim columns in 16-byte runs, and
    every head's longest tile first."""
    # D_PAD = 32: group halves of 16 columns, 16-byte runs of a lane at 4tx and 16 + 4tx.  cp.async copies
    # whole 16-byte chunks: D = 28 (its last chunk zero-filled); the plain loads take D = 29.
    Nq, Nk, D = 19, 23, 28 if tiles_by == "cp.async" else 29
    kv = TileConfig(8, 8, 32, 4, 2, "float32", groups=groups, interleave=interleave, longest_first=True)
    cfg = bw.BackwardConfig(dkdv=kv, dq=TileConfig(8, 8, 32, 4, 2, "float32", interleave=interleave,
                                                   longest_first=True))
    if tiles_by == "cp.async":
        cfg = bw.async_variant(cfg)
        request.getfixturevalue("late_copies")
    do, q, k, v, o, lse = _inputs(rng, xp, 2, 1, Nq, Nk, D, np.float32, causal=True)
    dq, dk, dv = (xp.full(x.shape, np.nan, np.float32) for x in (q, k, v))
    bw.launch_backward(cfg, q, k, v, o, do, lse, dq, dk, dv, 1 / math.sqrt(D), True, deterministic=deterministic)
    ref = _reference(do, q, k, v, causal=True)
    for name, g, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, strict=True):
        assert _max_err(_host(g), want) <= 2e-5 * (1 + np.abs(want).max()), name


# (B, H, seqlen_q, seqlen_k, causal) for the cp.async schedules: one tile, ragged tails, N_q ≠ N_k both
# ways, query rows and whole query tiles that see no key (causal, N_q > N_k), many tiles.
ASYNC_SHAPES = [(1, 1, 1, 1, True), (1, 2, 7, 7, False), (2, 1, 13, 29, True), (1, 1, 37, 6, True),
                (1, 1, 29, 13, False), (1, 1, 50, 41, True)]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "atomic"])
@pytest.mark.parametrize(
    "kv,dq",
    [
        # one group: dO_i under Sᵀ, Q_{i+1} under dV_j; two warps share every copy and product
        (TileConfig(16, 16, 16, 8, 8, "float32"), TileConfig(16, 16, 16, 8, 8, "float32")),
        # two groups half a query tile apart (a warp each), two Q_i buffers; 16-byte column runs
        (TileConfig(16, 16, 32, 4, 8, "float32", groups=2, interleave=True, longest_first=True),
         TileConfig(32, 8, 32, 8, 8, "float32", interleave=True, longest_first=True)),
    ],
    ids=["one-group", "two-groups"],
)
def test_async_copies_match_loads(rng, xp, late_copies, kv, dq, deterministic, layout):
    """The cp.async schedules (both kernels) give the same gradients as the plain loads: bit for bit on the
    deterministic route (the same operations in the same order), to rounding on the atomic one."""
    loads = bw.BackwardConfig(dkdv=kv, dq=dq)
    copies = bw.async_variant(loads)
    D = 12  # pads to 16 or 32: zero-filled chunks
    for B, H, Nq, Nk, causal in ASYNC_SHAPES:
        do, q, k, v, o, lse = _inputs(rng, xp, B, H, Nq, Nk, D, np.float32, causal=causal, layout=layout)
        views = [x if layout == "bhsd" else x.transpose(0, 2, 1, 3) for x in (do, q, k, v, o)]
        cdo, cq, ck, cv, co = views
        ref = _reference(do, q, k, v, causal=causal, layout=layout)
        runs = []
        for cfg in (loads, copies):
            grads = [xp.full(x.shape, np.nan, np.float32) for x in (cq, ck, cv)]
            bw.launch_backward(cfg, cq, ck, cv, co, cdo, lse, *grads, 1 / math.sqrt(D), causal,
                               deterministic=deterministic)
            runs.append([_host(g) for g in grads])
        for name, a, c, want in zip(("dq", "dk", "dv"), *runs, ref, strict=True):
            shape = (B, H, Nq, Nk, causal)
            assert _max_err(c, want) <= 2e-5 * (1 + np.abs(want).max()), (name, shape)
            if deterministic:
                assert np.array_equal(a, c), (name, shape)
            else:
                np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6, err_msg=f"{name} {shape}")


def test_async_copy_choice(rng, xp, monkeypatch, late_copies):
    """The API copies by cp.async exactly where float32 rows are whole aligned 16-byte chunks in q, k, v, o
    and do, in both kernels; anything else falls back to the plain loads, still exact."""
    from nbflash._tiles import async_copy_ok

    launched = []
    launch = bw.launch_backward

    def spy(cfg, *args, **kwargs):
        launched.append(cfg)
        return launch(cfg, *args, **kwargs)

    monkeypatch.setattr(bw, "launch_backward", spy)

    def run(do, q, k, v, o, lse, layout="bhsd"):
        launched.clear()
        # backend="simt": on a GPU, float16 would otherwise go to the tensor-core kernels (not launch_backward)
        got = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, layout=layout, deterministic=True,
                                         backend="simt")
        ref = _reference(do, q, k, v, causal=True, layout=layout)
        for g, want in zip(got, ref, strict=True):
            tol = 1e-10 if g.dtype == np.float64 else 2e-5 if g.dtype == np.float32 else 2e-2
            assert _max_err(_to_bhsd(g, layout).astype(np.float64), want) <= tol * (1 + np.abs(want).max())
        [cfg] = launched
        assert cfg.dkdv.async_copy == cfg.dq.async_copy
        return cfg.dkdv.async_copy

    args = _inputs(rng, xp, 1, 2, 9, 10, 8, np.float32, causal=True)
    assert run(*args)
    assert run(*_inputs(rng, xp, 1, 3, 9, 10, 8, np.float32, causal=True, layout="bshd"), layout="bshd")
    assert not run(*_inputs(rng, xp, 1, 2, 9, 10, 8, np.float64, causal=True))  # no float64 variant
    assert not run(*_inputs(rng, xp, 1, 2, 9, 10, 8, np.float16, causal=True))  # converted on load
    assert not run(*_inputs(rng, xp, 1, 2, 9, 10, 6, np.float32, causal=True))  # rows of 24 bytes

    def shifted(x):  # the same values, one float into a buffer: the data pointer 4 bytes past 16
        buf = xp.zeros(x.size + 1, dtype=x.dtype)
        view = buf[1:].reshape(x.shape)
        view[...] = x
        return view

    do, q, k, v, o, lse = args
    for name in bw.COPIED:  # each of q, k, v, o, do misaligned in turn
        moved = dict(do=do, q=q, k=k, v=v, o=o)
        moved[name] = shifted(moved[name])
        assert not run(moved["do"], moved["q"], moved["k"], moved["v"], moved["o"], lse), name
        ok, why = async_copy_ok(bw.choose_config(8, "float32").dkdv, *(moved[n] for n in bw.COPIED),
                                names=bw.COPIED)
        assert not ok and why == f"{name}'s data pointer is not 16-byte aligned"
    # A forced cp.async configuration refuses the misaligned view.
    cfg = bw.async_variant(bw.choose_config(8, "float32"))
    grads = [xp.empty_like(x) for x in (q, k, v)]
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        launch(cfg, shifted(q), k, v, o, do, lse, *grads, 0.5, True)


def test_async_copy_two_groups(monkeypatch):
    """Two-group dK/dV tiles keep plain loads (cp.async measured slower there on the H200); their cp.async
    variant needs a second Q_i buffer (199 KB at D = 128), which a GPU allowing 180 KB refuses.  One-group
    tiles at D = 64 take cp.async."""
    q = np.zeros((1, 1, 4, 128), np.float32)
    cfg = bw.choose_config(128, "float32", simulator=False)
    assert cfg.dkdv.groups == 2
    copies = bw.async_variant(cfg)
    assert bw.dkdv_shared_bytes(cfg.dkdv) < 180 * 1024 < bw.dkdv_shared_bytes(copies.dkdv) <= 227 * 1024
    assert bw.with_copies(cfg, q, q, q, q, q) == cfg
    assert bw.can_implement(copies)[0]
    monkeypatch.setattr(bw, "max_shared_per_block", lambda: 180 * 1024)
    ok, why = bw.can_implement(copies)
    assert not ok and "shared memory" in why
    q64 = np.zeros((1, 1, 4, 64), np.float32)
    cfg64 = bw.choose_config(64, "float32", simulator=False)
    assert bw.with_copies(cfg64, q64, q64, q64, q64, q64) == bw.async_variant(cfg64)


def test_tile_config_rejects_columns_that_do_not_split():
    with pytest.raises(ValueError, match="multiple of 8"):
        TileConfig(8, 8, 12, 4, 2, "float32", groups=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        TileConfig(8, 8, 24, 4, 2, "float32", interleave=True)
    with pytest.raises(ValueError, match="groups must be 1 or 2"):
        TileConfig(8, 8, 8, 4, 2, "float32", groups=3)


def test_head_dim_256(rng, xp):
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 1, 3, 5, 256, np.float64, causal=True, scale=0.3)
    got = nbflash.attention_backward(do, q, k, v, o, lse, causal=True, scale=0.3)
    ref = _reference(do, q, k, v, causal=True, scale=0.3)
    for g, want in zip(got, ref, strict=True):
        assert _max_err(_host(g), want) <= 1e-10 * (1 + np.abs(want).max())


def test_with_the_forward_kernel(rng, xp):
    """End to end: o and lse from nbflash.attention."""
    q, k, v, do = (xp.asarray(rng.standard_normal((1, 2, n, 8)).astype(np.float32)) for n in (9, 11, 11, 9))
    o, lse = nbflash.attention(q, k, v, causal=True, return_lse=True)
    got = nbflash.attention_backward(do, q, k, v, o, lse, causal=True)
    ref = _reference(do, q, k, v, causal=True)
    for g, want in zip(got, ref, strict=True):
        assert _max_err(_host(g), want) <= 2e-5 * (1 + np.abs(want).max())


def test_inputs_not_modified(rng, xp):
    args = _inputs(rng, xp, 1, 1, 9, 9, 8, np.float32, causal=True)
    copies = [_host(a).copy() for a in args]
    for deterministic in (True, False):
        nbflash.attention_backward(*args, causal=True, deterministic=deterministic)
        for a, c in zip(args, copies, strict=True):
            assert np.array_equal(_host(a), c)


# ----------------------------------------------------------------------------
# Bad inputs: refused before anything runs
# ----------------------------------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for bad input")

    monkeypatch.setattr(bw, "launch_backward", refuse)


def _bad_cases(xp, rng):
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 2, 5, 6, 8, np.float32)
    ok = dict(do=do, q=q, k=k, v=v, o=o, lse=lse)

    def wide(x):  # last axis not contiguous
        w = xp.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
        return w[..., ::2]

    cases = [
        ("do", TypeError, dict(do=do.astype(np.float64))),
        ("do", TypeError, dict(do=do.astype(np.float16))),
        ("o", TypeError, dict(o=o.astype(np.float64))),
        ("lse", TypeError, dict(lse=lse.astype(np.float64))),
        ("lse", TypeError, dict(lse=lse.astype(np.float16))),
        ("do", ValueError, dict(do=do[:, :, :4])),
        ("o", ValueError, dict(o=o[:, :1])),
        ("o", ValueError, dict(o=o[..., :4])),
        ("lse", ValueError, dict(lse=lse[:, :, :4])),
        ("lse", ValueError, dict(lse=lse[..., None])),
        ("lse", ValueError, dict(lse=lse[0])),
        ("do", ValueError, dict(do=wide(do))),
        ("o", ValueError, dict(o=wide(o))),
        ("q", ValueError, dict(q=wide(q))),
        ("do", TypeError, dict(do=_host(do).tolist())),
        ("o", TypeError, dict(o=None)),
        ("lse", TypeError, dict(lse=_host(lse).tolist())),
        ("q", TypeError, dict(q=_host(q).tolist())),
        ("k", TypeError, dict(k=k.astype(np.float64))),
        ("k and v", ValueError, dict(v=v[:, :, :3])),
        ("q", ValueError, dict(q=q[0])),
        (
            "head dim",
            ValueError,
            dict(**{n: xp.zeros(a.shape[:-1] + (257,), dtype=a.dtype) for n, a in ok.items() if n != "lse"}),
        ),
    ]
    flags = [
        ("deterministic", TypeError, dict(deterministic="yes")),
        ("causal", TypeError, dict(causal=1)),
        ("layout", ValueError, dict(layout="sbhd")),
        ("scale", ValueError, dict(scale=math.inf)),
        ("scale", TypeError, dict(scale="0.5")),
    ]
    return ok, cases, flags


def test_bad_inputs_name_the_argument(rng, xp, no_launch):
    """Each error message starts with the offending argument's name."""
    ok, cases, flags = _bad_cases(xp, rng)
    order = ("do", "q", "k", "v", "o", "lse")
    for name, exc, change in cases:
        args = {**ok, **change}
        with pytest.raises(exc, match=rf"^{name}\b"):
            nbflash.attention_backward(*(args[n] for n in order))
    for name, exc, kwargs in flags:
        with pytest.raises(exc, match=rf"^{name}\b"):
            nbflash.attention_backward(*(ok[n] for n in order), **kwargs)


def test_float64_inputs_need_float64_lse(rng, xp, no_launch):
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 1, 3, 3, 8, np.float64)
    with pytest.raises(TypeError, match="lse must have dtype float64"):
        nbflash.attention_backward(do, q, k, v, o, lse.astype(np.float32))


def test_torch_tensors_refused(rng, xp, no_launch):
    torch = pytest.importorskip("torch")
    do, q, k, v, o, lse = _inputs(rng, xp, 1, 1, 3, 3, 8, np.float32)
    with pytest.raises(TypeError, match="do must be"):
        nbflash.attention_backward(torch.zeros(tuple(do.shape)), q, k, v, o, lse)
    with pytest.raises(TypeError, match="lse must be"):
        nbflash.attention_backward(do, q, k, v, o, torch.zeros(tuple(lse.shape)))


# ----------------------------------------------------------------------------
# Configurations and the real GPU code
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("input_kind", ["float16", "bfloat16", "float32", "float64"])
def test_gpu_configs_can_run(input_kind):
    """Every head dim's configuration fits an H200 (227 KB of shared memory; 128 threads, or two groups of 128)."""
    api = bw.api_configs()
    for head_dim in range(1, 257):
        cfg = bw.choose_config(head_dim, input_kind, simulator=False)
        ok, why = bw.can_implement(cfg)
        assert ok, (head_dim, why)
        assert max(bw.dkdv_shared_bytes(cfg.dkdv), bw.dq_shared_bytes(cfg.dq)) <= 227 * 1024
        assert cfg.dq.threads == 128 and cfg.dkdv.threads == 128 * cfg.dkdv.groups
        assert cfg.dkdv.groups == (2 if input_kind == "float32" and 64 < cfg.dkdv.head_dim_pad <= 128 else 1)
        if input_kind == "float32" and head_dim % 4 == 0:  # what with_copies picks for aligned rows
            copies = bw.async_variant(cfg)
            ok, why = bw.can_implement(copies)
            assert ok, (head_dim, why)
            assert max(bw.dkdv_shared_bytes(copies.dkdv), bw.dq_shared_bytes(copies.dq)) <= 227 * 1024
            assert copies in api


def test_two_group_tiles_step_down_where_shared_memory_is_short(monkeypatch):
    """float32 at D = 128 takes 64 × 64 dK/dV tiles in two thread groups (166 KB); an A100's 163 KB gets 32 × 32."""
    bw.choose_config.cache_clear()
    wide = bw.choose_config(128, "float32", simulator=False)
    assert (wide.dkdv.groups, wide.dkdv.block_n, wide.dkdv.block_m) == (2, 64, 64) and wide.dkdv.interleave
    monkeypatch.setattr(bw, "_shared_limit", lambda: 163 * 1024)
    bw.choose_config.cache_clear()
    try:
        small = bw.choose_config(128, "float32", simulator=False)
    finally:
        bw.choose_config.cache_clear()
    assert (small.dkdv.groups, small.dkdv.block_n, small.dkdv.block_m) == (1, 32, 32)
    assert bw.dkdv_shared_bytes(small.dkdv) <= 163 * 1024 < bw.dkdv_shared_bytes(wide.dkdv)


_PTX_SCRIPT = textwrap.dedent(
    r"""
    import json, re, sys, time
    from nbflash import backward as bw
    from nbflash._device import SIMULATOR, compile_ptx_offline, ptxas_info
    assert not SIMULATOR

    def ptxas(ptx):
        # nvJitLink runs ptxas for sm_90 without a GPU; its log has registers and spills.
        try:
            info = ptxas_info(ptx, "sm_90")
        except ImportError:  # no cuda.bindings: only local memory is checked
            return None, None
        return info["registers"], info["spill_bytes"]

    configs = []
    for arg in sys.argv[1:]:  # HEAD_DIM:KIND, or HEAD_DIM:KIND:as for the API's cp.async variant
        head_dim, kind, *copies = arg.split(":")
        cfg = bw.choose_config(int(head_dim), kind, simulator=False)
        configs.append(bw.async_variant(cfg) if copies == ["as"] else cfg)
    targets = bw.compile_targets(configs)
    print(json.dumps(dict(targets=len(targets))), flush=True)
    for name, tile, kern, sig, fastmath in targets:
        t = time.perf_counter()
        bounds = dict(launch_bounds=(tile.threads, tile.min_blocks)) if tile.min_blocks else {}
        ptx = compile_ptx_offline(kern.py_func, sig, cc=(9, 0), fastmath=fastmath, **bounds)
        seconds = time.perf_counter() - t
        regs, spills = ptxas(ptx)
        row = dict(kernel=name, config=f"D_PAD={tile.head_dim_pad} {tile.input_kind} {tile.block_m}x{tile.block_n}"
                   f"{' groups=2' if tile.groups == 2 else ''}{' cp.async' if tile.async_copy else ''}"
                   f"{f' min_blocks={tile.min_blocks}' if tile.min_blocks else ''}",
                   seconds=round(seconds, 2), local=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
                   regs=regs, spill_bytes=spills, barriers=ptx.count("bar.sync"), entry=".entry" in ptx,
                   async_copy=tile.async_copy, cp_async=ptx.count("cp.async.cg.shared.global"))
        print(json.dumps(row), flush=True)
    """
)

# (head dim, input kind[, as]) compiled by test_kernels_compile_for_sm90 (":as": the cp.async variant the
# API runs on aligned float32); set NBFLASH_PTX_ALL=1 to compile every head dim of 64/128/256 for every type.
_PTX_CONFIGS = ["64:float32", "128:float16", "64:float32:as", "256:bfloat16", "128:float32:as", "64:float64",
                "256:float64"]  # two processes take every other entry: 64:float32's two variants share one
_PTX_ALL = [f"{d}:{k}" for d in (64, 128, 256) for k in ("float32", "float16", "bfloat16", "float64")] + [
    f"{d}:float32:as" for d in (64, 128, 256)]


@pytest.mark.offline
def test_kernels_compile_for_sm90():
    """Every backward kernel compiles with NVVM for sm_90, with no register array in local memory.

    Runs in fresh processes without the simulator (no GPU needed).  Where
    nvJitLink is installed, ptxas must also report no register spills (under
    the kernel's launch bounds, if it has them).  The cp.async variants must
    copy by cp.async (steps 0 and 2' copy nothing: they are the plain kernels).
    """
    configs = _PTX_ALL if os.environ.get("NBFLASH_PTX_ALL") else _PTX_CONFIGS
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    halves = [configs[0::2], configs[1::2]]  # two processes: NVVM is single-threaded
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PTX_SCRIPT, *part],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for part in halves
        if part
    ]
    results, expected = [], 0
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-4000:]
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        expected += rows[0]["targets"]
        results += rows[1:]
    assert len(results) == expected >= 3 * len(configs)  # five kernels per configuration, some shared
    assert any(r["async_copy"] for r in results)
    for r in results:
        print(r)
        assert r["entry"], r
        assert r["local"] == 0, f"{r['config']} {r['kernel']}: register arrays went to local memory"
        if r["spill_bytes"] is not None:
            assert r["spill_bytes"] == 0, f"{r['config']} {r['kernel']}: ptxas spilled registers ({r})"
        if r["kernel"] in ("flash_backward_dkdv", "flash_backward_dq"):
            assert r["barriers"] > 0, r
        assert (r["cp_async"] > 0) == r["async_copy"], r


# ----------------------------------------------------------------------------
# Steps 0 and 2' by 16-byte accesses (16-bit inputs, head dims that are multiples of 8)
# ----------------------------------------------------------------------------


def _rows_view(xp, x, how):
    """``x`` (B, H, N, D) as a view whose rows are whole aligned 16-byte chunks (``aligned``), strided along D
    (``strided``: every other element of a wider array) or 2 bytes off alignment (``offset``, on the device)."""
    if how == "aligned":
        return xp.asarray(x)
    if how == "strided":
        wide = xp.zeros(x.shape[:3] + (2 * x.shape[3],), x.dtype)
        wide[..., ::2] = xp.asarray(x)
        return wide[..., ::2]
    flat = np.zeros(x.size + 1, x.dtype)
    flat[1:] = _host(x).ravel()
    # A device array: the simulator copies host arrays into fresh (aligned) ones at every launch.
    return (nbflash._device.cuda.to_device(flat) if nbflash.SIMULATOR else xp.asarray(flat))[1:].reshape(x.shape)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("how", ["aligned", "strided", "offset"])
def test_preprocess_wide_reads_rows_of_any_layout(rng, xp, kind, how):
    """Step 0 by 16-byte loads: D_i = Σ dO ∘ O in float32 and lse2 = lse · log2 e (+inf where lse = −inf), for O
    rows that are whole aligned chunks or not (then element by element); the accumulator cleared, padding rows
    included.  D = 24: three chunks among eight lanes; 7 rows: a ragged last block."""
    B, H, N, D = 1, 2, 7, 24
    assert bw.takes_wide_rows(kind, D)
    dtype = np.float16 if kind == "float16" else np.uint16
    vals = rng.standard_normal((2, B, H, N, D)).astype(np.float32)
    if kind == "float16":
        o, do = (v.astype(np.float16) for v in vals)
        ov, dov = (x.astype(np.float64) for x in (o, do))
    else:
        o, do = (intrinsics.f32_to_bf16_bits(v) for v in vals)
        ov, dov = (intrinsics.bf16_bits_to_f32(x).astype(np.float64) for x in (o, do))
    lse = rng.standard_normal((B, H, N)).astype(np.float32)
    lse[0, 1, 3] = -np.inf  # a row that saw no key
    rows = 8  # the accumulator's rows: one padding row
    accum = xp.full((B, H, rows, D), np.nan, np.float32)
    delta, lse2 = (xp.full((B, H, N), np.nan, np.float32) for _ in range(2))
    tile = bw._steps_0_and_2p(bw.choose_config(D, kind).dq)
    o_in, do_in = _rows_view(xp, o.astype(dtype), how), xp.asarray(do.astype(dtype))
    bw.launch_preprocess(tile, o_in, do_in, xp.asarray(lse), delta, lse2, accum, True, 0, rows=rows)
    np.testing.assert_allclose(_host(delta), (ov * dov).sum(-1), rtol=1e-5, atol=1e-5)
    want = lse.astype(np.float64) * math.log2(math.e)
    want[0, 1, 3] = np.inf
    np.testing.assert_allclose(_host(lse2), want, rtol=1e-6)
    assert np.all(_host(accum) == 0)
    assert np.array_equal(_host(o_in).view(np.uint16), o.view(np.uint16)), "o was modified"


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("how", ["aligned", "strided", "offset"])
def test_dq_convert_wide_rounds_every_value(rng, xp, kind, how):
    """Step 2' by 16-byte accesses: dq = accumulator · scale rounded to nearest even, bit for bit, into rows that
    are whole aligned chunks or not (then element stores); columns of accumulator padding are not read into dq."""
    B, H, N, D = 2, 1, 9, 40
    scale = 0.3
    acc = (rng.standard_normal((B, H, N, 48)) * 4).astype(np.float32)  # 48: rows padded, as the SIMT route's
    prod = acc[..., :D] * np.float32(scale)
    if kind == "float16":
        want, dtype = prod.astype(np.float16).view(np.uint16), np.float16
    else:
        want, dtype = intrinsics.f32_to_bf16_bits(prod), np.uint16
    dq = _rows_view(xp, np.full((B, H, N, D), 0x7FFF, np.uint16).view(dtype), how)  # poisoned
    tile = bw._steps_0_and_2p(bw.choose_config(D, kind).dq)
    bw.launch_dq_convert(tile, xp.asarray(acc), dq, scale, 0)
    np.testing.assert_array_equal(_host(dq).view(np.uint16), want)


def test_steps_0_and_2p_keep_the_tile_kernels_where_rows_are_not_chunks(monkeypatch):
    """Head dims that are not multiples of 8, and 32/64-bit inputs, keep the tile kernels of steps 0 and 2'."""
    assert not bw.takes_wide_rows("float16", 20)
    assert not bw.takes_wide_rows("float32", 64)
    assert bw.takes_wide_rows("bfloat16", 8) and bw.takes_wide_rows("float16", 256)
    launched = []
    monkeypatch.setattr(bw, "launch", lambda kern, *a: launched.append(kern))
    for d, kind in ((20, "float16"), (64, "float32"), (64, "bfloat16")):
        tile = bw._steps_0_and_2p(bw.choose_config(d, kind).dq)
        x = np.zeros((1, 1, 4, d), np.float32 if kind == "float32" else np.float16)
        bw.launch_preprocess(tile, x, x, None, None, None, None, False, 0)
        bw.launch_dq_convert(tile, None, x, 1.0, 0)
    want = []
    for d, kind in ((20, "float16"), (64, "float32")):
        tile = bw._steps_0_and_2p(bw.choose_config(d, kind).dq)
        want += [bw.preprocess_kernel(tile), bw.dq_convert_kernel(tile)]
    want += [bw.preprocess_wide_kernel("bfloat16"), bw.dq_convert_wide_kernel("bfloat16")]
    assert launched == want
