"""fp32 SIMT kernels on the GPU: correctness at real sizes, a tile-configuration sweep, and the comparison.

Run on a CUDA machine (it needs CuPy and PyTorch)::

    python benchmarks/forward_sweep.py --out benchmarks/results

1. checks nbflash.attention against a float64 PyTorch reference (fresh random
   inputs, outputs poisoned before the run) over odd sizes, causal and not;
2. times candidate tile configurations of the fp32 SIMT kernel (``--sweep``);
3. times the chosen configuration against SDPA's efficient and math backends
   (fp32) and a naive CuPy attention at batch·N = 16k, heads·D = 2048,
   N = 512 … 16k, D = 64 and 128, causal and not, with peak extra memory.

Times are medians of CUDA-event timings after warm-up; FLOPs = 4·B·H·N²·D
(halved for causal).  Results go to ``<out>/forward-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nbflash  # noqa: E402
from nbflash._tiles import TileConfig, pad_head_dim  # noqa: E402
from nbflash.forward import forward_kernel, launch_forward, shared_bytes  # noqa: E402


def cuda_time_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def flops(b, h, n, d, causal):
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def ref64(q, k, v, causal):
    """float64 reference on the GPU (bottom-right causal)."""
    q, k, v = (torch.as_tensor(x).double() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def naive_cupy(q, k, v, causal):
    """matmul → softmax → matmul, materialising the N×N matrices (the baseline FlashAttention beats)."""
    s = cp.matmul(q, k.swapaxes(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        mask = cp.arange(nk)[None, :] > cp.arange(nq)[:, None] + (nk - nq)
        s = cp.where(mask, -cp.inf, s)
    s = s - s.max(-1, keepdims=True)
    p = cp.exp(s)
    p /= p.sum(-1, keepdims=True)
    return cp.matmul(p, v)


def check_correctness(log):
    """nbflash vs float64 over odd sizes; returns rows of (shape, dtype, causal, max err, ok)."""
    rows = []
    cases = [
        (1, 3, 1, 1, 64, False, "float32", "bhsd"),
        (2, 3, 97, 97, 64, True, "float32", "bhsd"),
        (1, 4, 200, 333, 40, True, "float32", "bshd"),
        (1, 2, 333, 200, 128, True, "float32", "bhsd"),
        (2, 2, 1025, 1025, 128, False, "float32", "bshd"),
        (1, 2, 8192, 8192, 64, True, "float32", "bhsd"),
        (1, 2, 2048, 2048, 256, True, "float32", "bhsd"),
        (1, 2, 4096, 4096, 256, False, "float32", "bhsd"),
        (2, 2, 1000, 1000, 64, True, "float16", "bhsd"),
        (1, 2, 8192, 8192, 128, True, "float16", "bshd"),
        (1, 2, 300, 301, 96, True, "float64", "bhsd"),
        (1, 1, 129, 65, 256, False, "float64", "bshd"),
    ]
    for b, h, nq, nk, d, causal, dt, layout in cases:
        shape = (lambda n: (b, h, n, d)) if layout == "bhsd" else (lambda n: (b, n, h, d))
        q = cp.random.standard_normal(shape(nq)).astype(dt)
        k = cp.random.standard_normal(shape(nk)).astype(dt)
        v = cp.random.standard_normal(shape(nk)).astype(dt)
        q_copy = q.copy()
        o = nbflash.attention(q, k, v, causal=causal, layout=layout)
        canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
        ref = ref64(canon(q), canon(k), canon(v), causal)
        err = float((torch.as_tensor(canon(o)).double() - ref).abs().max())
        # the flash-attn rule for low precision: at most 2x a naive same-precision attention's error
        if dt == "float16":
            qt, kt, vt = (torch.as_tensor(canon(x)) for x in (q, k, v))
            nq_, nk_ = qt.shape[2], kt.shape[2]
            mask = None
            if causal:
                i = torch.arange(nq_, device="cuda")[:, None]
                j = torch.arange(nk_, device="cuda")[None, :]
                mask = j <= i + nk_ - nq_
            with sdpa_kernel(SDPBackend.MATH):
                naive = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
            bound = 2 * float((naive.double() - ref).abs().max()) + 1e-5
        else:
            bound = {"float32": 2e-5, "float64": 1e-12}[dt]
        ok = err <= bound and bool(cp.array_equal(q, q_copy)) and bool(cp.isfinite(o).all())
        rows.append(dict(shape=[b, h, nq, nk, d], causal=causal, dtype=dt, layout=layout, max_err=err, bound=bound,
                         ok=ok))
        log(f"check {dt:8s} B={b} H={h} Nq={nq} Nk={nk} D={d} causal={causal} {layout}: err {err:.2e} "
            f"(bound {bound:.1e}) {'OK' if ok else 'FAIL'}")
    return rows


def sweep_configs(log, n=4096):
    """Time candidate fp32 tile configurations at N = n."""
    rows = []
    for d in (64, 128):
        b, h = 16384 // n, 2048 // d
        q, k, v = (cp.random.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(3))
        o = cp.empty_like(q)
        lse = cp.empty((b, h, n), cp.float32)
        ref = nbflash.attention(q[:1, :2], k[:1, :2], v[:1, :2])
        for bm, bn, tx, ty, mb in [(128, 64, 16, 16, 0), (128, 64, 16, 16, 2), (64, 64, 16, 8, 2),
                                   (64, 64, 16, 8, 3), (128, 32, 8, 16, 0), (128, 32, 8, 16, 2),
                                   (64, 64, 8, 16, 2), (128, 128, 16, 16, 0), (64, 32, 16, 8, 4)]:
            cfg = TileConfig(bm, bn, pad_head_dim(d, tx), tx, ty, "float32", min_blocks=mb)
            if shared_bytes(cfg) > 227 * 1024 or (bm // ty) * (pad_head_dim(d, tx) // tx) > 128:
                continue
            for causal in (False, True):
                try:
                    t0 = time.perf_counter()
                    launch_forward(cfg, q, k, v, o, lse, 1 / math.sqrt(d), causal)
                    cp.cuda.Device().synchronize()
                    compile_s = time.perf_counter() - t0
                    err = float(cp.abs(o[:1, :2] - ref).max()) if not causal else 0.0
                    ms = cuda_time_ms(lambda: launch_forward(cfg, q, k, v, o, lse, 1 / math.sqrt(d), causal), reps=10)
                except Exception as exc:  # report, keep sweeping
                    log(f"sweep D={d} {cfg}: {type(exc).__name__}: {exc}")
                    continue
                kern = forward_kernel(cfg)
                regs = [ov.regs_per_thread for ov in kern.overloads.values()]
                local = [ov.local_mem_per_thread for ov in kern.overloads.values()]
                tf = flops(b, h, n, d, causal) / ms / 1e9
                rows.append(dict(d=d, n=n, causal=causal, block_m=bm, block_n=bn, threads_x=tx, threads_y=ty,
                                 min_blocks=mb, ms=ms, tflops=tf, regs=regs, local_bytes=local, smem=shared_bytes(cfg),
                                 compile_s=compile_s, err=err))
                log(f"sweep D={d:3d} causal={causal!s:5} BM={bm:3d} BN={bn:3d} T={tx}x{ty} minb={mb}: {ms:8.3f} ms "
                    f"{tf:6.2f} TFLOP/s regs={regs} local={local} smem={shared_bytes(cfg)} err={err:.1e}")
    return rows


def sweep_backward_configs(log, n=4096):
    """Time candidate fp32 backward tilings (dK/dV keys × queries, dQ queries × keys) at N = n."""
    from nbflash import backward as bw

    rows = []
    candidates = {  # (dK/dV: keys, queries, tx, ty), (dQ: queries, keys, tx, ty)
        64: [((64, 32, 16, 8), (64, 32, 16, 8)), ((64, 64, 16, 16), (128, 32, 16, 16)),
             ((64, 32, 8, 16), (128, 32, 8, 16)), ((128, 32, 16, 16), (64, 64, 16, 8))],
        128: [((32, 32, 16, 8), (64, 32, 16, 8)), ((64, 32, 16, 16), (128, 32, 16, 16)),
              ((64, 64, 16, 16), (64, 32, 16, 8)), ((32, 64, 16, 8), (128, 32, 16, 16)),
              ((64, 32, 8, 16), (64, 32, 8, 8))],
    }
    for d, cands in candidates.items():
        b, h = 16384 // n, 2048 // d
        q, k, v, do = (cp.random.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = nbflash.attention(q, k, v, return_lse=True)
        dq, dk, dv = (cp.empty_like(q) for _ in range(3))
        for (kk, kq, ktx, kty), (qq, qk, qtx, qty) in cands:
            cfg = bw.BackwardConfig(
                dkdv=TileConfig(kq, kk, pad_head_dim(d, ktx), ktx, kty, "float32"),
                dq=TileConfig(qq, qk, pad_head_dim(d, qtx), qtx, qty, "float32"))
            for det in (False, True):
                for causal in (False, True):
                    def run(cfg=cfg, det=det, causal=causal):
                        bw.launch_backward(cfg, q, k, v, o, do, lse, dq, dk, dv, 1 / math.sqrt(d), causal,
                                           deterministic=det)
                    try:
                        run()
                        ms = cuda_time_ms(run, reps=5)
                    except Exception as exc:
                        log(f"bwd sweep D={d} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                        break
                    tf = 2.5 * flops(b, h, n, d, causal) / ms / 1e9
                    rows.append(dict(d=d, n=n, causal=causal, deterministic=det, dkdv=[kk, kq, ktx, kty],
                                     dq=[qq, qk, qtx, qty], ms=ms, tflops=tf))
                    log(f"bwd sweep D={d:3d} det={det!s:5} causal={causal!s:5} dKdV {kk}x{kq} T={ktx}x{kty} "
                        f"dQ {qq}x{qk} T={qtx}x{qty}: {ms:8.3f} ms {tf:6.2f} TFLOP/s")
    return rows


def compare(log, seqlens, dims):
    """nbflash (fp32) vs SDPA efficient / math fp32 and naive CuPy; time and peak extra memory."""
    rows = []
    pool = cp.get_default_memory_pool()
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                b, h = max(16384 // n, 1), 2048 // d
                tq, tk, tv = (torch.randn(b, h, n, d, device="cuda") for _ in range(3))
                q, k, v = (cp.from_dlpack(t) for t in (tq, tk, tv))
                f = flops(b, h, n, d, causal)
                row = dict(d=d, n=n, b=b, h=h, causal=causal)
                # nbflash
                nbflash.attention(q, k, v, causal=causal)
                cp.cuda.Device().synchronize()
                pool.free_all_blocks()
                base = pool.total_bytes()
                nbflash.attention(q, k, v, causal=causal)
                cp.cuda.Device().synchronize()
                row["nbflash_mem"] = pool.total_bytes() - base
                ms = cuda_time_ms(lambda: nbflash.attention(q, k, v, causal=causal))
                row["nbflash_ms"], row["nbflash_tflops"] = ms, f / ms / 1e9
                # SDPA backends (fp32)
                for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
                    try:
                        with sdpa_kernel(be):
                            fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            before = torch.cuda.memory_allocated()
                            fn()
                            torch.cuda.synchronize()
                            row[f"{name}_mem"] = torch.cuda.max_memory_allocated() - before
                            ms = cuda_time_ms(fn, reps=10)
                        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, f / ms / 1e9
                    except Exception as exc:
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                        torch.cuda.empty_cache()
                # naive CuPy (materialises N^2)
                try:
                    pool.free_all_blocks()
                    base = pool.total_bytes()
                    naive_cupy(q, k, v, causal)
                    cp.cuda.Device().synchronize()
                    row["naive_mem"] = pool.total_bytes() - base
                    ms = cuda_time_ms(lambda: naive_cupy(q, k, v, causal), reps=5)
                    row["naive_ms"], row["naive_tflops"] = ms, f / ms / 1e9
                except Exception as exc:
                    row["naive_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                pool.free_all_blocks()
                rows.append(row)

                def g(key):
                    return f"{row[key]:7.2f}" if key in row else "    n/a"

                log(f"D={d:3d} causal={causal!s:5} N={n:5d}: nbflash {g('nbflash_tflops')} | efficient "
                    f"{g('efficient_tflops')} | math {g('math_tflops')} | naive {g('naive_tflops')} TFLOP/s; "
                    f"mem MB nbflash {row['nbflash_mem'] / 2**20:.0f} efficient "
                    f"{row.get('efficient_mem', 0) / 2**20:.0f} math {row.get('math_mem', 0) / 2**20:.0f} "
                    f"naive {row.get('naive_mem', 0) / 2**20:.0f}")
    return rows


def compare_backward(log, seqlens, dims):
    """Backward: nbflash (deterministic dQ pass and atomic dQ) vs SDPA efficient / math fp32 backward."""
    rows = []
    pool = cp.get_default_memory_pool()
    for d in dims:
        for causal in (False, True):
            for n in seqlens:
                b, h = max(16384 // n, 1), 2048 // d
                tq, tk, tv, tdo = (torch.randn(b, h, n, d, device="cuda") for _ in range(4))
                q, k, v, do = (cp.from_dlpack(t) for t in (tq, tk, tv, tdo))
                f = 2.5 * flops(b, h, n, d, causal)
                row = dict(d=d, n=n, b=b, h=h, causal=causal)
                o, lse = nbflash.attention(q, k, v, causal=causal, return_lse=True)
                for name, det in (("nbflash_det", True), ("nbflash_atomic", False)):
                    nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det)
                    cp.cuda.Device().synchronize()
                    pool.free_all_blocks()
                    base = pool.total_bytes()
                    nbflash.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det)
                    cp.cuda.Device().synchronize()
                    row[f"{name}_mem"] = pool.total_bytes() - base
                    ms = cuda_time_ms(lambda det=det: nbflash.attention_backward(
                        do, q, k, v, o, lse, causal=causal, deterministic=det), reps=10)
                    row[f"{name}_ms"], row[f"{name}_tflops"] = ms, f / ms / 1e9
                for name, be in (("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
                    try:
                        xq, xk, xv = (t.clone().requires_grad_() for t in (tq, tk, tv))
                        with sdpa_kernel(be):
                            out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=causal)
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()

                        def bwd(out=out, xq=xq, xk=xk, xv=xv):
                            return torch.autograd.grad(out, (xq, xk, xv), tdo, retain_graph=True)

                        bwd()
                        torch.cuda.synchronize()
                        row[f"{name}_mem"] = torch.cuda.max_memory_allocated() - before
                        ms = cuda_time_ms(bwd, reps=10)
                        row[f"{name}_ms"], row[f"{name}_tflops"] = ms, f / ms / 1e9
                        del out, xq, xk, xv
                    except Exception as exc:
                        row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                    torch.cuda.empty_cache()
                pool.free_all_blocks()
                rows.append(row)

                def g(key):
                    return f"{row[key]:7.2f}" if key in row else "    n/a"

                log(f"BWD D={d:3d} causal={causal!s:5} N={n:5d}: nbflash det {g('nbflash_det_tflops')} | atomic "
                    f"{g('nbflash_atomic_tflops')} | efficient {g('efficient_tflops')} | math {g('math_tflops')} "
                    f"TFLOP/s; mem MB det {row['nbflash_det_mem'] / 2**20:.0f} atomic "
                    f"{row['nbflash_atomic_mem'] / 2**20:.0f} efficient {row.get('efficient_mem', 0) / 2**20:.0f} "
                    f"math {row.get('math_mem', 0) / 2**20:.0f}")
    return rows


def environment():
    dev = cp.cuda.runtime.getDeviceProperties(0)
    # The device copy of the tree may have no git metadata: then NBFLASH_COMMIT says which commit it is.
    commit = os.environ.get("NBFLASH_COMMIT", "")
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
            commit = out if len(out) == 40 else ""
        except OSError:
            pass
    import numba_cuda

    try:  # what links the kernels (link-time optimisation) and runs ptxas on them
        from cuda.bindings import nvjitlink

        linker = ".".join(map(str, nvjitlink.version()))
    except Exception:  # absent or unloadable: say so rather than fail the benchmark
        linker = "unavailable"
    return dict(
        device=dev["name"].decode(),
        cc=f"{dev['major']}.{dev['minor']}",
        driver=cp.cuda.runtime.driverGetVersion(),
        python=platform.python_version(),
        numba_cuda=getattr(numba_cuda, "__version__", "?"),
        cupy=cp.__version__,
        torch=torch.__version__,
        numpy=np.__version__,
        nvjitlink=linker,
        commit=commit or "unknown",
        date=datetime.date.today().isoformat(),
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time candidate forward tilings")
    ap.add_argument("--bwd-sweep", action="store_true", help="time candidate backward tilings")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--backward", action="store_true", help="also time the backward pass")
    ap.add_argument("--no-forward", action="store_true", help="skip the forward comparison")
    args = ap.parse_args()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    env = environment()
    log(json.dumps(env))
    result = dict(environment=env)
    if not args.no_check:
        result["checks"] = check_correctness(log)
    if args.sweep:
        result["sweep"] = sweep_configs(log)
    if args.bwd_sweep:
        result["backward_sweep"] = sweep_backward_configs(log)
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    dims = [int(x) for x in args.dims.split(",")]
    if seqlens and not args.no_forward:
        result["compare"] = compare(log, seqlens, dims)
    if seqlens and args.backward:
        result["compare_backward"] = compare_backward(log, seqlens, dims)
    os.makedirs(args.out, exist_ok=True)
    name = env["device"].replace(" ", "-")
    path = os.path.join(args.out, f"forward-{name}-{env['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
