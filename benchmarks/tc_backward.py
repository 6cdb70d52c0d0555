"""Tensor-core backward on the GPU: gradients checked at real sizes, then timed next to SDPA's flash backward.

Run on a CUDA machine (CuPy and PyTorch needed)::

    python benchmarks/tc_backward.py --out benchmarks/results

1. Correctness: ``nbflash.attention_backward(backend="tensor_core")`` (atomic
   and deterministic dQ) against float64 autograd of the materialised formula,
   over odd sizes, causal and not, both layouts; each gradient's error must
   stay within twice that of PyTorch's own math attention in the same dtype
   (the flash-attn rule).  Outputs are fresh; inputs random.
2. Timing at batch·N = 16k, heads·D = 2048: the backward alone (TFLOP/s with
   2.5× the forward's FLOPs, halved for causal), medians of CUDA events after
   warm-up, next to SDPA's flash and cuDNN backwards (autograd.grad on a
   retained graph) in the same run.

Tile sweep (``--configs 64x64r,128x128r,64x128,wg128x64s23``): candidate
configurations of :mod:`nbflash.backward_tc`, by tag ``<block_m>x<block_n>``
plus ``r`` when each warp keeps its K/V fragments in registers, ``g<key groups><dQ row groups>``
for the dK/dV kernel's FlashAttention-2 warp grid (``TCBackwardConfig.warps_keys``,
``warps_dq_rows``; e.g. ``64x128g42``; ``b`` after it: atomic dQ by bulk reductions, ``bulk_dq``), and ``d<columns>``
for the gradient columns per block (``TCBackwardConfig.d_slice``; needed above
D = 128, e.g. ``32x64d64@256``; also after a ``wg`` tag), and of
:mod:`nbflash.backward_wgmma` by ``wg<block_m>x<block_n>`` plus, optionally,
``s<dK/dV buffers><dQ buffers>`` (``s23``: two buffers per streamed tile in the
dK/dV kernel, three in the dQ kernel; default two and two).  ``@64`` after a
tag: that head dim only.  Each head dim's current ``backward_tc`` default
(``choose_config``) always runs too.
Each candidate is compiled (registers, local memory), checked against float64
autograd with the flash-attn rule (bhsd, odd sizes, causal and not; a failing
candidate is reported and not timed), then timed through
``launch_backward_tc`` — deterministic dQ, and with ``--atomic`` the atomic dQ
route too — next to SDPA's flash backward on the same inputs, several calls
between two events so that host time does not count.

Results go to ``<out>/tc-backward-<device>-<date><suffix>.json`` (the tile sweep
rewrites it after every timed shape, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward_sweep import environment  # noqa: E402
from benchmarks.tc_sweep import as_cupy, compile_in_processes, cuda_time_ms  # noqa: E402
from nbflash import api  # noqa: E402
from nbflash import backward_tc as T  # noqa: E402
from nbflash import backward_wgmma as W  # noqa: E402
from nbflash._device import disk_cache_enabled  # noqa: E402

KIND = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"
TOKENS, WIDTH = 16384, 2048  # timed shapes: batch · N and heads · D
TAG = re.compile(r"(wg)?(\d+)x(\d+)(r?)(?:s(\d)(\d))?(w?)(?:g(\d)(\d)(b?)(e?))?(?:d(\d+))?(b?)(o?)(c?)(m?)(k?)(t?)"
                 r"(?:@(\d+))?")
# (seqlen_q, seqlen_k, causal) of the candidates' check: ragged tiles, both causal shapes, whole blocks.
SWEEP_CASES = [(97, 97, False), (200, 97, True), (97, 200, True), (1025, 1025, True), (2048, 2048, False)]


def torch_of(a, dtype):
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def nb_backward(q, k, v, do, causal, layout, deterministic, backend="tensor_core"):
    """(o, lse) by the forward, then (dq, dk, dv) by ``backend``'s backward — all torch tensors."""
    bf16 = q.dtype == torch.bfloat16
    cq, ck, cv, cdo = (as_cupy(x) for x in (q, k, v, do))
    o, lse = api.forward_arrays(cq, ck, cv, causal=causal, layout=layout, bf16_bits=bf16)
    grads = api.backward_arrays(
        cdo,
        cq,
        ck,
        cv,
        o,
        lse,
        causal=causal,
        layout=layout,
        bf16_bits=bf16,
        deterministic=deterministic,
        backend=backend,
    )
    return [torch_of(g, q.dtype) for g in grads]


def ref_grads(q, k, v, do, causal, layout, dtype):
    """Autograd of the materialised attention in ``dtype`` (bottom-right causal), in the caller's layout."""
    tr = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(1, 2))
    q, k, v = (tr(x).detach().to(dtype).requires_grad_() for x in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    o = torch.softmax(s, -1).nan_to_num(0.0) @ v
    return [tr(g) for g in torch.autograd.grad(o, (q, k, v), tr(do).to(dtype))]


#: The backward routes checked and timed: (deterministic, backend); the wgmma one is added on a Hopper GPU.
ROUTES = [(False, "tensor_core"), (True, "tensor_core")]


def worst_element(x, r):
    """Where ``x`` is farthest from ``r`` (index, value, reference): for a failure's log line."""
    i = int((x.double() - r).abs().argmax())
    idx = tuple(int(c) for c in torch.unravel_index(torch.tensor(i), x.shape))
    return f"at {idx}: {x.flatten()[i].item():.5g} vs {r.flatten()[i].item():.5g}"


def check(log, dims, dtypes, seed):
    failures = 0
    g = torch.Generator(device="cuda").manual_seed(seed)
    for d in dims:
        for dtype in dtypes:
            worst = 0.0
            for n_q, n_k, causal, layout in [
                (97, 97, False, "bhsd"),
                (200, 97, True, "bshd"),
                (97, 200, True, "bhsd"),
                (1025, 1025, True, "bshd"),
                (2048, 2048, False, "bhsd"),
                (128, 128, True, "bhsd"),
            ]:
                shp = (lambda n: (2, 3, n, d)) if layout == "bhsd" else (lambda n: (2, n, 3, d))
                q, k, v = (torch.randn(shp(n), device="cuda", dtype=dtype, generator=g) for n in (n_q, n_k, n_k))
                do = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
                ref = ref_grads(q, k, v, do, causal, layout, torch.float64)
                naive = ref_grads(q, k, v, do, causal, layout, dtype)
                for det, backend in ROUTES:
                    out = nb_backward(q, k, v, do, causal, layout, det, backend)
                    for name, x, r, nv in zip("q k v".split(), out, ref, naive, strict=True):
                        err = (x.double() - r).abs().max().item()
                        nerr = (nv.double() - r).abs().max().item()
                        ok = math.isfinite(err) and err <= 2 * nerr + 1e-4
                        worst = max(worst, err / max(nerr, 1e-9))
                        if not ok:
                            failures += 1
                            log(
                                f"FAIL D{d} {dtype} {n_q}x{n_k} causal={causal} {layout} {backend} det={det} d{name}: "
                                f"err {err:.2e} naive {nerr:.2e} {worst_element(x, r)} (seed {seed})"
                            )
            log(f"check backward D{d} {dtype}: worst err/naive {worst:.2f}")
    return failures


def is_wgmma(cfg) -> bool:
    return isinstance(cfg, W.WGBackwardConfig)


def tag(cfg) -> str:
    """``64x128r``: block_m × block_n, ``r`` when the K/V fragments stay in registers; ``g42``: the grid layout's
    warp groups (``b``: bulk dQ; ``e``: dQ between the dV and dK products); ``wg128x64``: the wgmma backward's
    block_m × block_n (``s<dK/dV stages><dQ stages>``; ``w``: the dK/dV kernel warp-specialised, copying by TMA;
    ``b``: the atomic route's dQ by bulk reductions from shared memory; ``o``: its product issued under dV's and
    dK's; ``c``: its 64-query chunks split between the warpgroups; ``m``: dSᵀ read MN-major from shared memory
    by that product, ``ds_mn_major``; ``k``: dK's product issued last and left running into the next tile,
    ``dk_last``).  ``t`` (``mma.sync`` only): ``staged_out``, the gradients written through shared memory in
    16-byte chunks.  (Until 2026-12-06 ``t`` also named the wgmma backward's ``staged_out``: now its only last
    step.)"""
    if is_wgmma(cfg):
        stages = "" if (cfg.dkdv_stages, cfg.dq_stages) == (2, 2) else f"s{cfg.dkdv_stages}{cfg.dq_stages}"
        cols = f"d{cfg.d_slice}" if cfg.d_slice else ""
        flags = "".join(c for c, on in (("b", cfg.bulk_dq), ("o", cfg.dq_overlap), ("c", cfg.dq_chunk_split),
                                        ("m", cfg.ds_mn_major), ("k", cfg.dk_last)) if on)
        return f"wg{cfg.block_m}x{cfg.block_n}{stages}{'w' if cfg.dkdv_ws else ''}{cols}{flags}"
    cols = f"d{cfg.d_slice}" if cfg.d_slice else ""
    grid = (f"g{cfg.warps_keys}{cfg.warps_dq_rows}{'b' if cfg.bulk_dq else ''}{'e' if cfg.dq_before_dk else ''}"
            if cfg.grid else "")
    return f"{cfg.block_m}x{cfg.block_n}{'r' if cfg.kv_in_registers else ''}{grid}{cols}{'t' if cfg.staged_out else ''}"


def parse_configs(spec: str, dims, kinds, only: bool = False) -> list[T.TCBackwardConfig]:
    """The candidates of ``--configs``: per head dim and kind, the ``mma.sync`` default first (not with ``only``),
    then each tag (``@D``: that D only).

    A tag that is malformed, or names tiles that ``TCBackwardConfig`` refuses, raises ``ValueError``.
    """
    tags = [t.strip() for t in spec.split(",") if t.strip()]
    parsed = []
    for t in tags:
        m = TAG.fullmatch(t)
        wg_only = m and any(m[i] for i in (5, 7, 13, 14, 15, 16, 17))  # flags of the wgmma backward
        if not m or (m[1] and (m[4] or m[8] or m[18])) or (wg_only and not m[1]):
            raise ValueError(
                f"bad config tag {t!r}: expected <block_m>x<block_n>[r][g<key groups><dQ row groups>[b][e]][d<columns>]"
                "[t][@<head dim>] or wg<block_m>x<block_n>[s<dK/dV stages><dQ stages>][w][d<columns>][b][o][c][m][k]"
                "[@<head dim>], "
                "e.g. 64x128r, 64x128g42, 32x64d64@256, wg128x64s23@128, wg128x64s33w, wg128x64wb or wg64x64d128@256"
            )
        stages = (int(m[5]), int(m[6])) if m[5] else (2, 2)
        grid = (int(m[8]), int(m[9]), m[10] == "b", m[11] == "e") if m[8] else (0, 0, False, False)
        parsed.append((bool(m[1]), int(m[2]), int(m[3]), m[4] == "r", stages, grid, int(m[12] or 0),
                       int(m[19]) if m[19] else None, m[7] == "w", m[13] == "b", m[14] == "o", m[15] == "c",
                       m[16] == "m", m[17] == "k", m[18] == "t"))
    cfgs = []
    for d in dims:
        for kind in kinds:
            default = T.choose_config(d, kind, simulator=False)
            mine = [] if only else [default]
            for wg, bm, bn, regs, stages, grid, cols, only, ws, bulk, overlap, split, mn, dk_last, staged in parsed:
                if only is not None and only != d:
                    continue
                if wg:
                    cfg = W.WGBackwardConfig(bm, bn, d, kind, dkdv_stages=stages[0], dq_stages=stages[1],
                                             d_slice=cols, dkdv_ws=ws, bulk_dq=bulk, dq_overlap=overlap,
                                             dq_chunk_split=split, ds_mn_major=mn, dk_last=dk_last)
                else:
                    cfg = T.TCBackwardConfig(bm, bn, d, kind, kv_in_registers=regs, vector_red=default.vector_red,
                                             d_slice=cols, warps_keys=grid[0], warps_dq_rows=grid[1],
                                             bulk_dq=grid[2], dq_before_dk=grid[3], staged_out=staged)
                if cfg not in mine:
                    mine.append(cfg)
            cfgs += mine
    return cfgs


def cfg_routes(cfg, routes):
    """The dQ routes a candidate runs: the wgmma backward's atomic one needs 64-query streamed tiles; ``bulk_dq``
    changes the atomic route only."""
    if is_wgmma(cfg) and (cfg.bulk_dq or cfg.dq_overlap or cfg.ds_mn_major or cfg.dk_last) and False in routes:
        return (False,)
    return (True,) if is_wgmma(cfg) and not W.takes_atomic(cfg) else routes


def launch_cfg(cfg, cdo, cq, ck, cv, o, lse, cdq, cdk, cdv, scale, causal, deterministic, check=True):
    """One backward by ``cfg`` (either family) on CuPy arrays."""
    if is_wgmma(cfg):
        W.launch_backward_wgmma(cfg, cdo, cq, ck, cv, o, lse, cdq, cdk, cdv, scale, causal, check=check,
                                deterministic=deterministic)
    else:
        T.launch_backward_tc(cfg, cdo, cq, ck, cv, o, lse, cdq, cdk, cdv, scale, causal, deterministic, check=check)


def run_cfg(cfg, q, k, v, do, o, lse, causal, deterministic, grads=None, check=True):
    """``launch_backward_tc`` with ``cfg`` on (B, H, N, D) torch tensors (o, lse: the forward's CuPy arrays).

    Returns dq, dk, dv as torch tensors: ``grads`` if given, else fresh ones poisoned with NaN.
    """
    if grads is None:
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    cq, ck, cv, cdo, cdq, cdk, cdv = (as_cupy(x) for x in (q, k, v, do, *grads))
    scale = 1 / math.sqrt(q.shape[-1])
    launch_cfg(cfg, cdo, cq, ck, cv, o, lse, cdq, cdk, cdv, scale, causal, deterministic, check=check)
    return grads


def kernel_info(dispatcher) -> dict:
    """Registers, local and static shared memory of a dispatcher's (first) compiled kernel."""
    kern = next(iter(dispatcher.overloads.values()), None)
    return {a: getattr(kern, a, None) for a in ("regs_per_thread", "local_mem_per_thread", "shared_mem_per_block")}


def compile_configs(log, cfgs, routes):
    """Compile each candidate by one small launch per route; ``[(cfg, info)]`` of those that compile and launch."""
    compiled = []
    for cfg in cfgs:
        dtype = next(dt for dt, kind in KIND.items() if kind == cfg.input_kind)
        x = torch.randn(1, 1, 64, cfg.head_dim, device=DEVICE, dtype=dtype)
        bf16 = dtype == torch.bfloat16
        o, lse = api.forward_arrays(as_cupy(x), as_cupy(x), as_cupy(x), bf16_bits=bf16)
        t0 = time.perf_counter()
        try:
            for det in cfg_routes(cfg, routes):
                run_cfg(cfg, x, x, x, x, o, lse, False, det)
            torch.cuda.synchronize()
        except Exception as e:  # a configuration that cannot compile or launch is reported, not fatal
            log(f"{tag(cfg)} D{cfg.head_dim} {cfg.input_kind}: {type(e).__name__}: {e}")
            continue
        info = {"compile_s": round(time.perf_counter() - t0, 1)}
        if is_wgmma(cfg):
            for name, kern in (("dkdv", W.dkdv_wgmma_kernel(cfg)), ("dq", W.dq_wgmma_kernel(cfg))):
                info[name] = {**kernel_info(kern), "dynamic_smem": W.shared_bytes(cfg, name)}
            if False in cfg_routes(cfg, routes):
                kern = W.dkdv_wgmma_kernel(cfg, True)
                info["dkdv_atomic"] = {**kernel_info(kern), "dynamic_smem": W.shared_bytes(cfg, "dkdv_atomic")}
            log(f"compiled {tag(cfg)} D{cfg.head_dim} {cfg.input_kind}: {json.dumps(info)}")
            compiled.append((cfg, info))
            continue
        for name, det in (("dkdv", True), ("dkdv_atomic", False)):
            if det in routes:
                info[name] = {**kernel_info(T.dkdv_tc_kernel(cfg, not det)), "dynamic_smem": T.shared_bytes(cfg, name)}
        if True in routes:
            info["dq"] = {**kernel_info(T.dq_tc_kernel(cfg)), "dynamic_smem": T.shared_bytes(cfg, "dq")}
        log(f"compiled {tag(cfg)} D{cfg.head_dim} {cfg.input_kind}: {json.dumps(info)}")
        compiled.append((cfg, info))
    return compiled


def check_configs(log, cfgs, routes, seed):
    """Each candidate (each dQ route) against float64 autograd, the flash-attn rule; returns those that pass.

    bhsd only (each layout is another compiled kernel; layouts are the default check's and the tests' job).
    """
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    failed, worst = set(), dict.fromkeys(cfgs, 0.0)
    for d, kind in dict.fromkeys((c.head_dim, c.input_kind) for c in cfgs):
        dtype = next(dt for dt, k in KIND.items() if k == kind)
        group = [c for c in cfgs if (c.head_dim, c.input_kind) == (d, kind)]
        for n_q, n_k, causal in SWEEP_CASES:
            q, k, v = (torch.randn(2, 3, n, d, device=DEVICE, dtype=dtype, generator=g) for n in (n_q, n_k, n_k))
            do = torch.randn(q.shape, device=DEVICE, dtype=dtype, generator=g)
            ref = ref_grads(q, k, v, do, causal, "bhsd", torch.float64)
            naive = ref_grads(q, k, v, do, causal, "bhsd", dtype)
            o, lse = api.forward_arrays(
                *(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=dtype == torch.bfloat16
            )
            for cfg in group:
                for det in cfg_routes(cfg, routes):
                    if cfg in failed:
                        continue
                    try:
                        out = run_cfg(cfg, q, k, v, do, o, lse, causal, det)
                    except Exception as e:
                        failed.add(cfg)
                        log(f"FAIL {tag(cfg)} D{d} {kind}: {type(e).__name__}: {e}")
                        continue
                    for name, x, r, nv in zip("q k v".split(), out, ref, naive, strict=True):
                        err = (x.double() - r).abs().max().item()
                        nerr = (nv.double() - r).abs().max().item()
                        worst[cfg] = max(worst[cfg], err / max(nerr, 1e-9))
                        if not (math.isfinite(err) and err <= 2 * nerr + 1e-4):
                            failed.add(cfg)
                            log(
                                f"FAIL {tag(cfg)} D{d} {kind} {n_q}x{n_k} causal={causal} det={det} d{name}: "
                                f"err {err:.2e} naive {nerr:.2e} {worst_element(x, r)} (seed {seed})"
                            )
    for cfg in cfgs:
        verdict = "FAILED, not timed" if cfg in failed else "ok"
        log(f"check {tag(cfg)} D{cfg.head_dim} {cfg.input_kind}: worst err/naive {worst[cfg]:.2f} {verdict}")
    return [c for c in cfgs if c not in failed]


def events_ms(fn, reps, inner=2, warmup=2):
    """Median over ``reps`` of the CUDA-event time of ``inner`` back-to-back calls, per call.

    One more call is queued before the first event, so the GPU is still busy with it while the host
    queues the timed ones: host time (argument checks, launches) does not count, for nbflash or SDPA.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def forward_shapes(dims, dtypes, cases):
    """``(dtype, d, n_q, n_k, causal)``: for each forward kernel (``api.plan_forward``'s configuration) that the
    ``(n_q, n_k, causal)`` cases take their O and lse from, the first case that runs it (on Hopper the picks change
    with the keys' length and with causal)."""
    plans = {}
    for d in dims:
        for dtype in dtypes:
            for n_q, n_k, causal in cases:
                q, k = (as_cupy(torch.empty(1, 1, n, d, device=DEVICE, dtype=dtype)) for n in (n_q, n_k))
                plan = api.plan_forward(d, KIND[dtype], 1 / math.sqrt(d), q, k, k, causal=causal)
                plans.setdefault((plan.backend, plan.config), (dtype, d, n_q, n_k, causal))
    return list(plans.values())


def warm_forward(dtype, d, n_q, n_k, causal):
    """One forward by a case's kernel (one batch, one head: the same kernel), compiled into the disk cache by a
    ``--jobs`` worker, so that the check or the timed run does not stop to compile it at its first case."""
    q, k = (as_cupy(torch.randn(1, 1, n, d, device=DEVICE, dtype=dtype)) for n in (n_q, n_k))
    api.forward_arrays(q, k, k, causal=causal, bf16_bits=dtype == torch.bfloat16)
    torch.cuda.synchronize()


def sweep_row(cfgs, dtype, d, causal, n, routes, reps):
    """TFLOP/s of SDPA's flash backward and of each candidate (each dQ route) on one shape."""
    b, h = max(1, TOKENS // n), WIDTH // d
    q, k, v, do = (torch.randn(b, h, n, d, device=DEVICE, dtype=dtype) for _ in range(4))
    fl = 2.5 * 4.0 * b * h * n * n * d / (2 if causal else 1)
    row = {"dtype": str(dtype).split(".")[-1], "D": d, "causal": causal, "N": n, "B": b, "H": h}
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
        ms = events_ms(lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True), reps)
    row["sdpa-flash"] = fl / ms / 1e9
    try:  # cuDNN's backward, where this PyTorch build has it
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            ms = events_ms(lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True), reps)
        row["sdpa-cudnn"] = fl / ms / 1e9
    except RuntimeError as e:
        row["sdpa-cudnn"] = f"{type(e).__name__}: {str(e)[:80]}"
    o_, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=dtype == torch.bfloat16)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    cq, ck, cv, cdo, cdq, cdk, cdv = (as_cupy(x) for x in (q, k, v, do, *grads))
    scale = 1 / math.sqrt(d)
    for cfg in cfgs:
        for det in cfg_routes(cfg, routes):

            def call(cfg=cfg, det=det):
                launch_cfg(cfg, cdo, cq, ck, cv, o_, lse, cdq, cdk, cdv, scale, causal, det, check=False)

            name = f"nb-{tag(cfg)}{'' if det else '-atomic'}"
            try:
                row[name] = fl / events_ms(call, reps) / 1e9
            except Exception as e:  # checked already, so unexpected: recorded, and the sweep goes on
                row[name] = f"{type(e).__name__}: {e}"
    return row


def summarize(log, results):
    """Per head dim and dtype: each candidate's geometric mean TFLOP/s and its range of ratios to SDPA flash (and to
    cuDNN, where every shape has it)."""
    for d, dt in dict.fromkeys((r["D"], r["dtype"]) for r in results):
        rows = [r for r in results if (r["D"], r["dtype"]) == (d, dt)]
        names = [k for k in rows[0] if k.startswith("nb-")]
        cudnn = all(isinstance(r.get("sdpa-cudnn"), float) for r in rows)
        log(f"summary D{d} {dt} ({len(rows)} shapes): geomean TFLOP/s, min-max ratio to sdpa-flash"
            + (", to sdpa-cudnn" if cudnn else ""))
        ranked = []
        for name in names:
            if not all(isinstance(r.get(name), float) for r in rows):
                log(f"  {name:<20} failed to run on some shape")
                continue
            tf = [r[name] for r in rows]
            ratios = [[r[name] / r[base] for r in rows] for base in ("sdpa-flash", "sdpa-cudnn")[:1 + cudnn]]
            ranked.append((math.exp(statistics.fmean(math.log(x) for x in tf)), name, ratios))
        for gm, name, ratios in sorted(ranked, reverse=True):
            log(f"  {name:<20} {gm:7.1f}   " + "   ".join(f"{min(r):.2f}-{max(r):.2f}" for r in ratios))


def sweep(args, log, env, save):
    """``--configs``: compile, check and time the candidates; ``save(data)`` after each step (a time limit
    that cuts the run short leaves the rows so far)."""
    start = time.perf_counter()
    dtypes = [DTYPES[s] for s in args.dtypes.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    routes = (True, False) if args.atomic else (True,)
    cfgs = parse_configs(args.configs, dims, [KIND[dt] for dt in dtypes], args.only)
    defaults = {
        f"D{c.head_dim} {c.input_kind}": tag(c)
        for c in cfgs
        if c == T.choose_config(c.head_dim, c.input_kind, simulator=False)
    }
    log("candidates: " + ", ".join(f"{tag(c)} D{c.head_dim} {c.input_kind}" for c in cfgs) + f"; defaults {defaults}")
    if args.jobs > 1:  # compile in parallel processes first: the on-disk kernel cache hands the kernels over
        codes = compile_in_processes(__file__, args.jobs)
        log(f"[{time.perf_counter() - start:.0f} s] compiled in {args.jobs} processes (exit codes {codes}); "
            f"disk cache {'on' if disk_cache_enabled() else 'OFF: compiled again below'}")
    compiled = compile_configs(log, cfgs, routes)
    log(f"[{time.perf_counter() - start:.0f} s] compiled {len(compiled)} of {len(cfgs)}")
    good = [c for c, _ in compiled]
    if not args.no_check:
        good = check_configs(log, good, routes, args.seed)
        log(f"[{time.perf_counter() - start:.0f} s] checked: {len(good)} pass")
    results = []

    def data():
        configs = [{"tag": tag(c), "cfg": str(c), "passed": c in good, **i} for c, i in compiled]
        return {"environment": env, "defaults": defaults, "configs": configs, "results": results}

    save(data())
    for d in dims:
        for dtype in dtypes:
            mine = [c for c in good if (c.head_dim, c.input_kind) == (d, KIND[dtype])]
            for causal in (False, True):
                for n in [int(x) for x in args.seqlens.split(",") if x]:
                    row = sweep_row(mine, dtype, d, causal, n, routes, args.reps)
                    results.append(row)
                    save(data())
                    log(
                        f"[{time.perf_counter() - start:.0f} s] "
                        + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
                    )
    summarize(log, results)
    return data()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--seed", type=int, help="the check's inputs (default: fresh, and logged so a failure replays)")
    ap.add_argument("--configs", help="tile sweep: these candidates by tag (e.g. 64x64r,128x128r,64x128@128)")
    ap.add_argument("--atomic", action="store_true", help="tile sweep: time the atomic dQ route too")
    ap.add_argument("--only", action="store_true", help="tile sweep: the candidates only, not the mma.sync default")
    ap.add_argument("--reps", type=int, default=20, help="tile sweep: timed repetitions per candidate and shape")
    ap.add_argument("--suffix", default="", help="appended to the JSON's file name")
    ap.add_argument("--no-simt", action="store_true", help="do not time the fp16/bf16 SIMT backward (slow)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="tile sweep: compile the candidates first in this many processes (through the disk cache)")
    ap.add_argument("--compile-part", help=argparse.SUPPRESS)  # i/n: compile every n-th candidate from i, and exit
    args = ap.parse_args()
    if args.seed is None:
        args.seed = int.from_bytes(os.urandom(4), "little")
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper: the wgmma backward too
        ROUTES.extend([(True, "wgmma"), (False, "wgmma")])
    dtypes = [DTYPES[s] for s in args.dtypes.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    if args.configs:
        try:
            parse_configs(args.configs, dims, [KIND[dt] for dt in dtypes], args.only)
        except ValueError as e:
            ap.error(str(e))
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    if args.compile_part:  # a --jobs worker: its share of the candidates, both routes, into the disk cache
        i, n = (int(x) for x in args.compile_part.split("/"))
        cfgs = parse_configs(args.configs, dims, [KIND[dt] for dt in dtypes], args.only)
        compile_configs(log, cfgs[i::n], (True, False) if args.atomic else (True,))
        # ... and its share of the forward kernels the timed shapes take their O and lse from (after the candidates:
        # the shares go round the parts from where the candidates stopped)
        timed = [(n, n, causal) for n in (int(x) for x in args.seqlens.split(",") if x) for causal in (False, True)]
        shapes = forward_shapes(dims, dtypes, ([] if args.no_check else SWEEP_CASES) + timed)
        for shape in shapes[(i - len(cfgs)) % n::n]:
            warm_forward(*shape)
        return
    env = environment()
    if not args.no_check:
        log(f"check seed {args.seed} (--seed replays it)")
    if args.configs:
        data = sweep(args, log, env, lambda data: write(args, data, None, lines))
        write(args, data, log, lines)
        return
    if not args.no_check:
        log(f"correctness failures: {check(log, dims, dtypes, args.seed)}")
    results = []
    for d in dims:
        for dtype in dtypes:
            for causal in (False, True):
                for n in [int(x) for x in args.seqlens.split(",") if x]:
                    b, h = max(1, TOKENS // n), WIDTH // d
                    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
                    fl = 2.5 * 4.0 * b * h * n * n * d / (2 if causal else 1)
                    row = {"dtype": str(dtype).split(".")[-1], "D": d, "causal": causal, "N": n}
                    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        ms = cuda_time_ms(lambda i: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True), 1)
                    row["sdpa-flash"] = fl / ms / 1e9
                    try:  # cuDNN's backward (Hopper's fastest), where this PyTorch build has it
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                            ms = cuda_time_ms(
                                lambda i: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True), 1
                            )
                        row["sdpa-cudnn"] = fl / ms / 1e9
                    except RuntimeError as e:
                        row["sdpa-cudnn"] = f"{type(e).__name__}: {str(e)[:80]}"
                    bf16 = dtype == torch.bfloat16
                    cq, ck, cv, cdo = (as_cupy(x) for x in (q, k, v, do))
                    o_, lse = api.forward_arrays(cq, ck, cv, causal=causal, bf16_bits=bf16)
                    routes = [("nb-tc", False, "tensor_core"), ("nb-tc-det", True, "tensor_core")]
                    if (True, "wgmma") in ROUTES:
                        routes += [("nb-wgmma", True, "wgmma"), ("nb-wgmma-atomic", False, "wgmma")]
                    routes += [("nb-auto", None, "auto")]  # what a call with no options runs (deterministic=None)
                    routes += [] if args.no_simt else [("nb-simt", False, "simt")]
                    for name, det, backend in routes:

                        def run(i, det=det, backend=backend):
                            return api.backward_arrays(
                                cdo,
                                cq,
                                ck,
                                cv,
                                o_,
                                lse,
                                causal=causal,
                                bf16_bits=bf16,
                                deterministic=det,
                                backend=backend,
                            )

                        ms = cuda_time_ms(run, 1, reps=10 if backend == "simt" else 30)
                        row[name] = fl / ms / 1e9
                    results.append(row)
                    log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    write(args, {"environment": env, "results": results}, log, lines)


def write(args, data, log, lines):
    """``<out>/tc-backward-<device>-<date><suffix>.json``, with the log; says so if ``log``."""
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name().replace(" ", "-")
    path = os.path.join(args.out, f"tc-backward-{dev}-{datetime.date.today()}{args.suffix}.json")
    with open(path, "w") as f:
        json.dump({**data, "log": lines}, f, indent=1)
    if log:
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
