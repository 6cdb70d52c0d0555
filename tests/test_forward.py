"""The fused forward kernel against the float64 textbook formula.

In the simulator (CI) the shapes are tiny but chosen to cross every edge the
kernel has: one row, a prime length, one past a tile boundary, seqlen_q ≠
seqlen_k both ways with causal (rows that see no key), both layouts and
strided views, every dtype, head dims from 1 to 256, huge logits.  With a GPU
the same tests run on CuPy arrays, plus a few at real sizes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import nbflash
from nbflash import intrinsics, masking
from nbflash._tiles import TileConfig, pad_head_dim
from nbflash.demo import worked_example
from nbflash.forward import choose_config, launch_forward, shared_bytes
from nbflash.reference import attention_ref, causal_mask

TOL = {np.float32: 2e-6, np.float64: 1e-12}


def _host(a):
    return a if isinstance(a, np.ndarray) else a.get()


def make_qkv(rng, b, h, n_q, n_k, d, dtype=np.float32, layout="bhsd", scale=1.0):
    shape = (lambda n: (b, h, n, d)) if layout == "bhsd" else (lambda n: (b, n, h, d))
    return tuple((rng.standard_normal(shape(n)) * scale).astype(dtype) for n in (n_q, n_k, n_k))


def canon(x, layout):
    return x if layout == "bhsd" else x.transpose(0, 2, 1, 3)


def run_and_check(xp, q, k, v, *, causal, layout="bhsd", scale=None, tol=None):
    """Run nbflash on ``xp`` arrays; compare o and lse with the float64 reference."""
    copies = [a.copy() for a in (q, k, v)]
    o, lse = nbflash.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=causal, scale=scale,
                               layout=layout, return_lse=True)
    o, lse = _host(o), _host(lse)
    for a, c in zip((q, k, v), copies, strict=True):
        assert np.array_equal(a, c), "an input was modified"
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == (np.float64 if q.dtype == np.float64 else np.float32)
    ref_o, ref_lse = attention_ref(canon(q, layout), canon(k, layout), canon(v, layout), causal=causal, scale=scale)
    assert lse.shape == ref_lse.shape
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    tol = tol if tol is not None else TOL[q.dtype.type]
    np.testing.assert_allclose(canon(o, layout), ref_o, atol=tol, rtol=0)
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~seen)
    np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=tol * 10, rtol=tol)
    return o, lse


# Sim tiles are 8 queries × 8 keys: 1, a prime, one past a tile edge, several tiles.
SEQLENS = [(1, 1), (7, 7), (9, 9), (17, 17), (5, 11), (11, 5), (3, 20), (20, 3)]


@pytest.mark.parametrize("n_q,n_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
def test_seqlens(xp, rng, n_q, n_k, causal):
    q, k, v = make_qkv(rng, 1, 2, n_q, n_k, 8)
    run_and_check(xp, q, k, v, causal=causal)


@pytest.mark.parametrize("d", [1, 3, 8, 40, 64, 256])
def test_head_dims(xp, rng, d):
    q, k, v = make_qkv(rng, 1, 1, 9, 10, d)
    run_and_check(xp, q, k, v, causal=True)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layouts_and_dtypes(xp, rng, layout, dtype):
    q, k, v = make_qkv(rng, 2, 3, 10, 13, 16, dtype=dtype, layout=layout)
    run_and_check(xp, q, k, v, causal=True, layout=layout)


def test_strided_views(xp, rng):
    """Views whose last axis is contiguous run without a copy: a head-dim slice and a transposed array."""
    big = rng.standard_normal((2, 11, 3, 24)).astype(np.float32)  # (B, N, H, D + 8)
    q = big[:, :, :, 4:20].transpose(0, 2, 1, 3)  # bhsd view of a bshd buffer, row stride 3·24
    k = rng.standard_normal((2, 3, 9, 40)).astype(np.float32)[..., ::1][:, :, :, 8:24]
    v = rng.standard_normal((2, 3, 18, 16)).astype(np.float32)[:, :, ::2, :]  # every other row
    assert not q.flags.c_contiguous and not k.flags.c_contiguous and not v.flags.c_contiguous
    if xp is np:
        run_and_check(xp, q, k, v, causal=False)
    else:
        # CuPy keeps the strides when given a strided device view.
        qd, kd, vd = (xp.asarray(np.ascontiguousarray(a)) for a in (big, k, v))
        o = nbflash.attention(qd[:, :, :, 4:20].transpose(0, 2, 1, 3), kd, vd)
        ref, _ = attention_ref(q, k, v)
        np.testing.assert_allclose(_host(o), ref, atol=2e-6)


def test_scale_and_large_logits(xp, rng):
    """Logits in the thousands (exp would overflow float32 at 89): the running max keeps it finite.

    float32 rounding of a logit of ~2500 is ~1e-4, so outputs agree to ~1e-3.
    """
    q, k, v = make_qkv(rng, 1, 2, 12, 12, 8, scale=30.0)
    run_and_check(xp, q, k, v, causal=True, tol=5e-3)
    run_and_check(xp, q, k, v, causal=False, scale=0.37, tol=5e-3)


def test_rows_that_see_no_key(xp, rng):
    """Causal with seqlen_q > seqlen_k: the first rows attend to nothing → o = 0, lse = -inf."""
    q, k, v = make_qkv(rng, 1, 1, 12, 4, 8)
    o, lse = run_and_check(xp, q, k, v, causal=True)
    assert np.all(o[0, 0, :8] == 0) and np.all(np.isneginf(lse[0, 0, :8]))
    assert np.all(np.isfinite(lse[0, 0, 8:]))


def test_float16_flash_attn_rule(xp, rng):
    """fp16 error ≤ 2× that of a naive fp16 attention against the same float64 reference."""
    q, k, v = make_qkv(rng, 1, 2, 19, 21, 40, dtype=np.float16)
    o = _host(nbflash.attention(xp.asarray(q), xp.asarray(k), xp.asarray(v), causal=True))
    ref, _ = attention_ref(q, k, v, causal=True)
    # naive fp16: matmul, softmax and matmul each rounded to fp16
    s = (np.einsum("bhid,bhjd->bhij", q, k).astype(np.float16) * np.float16(1 / math.sqrt(40))).astype(np.float16)
    s = np.where(causal_mask(19, 21), s, -np.inf).astype(np.float16)
    p = np.exp((s - s.max(-1, keepdims=True)).astype(np.float16)).astype(np.float16)
    p = (p / p.sum(-1, keepdims=True, dtype=np.float16)).astype(np.float16)
    naive = np.einsum("bhij,bhjd->bhid", p, v).astype(np.float16)
    err = np.abs(o.astype(np.float64) - ref).max()
    naive_err = np.abs(naive.astype(np.float64) - ref).max()
    assert err <= 2 * naive_err + 1e-6, (err, naive_err)


def test_worked_example_online_softmax():
    """The real kernel, traced: scores (1, 2, 3, 0) in two key tiles of two."""
    m, l, o, lse, expected = worked_example()
    np.testing.assert_allclose(m, [2.0, 3.0], atol=1e-6)
    np.testing.assert_allclose(l, [math.exp(-1) + 1, (math.exp(-1) + 1) * math.exp(-1) + 1 + math.exp(-3)], rtol=1e-6)
    assert round(float(l[0]), 3) == 1.368 and round(float(l[1]), 3) == 1.553
    assert o == pytest.approx(expected, rel=1e-6)
    assert lse == pytest.approx(math.log(sum(math.exp(s) for s in (1, 2, 3, 0))), rel=1e-6)


@pytest.mark.parametrize(
    "cfg",
    [
        TileConfig(4, 4, 8, 2, 4, "float32"),  # tiles smaller than the sim default
        TileConfig(16, 8, 8, 8, 4, "float32"),  # 8 lanes per row, 4 rows per thread
        TileConfig(8, 16, 16, 4, 2, "float64", "float64"),
    ],
    ids=str,
)
def test_other_tile_configs(xp, rng, cfg):
    """The kernel is correct for any legal configuration, not only the one the API picks."""
    dt = np.float64 if cfg.acc_kind == "float64" else np.float32
    d = min(cfg.head_dim_pad, 7)
    q, k, v = make_qkv(rng, 1, 2, 13, 29, d, dtype=dt)
    for causal in (False, True):
        o = xp.full(q.shape, np.nan, dt)
        lse = xp.full(q.shape[:3], np.nan, dt)
        launch_forward(cfg, xp.asarray(q), xp.asarray(k), xp.asarray(v), o, lse, 1 / math.sqrt(d), causal)
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        np.testing.assert_allclose(_host(o), ref, atol=TOL[dt])


@pytest.mark.parametrize("longest_first", [False, True])
def test_interleaved_columns_and_grid_order(xp, rng, longest_first):
    """Head-dim columns in 16-byte runs (lane tx: 4tx..4tx+3 and 16+4tx..16+4tx+3), either grid order."""
    cfg = TileConfig(8, 8, 32, 4, 2, "float32", interleave=True, longest_first=longest_first)
    q, k, v = make_qkv(rng, 2, 3, 21, 19, 29)
    for causal in (False, True):
        o = xp.full(q.shape, np.nan, np.float32)
        lse = xp.full(q.shape[:3], np.nan, np.float32)
        launch_forward(cfg, xp.asarray(q), xp.asarray(k), xp.asarray(v), o, lse, 1 / math.sqrt(29), causal)
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        np.testing.assert_allclose(_host(o), ref, atol=TOL[np.float32])
        np.testing.assert_allclose(_host(lse), ref_lse, atol=TOL[np.float32])


@pytest.mark.parametrize(
    "cfg",
    [
        TileConfig(8, 8, 16, 4, 2, "float32", async_copy=True),  # head dim 12 pads to 16: a zero-filled chunk
        TileConfig(16, 8, 32, 8, 4, "float32", async_copy=True, interleave=True),
        TileConfig(4, 16, 32, 4, 4, "float32", async_copy=True, longest_first=True),
    ],
    ids=str,
)
def test_async_copy(xp, rng, cfg, monkeypatch):
    """cp.async tiles (V_j under S = Q_i K_jᵀ, K_{j+1} under acc += P V_j): ragged ends, causal, N_q ≠ N_k.

    In the simulator each copy lands only at the wait that covers it (NaN until then), so a tile read
    before its wait and barrier, or overwritten while still read, fails here."""
    monkeypatch.setattr(intrinsics, "SIM_CP_ASYNC_LANDS_AT_WAIT", True)
    d = 12 if cfg.head_dim_pad == 16 else cfg.head_dim_pad
    for n_q, n_k in [(1, 1), (13, 29), (29, 13), (17, 16)]:
        q, k, v = make_qkv(rng, 2, 1, n_q, n_k, d)
        for causal in (False, True):
            o = xp.full(q.shape, np.nan, np.float32)
            lse = xp.full(q.shape[:3], np.nan, np.float32)
            launch_forward(cfg, xp.asarray(q), xp.asarray(k), xp.asarray(v), o, lse, 1 / math.sqrt(d), causal)
            ref, ref_lse = attention_ref(q, k, v, causal=causal)
            np.testing.assert_allclose(_host(o), ref, atol=TOL[np.float32])
            seen = np.isfinite(ref_lse)
            np.testing.assert_array_equal(np.isneginf(_host(lse)), ~seen)
            np.testing.assert_allclose(_host(lse)[seen], ref_lse[seen], atol=1e-5)


def test_async_copy_choice(xp, rng):
    """The API copies by cp.async exactly where rows are whole 16-byte chunks (float32, aligned), else loads."""
    from nbflash.forward import async_copy_ok

    def plan(q, k, v, layout="bhsd"):
        return nbflash.which_backend(q, k, v, layout=layout, backend="simt").config

    q, k, v = (xp.asarray(a) for a in make_qkv(rng, 1, 2, 9, 10, 8))
    assert plan(q, k, v).async_copy
    qs, ks, vs = (xp.asarray(a) for a in make_qkv(rng, 1, 3, 9, 10, 8, layout="bshd"))
    assert plan(qs, ks, vs, layout="bshd").async_copy  # (B, N, H, D): strides are multiples of D = 8 floats
    assert not plan(*(a.astype(np.float64) for a in (q, k, v))).async_copy  # float64: no such variant
    assert not plan(*(a.astype(np.float16) for a in (q, k, v))).async_copy  # converted on load
    q6, k6, v6 = (xp.asarray(a) for a in make_qkv(rng, 1, 2, 9, 10, 6))
    assert not plan(q6, k6, v6).async_copy  # rows of 24 bytes
    # A view one float into a buffer: the data pointer is 4 bytes past a 16-byte boundary.
    buf = xp.asarray(rng.standard_normal(1 * 2 * 9 * 8 + 1).astype(np.float32))
    q_off = buf[1:].reshape(1, 2, 9, 8)
    assert not plan(q_off, k, v).async_copy
    ok, why = async_copy_ok(TileConfig(8, 8, 8, 4, 2, "float32", async_copy=True), q_off, k, v)
    assert not ok and "q's data pointer" in why
    # The fallback is still exact, and a forced cp.async configuration refuses the misaligned view.
    o = nbflash.attention(q_off, k, v, causal=True)
    ref = attention_ref(_host(q_off), _host(k), _host(v), causal=True)[0]
    np.testing.assert_allclose(_host(o), ref, atol=TOL[np.float32])
    cfg = TileConfig(8, 8, 8, 4, 2, "float32", async_copy=True)
    o = xp.empty(q_off.shape, np.float32)
    lse = xp.empty(q_off.shape[:3], np.float32)
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        launch_forward(cfg, q_off, k, v, o, lse, 0.5, False)
    with pytest.raises(ValueError, match="async_copy"):
        TileConfig(8, 8, 8, 4, 2, "float16", async_copy=True)


def test_gpu_configuration_in_simulator(xp, rng):
    """The configuration the GPU uses for D = 64 (256 threads, 128 × 64 tiles), run once in the simulator."""
    cfg = choose_config(64, "float32", simulator=False)
    q, k, v = make_qkv(rng, 1, 1, 3, 70, 64)
    for c in (cfg, dataclasses.replace(cfg, async_copy=True)):
        o = xp.full(q.shape, np.nan, np.float32)
        lse = xp.full(q.shape[:3], np.nan, np.float32)
        launch_forward(c, xp.asarray(q), xp.asarray(k), xp.asarray(v), o, lse, 0.125, True)
        ref, _ = attention_ref(q, k, v, causal=True)
        np.testing.assert_allclose(_host(o), ref, atol=2e-6)


def test_masking_host_functions():
    """The tile-range answers agree with the element mask for many tiles."""
    for n_q, n_k in [(1, 1), (5, 11), (11, 5), (16, 16), (13, 40)]:
        for causal in (False, True):
            full = causal_mask(n_q, n_k) if causal else np.ones((n_q, n_k), bool)
            for i in range(n_q):
                assert masking.row_key_end(i, n_q, n_k, causal) == full[i].sum()
            for j in range(n_k + 3):  # keys past the end too: no query sees them
                seen = full[:, j] if j < n_k else np.zeros(n_q, bool)
                begin, end = masking.key_query_range(j, n_q, n_k, causal)
                rows = np.arange(n_q)
                assert 0 <= begin <= end <= n_q and ((rows >= begin) & (rows < end)).tolist() == seen.tolist()
                for col0, n_cols in [(0, n_q), (3, 4), (-2, 5), (n_q, 2)]:  # a tile's columns: query col0 + c
                    lo, hi = masking.key_columns(j, col0, n_cols, n_q, n_k, causal)
                    cols = col0 + np.arange(n_cols)
                    sees = [c in range(n_q) and bool(seen[c]) for c in cols]
                    assert 0 <= lo <= hi <= n_cols
                    assert ((np.arange(n_cols) >= lo) & (np.arange(n_cols) < hi)).tolist() == sees
            for bm, bn in [(4, 4), (8, 2)]:
                for q0 in range(0, n_q, bm):
                    _, end = masking.key_range(q0, bm, n_q, n_k, causal)
                    assert end == (full[q0:q0 + bm].any(0).nonzero()[0].max() + 1 if full[q0:q0 + bm].any() else 0)
                    for k0 in range(0, n_k, bn):
                        tile = np.zeros((bm, bn), bool)
                        sub = full[q0:q0 + bm, k0:k0 + bn]
                        tile[: sub.shape[0], : sub.shape[1]] = sub
                        assert masking.tile_needs_mask(q0, k0, bm, bn, n_q, n_k, causal) == (not tile.all())
                        # the masked key tiles are the last ones, from first_masked_tile on
                        first = masking.first_masked_tile(q0, bm, bn, n_q, n_k, causal)
                        assert (k0 // bn >= first) == (not tile.all())
                for k0 in range(0, n_k, 4):
                    begin, _ = masking.query_range(k0, 4, n_q, n_k, causal)
                    rows = full[:, k0:k0 + 4].any(1).nonzero()[0]
                    assert begin == (rows.min() if len(rows) else n_q) or (len(rows) and begin <= rows.min())


def test_configs_fit_the_device():
    """Every configuration the API can pick fits the H200's 227 KB of shared memory per block."""
    for d in range(1, 257):
        for kind in ("float16", "bfloat16", "float32", "float64"):
            cfg = choose_config(d, kind, simulator=False)
            assert cfg.head_dim_pad >= d and cfg.head_dim_pad == pad_head_dim(d, cfg.threads_x)
            assert shared_bytes(cfg) <= 227 * 1024, cfg
            assert cfg.threads % 32 == 0


# ---------------------------------------------------------------------------
# Bad input: a clear error naming the argument, raised before any launch.
# ---------------------------------------------------------------------------


def good(xp, rng, dtype=np.float32):
    return tuple(xp.asarray(a) for a in make_qkv(rng, 1, 2, 5, 6, 8, dtype=dtype))


def test_errors_dtype(xp, rng):
    q, k, v = good(xp, rng)
    with pytest.raises(TypeError, match="q must be float16, float32 or float64"):
        nbflash.attention(q.astype(np.int32), k, v)
    with pytest.raises(TypeError, match="k must have dtype float32"):
        nbflash.attention(q, k.astype(np.float64), v)
    with pytest.raises(TypeError, match="v must have dtype float32"):
        nbflash.attention(q, k, v.astype(np.float16))


def test_errors_shapes(xp, rng):
    q, k, v = good(xp, rng)
    with pytest.raises(ValueError, match="q must be 4-D"):
        nbflash.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        nbflash.attention(q, k, v[:, :, :3])
    with pytest.raises(ValueError, match="batch size and number of heads"):
        nbflash.attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="head dim of q"):
        nbflash.attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="k must have the batch size"):
        nbflash.attention(q, k, v, layout="bshd")  # (1, 6, 2, 8) read as bshd has 6 heads


def test_errors_empty_and_head_dim(xp, rng):
    q, k, v = good(xp, rng)
    with pytest.raises(ValueError, match="q is empty"):
        nbflash.attention(q[:, :, :0], k, v)
    with pytest.raises(ValueError, match="k is empty"):
        nbflash.attention(q, k[:, :, :0], v[:, :, :0])
    big = xp.zeros((1, 1, 2, 257), np.float32)
    with pytest.raises(ValueError, match="head dim must be at most 256"):
        nbflash.attention(big, big, big)


def test_errors_strides_layout_scale_causal(xp, rng):
    q, k, v = good(xp, rng)
    with pytest.raises(ValueError, match="q must be contiguous in its last"):
        nbflash.attention(xp.asarray(np.asarray(_host(q))[..., ::-1].copy())[..., ::2], k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="layout must be"):
        nbflash.attention(q, k, v, layout="sbhd")
    with pytest.raises(TypeError, match="scale must be a real number"):
        nbflash.attention(q, k, v, scale="0.1")
    with pytest.raises(ValueError, match="scale must be finite"):
        nbflash.attention(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        nbflash.attention(q, k, v, causal=1)


def test_errors_array_type(xp, rng):
    q, k, v = good(xp, rng)
    with pytest.raises(TypeError, match="q must be"):
        nbflash.attention(_host(q).tolist(), k, v)
    other = _host(k) if xp is not np else None
    if other is not None:
        with pytest.raises(TypeError, match="k must be a CuPy array"):
            nbflash.attention(q, other, v)


def test_is_available():
    assert nbflash.is_available()


# ---------------------------------------------------------------------------
# GPU only: real sizes.
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,causal", [(97, 64, True), (1025, 128, False), (4096, 64, True), (8192, 128, True),
                                        (2048, 256, False)])
def test_gpu_real_sizes(xp, n, d, causal):
    import cupy as cp
    import torch

    q, k, v = (cp.random.standard_normal((2, 4, n, d), dtype=cp.float32) for _ in range(3))
    o = nbflash.attention(q, k, v, causal=causal)
    qt, kt, vt = (torch.as_tensor(a).double() for a in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=torch.as_tensor(causal_mask(n, n), device="cuda") if causal else None)
    assert float((torch.as_tensor(o).double() - ref).abs().max()) < 2e-5
