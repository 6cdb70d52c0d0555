"""Where the backward's time goes, kernel by kernel: nbflash's tensor-core backward beside SDPA's (flash, cuDNN).

Run on a CUDA machine (CuPy and PyTorch needed)::

    python benchmarks/bwd_kernels.py --dims 64 128 --seqlens 1024 2048 4096 --out benchmarks/results

For each head dim, sequence length (batch·N = 16k, heads·D = 2048, bf16 or ``--dtype fp16``) and causal
flag, both backwards run ``--reps`` times under ``torch.profiler`` (CUPTI records every kernel of the process,
Numba's launches included), after a warm-up.  The table gives each kernel's mean time per backward call, its
share of the call, and the sum; the kernels run back to back on one stream, so the sum is the call's GPU time less the
gaps between launches.  ``--deterministic`` adds nbflash's deterministic dQ route, ``--wgmma`` its Hopper
backward (``--no-tensor-core``: without the ``mma.sync`` one), ``--cudnn`` SDPA's cuDNN backward (its kernels:
the main one, and any other by name, e.g. what it runs before and after).  Results go to
``<out>/bwd-kernels-<device>-<date><suffix>.json`` (rewritten after every shape) as well as to the screen.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward_sweep import environment  # noqa: E402
from benchmarks.tc_sweep import as_cupy  # noqa: E402
from nbflash import api  # noqa: E402

TOKENS, WIDTH = 16384, 2048

#: SDPA's kernels by a key word of their (templated) names; nbflash's by their Python names.
SDPA_KERNELS = [
    (re.compile(r"dot_do_o"), "sdpa: dot(dO, O) + clear dQ accumulator"),
    (re.compile(r"convert_dq"), "sdpa: convert dQ"),
    (re.compile(r"dq_dk_dv|dk_dv|bwd"), "sdpa: dK, dV (+ atomic dQ)"),
]
#: cuDNN's generated kernels (``--cudnn``): the main one by its kind, any other by the start of its name.
CUDNN_MAIN = re.compile(r"cudnn.*bprop")


def short_name(name: str) -> str:
    m = re.search(r"flash_backward_[a-z0-9_]*[a-z]", name)
    if m:
        return "nbflash: " + m.group(0).removeprefix("flash_backward_")
    if "cudnn" in name:
        return "cudnn: bprop (dQ, dK, dV)" if CUDNN_MAIN.search(name) else "cudnn: " + name[:52]
    for pattern, label in SDPA_KERNELS:
        if pattern.search(name):
            return label
    return name[:60]


def kernel_times(fn, reps: int) -> tuple[dict[str, float], float]:
    """``({kernel: mean µs per call}, mean µs of the call by CUDA events)`` over ``reps`` calls of ``fn``."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            totals[short_name(ev.name)] += ev.device_time_total
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return {k: t / reps for k, t in totals.items()}, start.elapsed_time(end) * 1e3 / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--deterministic", action="store_true", help="also nbflash's deterministic dQ route")
    ap.add_argument("--wgmma", action="store_true", help="also nbflash's wgmma backward")
    ap.add_argument("--no-tensor-core", action="store_true", help="without nbflash's mma.sync backward")
    ap.add_argument("--cudnn", action="store_true", help="also SDPA's cuDNN backward (sm_80+, recent PyTorch)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    bf16 = dtype == torch.bfloat16
    env = environment()
    print(json.dumps(env))
    results = []
    for d in args.dims:
        for n in args.seqlens:
            for causal in causals:
                b, h = TOKENS // n, WIDTH // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
                cq, ck, cv, cdo = (as_cupy(x) for x in (q, k, v, do))
                o, lse = api.forward_arrays(cq, ck, cv, causal=causal, bf16_bits=bf16, backend="tensor_core")
                routes = {} if args.no_tensor_core else {"nbflash tensor_core": dict(backend="tensor_core")}
                if args.deterministic:
                    routes["nbflash tensor_core deterministic"] = dict(backend="tensor_core", deterministic=True)
                if args.wgmma:
                    routes["nbflash wgmma"] = dict(backend="wgmma")

                def nb(kw):
                    return lambda: api.backward_arrays(cdo, cq, ck, cv, o, lse, causal=causal, bf16_bits=bf16, **kw)

                def sdpa(backend):
                    """SDPA's backward by ``backend`` (its forward's graph kept: each call runs the backward only)."""
                    with sdpa_kernel(backend):
                        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
                        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                    return lambda: torch.autograd.grad(out, (qq, kk, vv), do, retain_graph=True)

                peers = [("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION))]
                if args.cudnn:
                    peers.append(("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)))

                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                rows = []
                for route, fn in [*((r, nb(kw)) for r, kw in routes.items()), *peers]:
                    times, wall = kernel_times(fn, args.reps)
                    total = sum(times.values())
                    for kname, t in sorted(times.items(), key=lambda kv: -kv[1]):
                        rows.append([route, kname, f"{t:.1f}", f"{100 * t / total:.1f}"])
                    rows.append([route, "sum of kernels / events", f"{total:.1f} / {wall:.1f}",
                                 f"{flops / wall / 1e6:.0f} TFLOP/s"])
                    results.append(dict(dtype=args.dtype, head_dim=d, seqlen=n, causal=causal, batch=b, heads=h,
                                        route=route,
                                        kernels_us=times, sum_us=total, events_us=wall,
                                        tflops=flops / wall / 1e6))
                print(f"\nD={d} N={n} causal={causal} (batch {b}, heads {h}; µs per backward call)")
                print(tabulate(rows, headers=["route", "kernel", "µs", "% / TFLOP/s"]))
                if args.out:  # after every shape: a run cut short keeps what it measured
                    os.makedirs(args.out, exist_ok=True)
                    name = re.sub(r"\W+", "-", env.get("device", "gpu"))
                    path = os.path.join(args.out, f"bwd-kernels-{name}-{datetime.date.today()}{args.suffix}.json")
                    with open(path, "w") as f:
                        json.dump(dict(environment=env, results=results), f, indent=1)


if __name__ == "__main__":
    main()
