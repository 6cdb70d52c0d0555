"""The tensor-core kernels at ragged sizes, a short run for ``compute-sanitizer`` (the full set: sanitize.py).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_tc.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_tc.py --mma-backward   # that backward only
    compute-sanitizer --tool racecheck python benchmarks/sanitize_tc.py --bulk-dq   # the bulk_dq backward only
    compute-sanitizer --tool racecheck python benchmarks/sanitize_tc.py --mma-forward   # that forward only
    compute-sanitizer --tool racecheck python benchmarks/sanitize_tc.py --wgmma-forward   # the Hopper forward only
    compute-sanitizer --tool racecheck python benchmarks/sanitize_tc.py --wgmma-backward  # the Hopper backward only

Under the tool every kernel compiles far slower: run the same command once without it first, with the same
``NUMBA_CACHE_DIR``, so that the tool's run loads the kernels from the disk cache (``--wgmma-forward
--part=i/n``, for i from 0 to n − 1 in n processes at once, compiles and runs a share of its kernels; a machine
that has not kept its files compiles them all under the tool, over 200 s).  That plain pass compiles
one kernel after another (``--wgmma-backward`` took over 270 s on an H100 machine beside other work, 2026-12-06);
``warm_cache.py --layouts bshd`` compiles the same array types (strided bshd views) in parallel processes first,
e.g. ``--dtypes fp16 --dims 40,64,96,128 --backends wgmma --routes default,deterministic --layouts bshd`` for
``--wgmma-backward`` (not yet tried before the tool).  Its default bhsd calls are contiguous, another array type,
so other compiled kernels.

The ``mma.sync`` forward and backward (both dQ routes) at head dims 40, 64, 128 and 256 (40: padded to 48
in shared memory; 256: two 128-column slices per key tile; the forward also with 300 queries, so that a whole
query tile sees no key),
and on a Hopper GPU the ``wgmma`` forward and backward defaults at 40, 64 and 128 (the backward by both dQ
routes; the forward's producer copies by TMA), the forward that copies with cp.async instead at 64 and
128, and the long-sequence default at both (at D = 64 a 128 × 192 ws-overlap kernel): bshd views, ragged K/V
(seqlen_q ≠ seqlen_k), causal with rows that see no key — whole tiles take the tile copier's short path, the
last ones its general path; the ``mma.sync`` forward's O goes out through shared memory (16-byte
stores), the ``wgmma`` forward's through the packed-pair epilogue.

``--wgmma-forward`` (sm_90): only the ``wgmma`` forward's TMA picks at D = 64, 128, 176 and 256 (``--dims=176,256``:
those only; above 128 the 2-stage ws-overlap kernels with K and V on their own mbarriers; and D = 64's two
long-sequence ones: the non-causal one with three consumer warpgroups, and the causal one with and without two Q_i
buffers and the seam step, its pick from 2k to 8k keys), each persistent (one block per multiprocessor) and not,
at 2 × 16 heads × 1100 rows (more work chunks than multiprocessors, so persistent blocks take several, causal ones
in pairs) and at 300 queries over 131 keys (items that see no key), causal and not.

``--wgmma-backward`` (sm_90): only the ``wgmma`` backward's defaults (the warp-specialised dK/dV kernel, copying
by TMA) at D = 40, 64, 96 and 128, by both dQ routes, causal and not, on bshd views at 150 and 300 queries over
131 keys (ragged tiles, query tiles that see no key, more query tiles than stages).

``--bulk-dq`` (sm_90): only the grid layout's atomic backward with ``bulk_dq`` (dQ by bulk reductions from shared
memory, :mod:`nbflash.backward_tc`) at D = 64 and 128 — the atomic default there (128 × 128 and 64 × 128 tiles,
the reductions between the dV and dK products) and the same tiles with them after both products — launched
directly on the same ragged causal shapes, plus three query tiles per key block at N_q = 300; in bfloat16, so
that a bf16 benchmark run before it has compiled the kernels (the disk cache).
"""

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy as cp  # noqa: E402

import nbflash  # noqa: E402
from nbflash import forward_wgmma  # noqa: E402

mma_backward_only = "--mma-backward" in sys.argv[1:]
if "--bulk-dq" in sys.argv[1:]:
    from nbflash import api, backward_tc

    def bf16_bits(shape):  # bfloat16 (as its uint16 bits) of standard normal values: the kernels a bf16 run compiles
        return (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)

    for d in (64, 128):
        default = backward_tc.choose_config(d, "bfloat16", atomic=True)  # bulk_dq, dQ between the dV and dK products
        assert default.bulk_dq and default.dq_before_dk, default
        for cfg in (default, dataclasses.replace(default, dq_before_dk=False)):
            for n_q, n_k in ((150, 131), (300, 131)):
                q = bf16_bits((1, 2, n_q, d))
                k, v = bf16_bits((1, 2, n_k, d)), bf16_bits((1, 2, n_k, d))
                o, lse = api.forward_arrays(q, k, v, causal=True, bf16_bits=True, backend="tensor_core")
                dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
                backward_tc.launch_backward_tc(cfg, q, q, k, v, o, lse, dq, dk, dv, d**-0.5, True,
                                               deterministic=False)
    cp.cuda.Device().synchronize()
    print("sanitize_tc: bulk_dq kernels ran")
    sys.exit(0)
if "--wgmma-backward" in sys.argv[1:]:
    for d in (40, 64, 96, 128):
        for n_q in (150, 300):
            long_q = cp.random.standard_normal((1, n_q, 2, d)).astype(cp.float16)
            kv = long_q[:, :131]
            for causal in (True, False):
                o, lse = nbflash.attention(long_q, kv, kv, causal=causal, layout="bshd", return_lse=True,
                                           backend="wgmma")
                for det in (True, False):
                    nbflash.attention_backward(long_q, long_q, kv, kv, o, lse, causal=causal, layout="bshd",
                                               deterministic=det, backend="wgmma")
    cp.cuda.Device().synchronize()
    print("sanitize_tc: wgmma backward kernels ran")
    sys.exit(0)
if "--wgmma-forward" in sys.argv[1:]:
    # --part=i/n: every n-th configuration from the i-th (at each head dim), to compile the kernels into the disk
    # cache in n processes at once before the tool's run
    def flag(name, sep, default):
        """The integers of ``--<name>=a<sep>b…`` on the command line; ``default`` without it."""
        return next((tuple(int(x) for x in a.split("=", 1)[1].split(sep)) for a in sys.argv
                     if a.startswith(f"--{name}=")), default)

    part, parts = flag("part", "/", (0, 1))
    # --dims=176,256: only these head dims (default all four; above 128 the ws-overlap picks with split stages)
    dims = flag("dims", ",", (64, 128, 176, 256))
    for d in dims:
        # At D = 64 also the long-sequence picks: 128 × 192 (causal) and three consumers, 192 × 128 (non-causal;
        # persistent: with the dynamic scheduler); and the causal one with two Q_i buffers and the seam step
        # (config_for's pick below SEAM_MAX_KEYS keys).
        cfgs = [forward_wgmma.choose_config(d, "float16", simulator=False, long_keys=long_keys,
                                            persistent=persistent, causal=pick_causal)
                for long_keys, pick_causal in (((False, True), (True, True), (True, False)) if d == 64 else
                                               ((False, True),))
                for persistent in (True, False)]
        if d == 64:
            cfgs += [forward_wgmma.choose_config(d, "float16", simulator=False, long_keys=True, persistent=persistent,
                                                 seam=True) for persistent in (True, False)]
        for cfg in cfgs[part::parts]:
            for (b, h, n_q, n_k), causal in [((2, 16, 1100, 1100), False), ((2, 16, 1100, 1100), True),
                                             ((1, 4, 300, 131), True)]:
                q = cp.random.standard_normal((b, h, n_q, d)).astype(cp.float16)
                k, v = (cp.random.standard_normal((b, h, n_k, d)).astype(cp.float16) for _ in range(2))
                o, lse = cp.empty_like(q), cp.empty((b, h, n_q), cp.float32)
                forward_wgmma.launch_forward_wgmma(cfg, q, k, v, o, lse, d**-0.5, causal)
    cp.cuda.Device().synchronize()
    print("sanitize_tc: wgmma forward kernels ran")
    sys.exit(0)
mma_forward_only = "--mma-forward" in sys.argv[1:]
hopper = nbflash._device.compute_capability()[0] == 9 and not (mma_backward_only or mma_forward_only)
for d in (40, 64, 128, 256):
    long_q = cp.random.standard_normal((1, 300, 2, d)).astype(cp.float16)
    x, kv = long_q[:, :150], long_q[:, :131]
    o, lse = nbflash.attention(x, kv, kv, causal=True, layout="bshd", return_lse=True, backend="tensor_core")
    # 300 queries over 131 keys: the first query tile (rows 0 … 127 see no key) has no key tile, so its warps
    # stage O over Q rows whose copies only the step-3 barrier orders
    nbflash.attention(long_q, kv, kv, causal=True, layout="bshd", backend="tensor_core")
    if mma_forward_only:
        continue
    for det in (True, False):
        nbflash.attention_backward(x, x, kv, kv, o, lse, causal=True, layout="bshd", deterministic=det,
                                   backend="tensor_core")
    if hopper and d <= 128:
        o, lse = nbflash.attention(x, kv, kv, causal=True, layout="bshd", return_lse=True, backend="wgmma")
        for det in (True, False):  # dQ by its own kernel, and by atomics in the dK/dV kernel
            nbflash.attention_backward(x, x, kv, kv, o, lse, causal=True, layout="bshd", deterministic=det,
                                       backend="wgmma")
    if hopper and d in (64, 128):  # the default (TMA) forward's twin without TMA, launched directly
        cfg = forward_wgmma.choose_config(d, "float16", simulator=False, copies="cp.async")
        qh, kh = x.transpose(0, 2, 1, 3), kv.transpose(0, 2, 1, 3)  # (B, H, N, D) views of the bshd arrays
        o4 = cp.empty_like(qh)
        forward_wgmma.launch_forward_wgmma(cfg, qh, kh, kh, o4, cp.empty(qh.shape[:3], cp.float32), d**-0.5, True)
        # ... and the long-sequence default (D <= 64: 128 × 192 ws-overlap, registers moved by setmaxnreg)
        cfg = forward_wgmma.choose_config(d, "float16", simulator=False, long_keys=True)
        forward_wgmma.launch_forward_wgmma(cfg, qh, kh, kh, o4, cp.empty(qh.shape[:3], cp.float32), d**-0.5, True)
cp.cuda.Device().synchronize()
print("sanitize_tc: all kernels ran")
