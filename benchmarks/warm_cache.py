"""Compile nbflash's GPU kernels into Numba's on-disk cache in parallel processes, before a benchmark runs.

A fresh GPU machine has an empty cache, and each tensor-core kernel takes 20–40 s to compile, one after
another in a benchmark's process.  This script runs one tiny call per combination asked for, each in a
worker process of a pool, so the kernels compile side by side; a benchmark started afterwards with the same
``NUMBA_CACHE_DIR`` loads them from the disk (their signatures do not depend on the sizes)::

    NUMBA_CACHE_DIR=/tmp/nbcache python benchmarks/warm_cache.py --dtypes bf16,fp16 --dims 64,128 \\
        --backends tensor_core,wgmma --jobs 12

Each combination is (dtype, head dim, backend, dQ route, layout): the forward and the backward through the
PyTorch bridge's custom ops, at B = 1, N = 200 (a ragged tile) and causal, so that every kernel of the
call runs once; ``--routes`` picks the backward's dQ routes (``default``: the API's choice, ``deterministic``:
under ``torch.use_deterministic_algorithms``).  ``--layouts bshd`` compiles the kernels of strided
``(B, N, H, D)`` arrays (H = 2: the kernels see non-contiguous views, another Numba array type than bhsd's
contiguous ones), which ``sanitize_tc.py`` runs::

    NUMBA_CACHE_DIR=/tmp/nbcache python benchmarks/warm_cache.py --dtypes fp16 --dims 40,64,96,128 \
        --backends wgmma --routes default,deterministic --layouts bshd --jobs 8

The report is one line per combination: its seconds and whether it ran.  Needs PyTorch on a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import multiprocessing
import os
import sys
import time

DTYPES = ("bf16", "fp16")


def warm(job: tuple[str, int, str, str, str]) -> tuple[tuple, float, str]:
    """Run one forward and one backward of ``job`` = (dtype, head dim, backend, route, layout); (job, seconds,
    error)."""
    dtype_name, d, backend, route, layout = job
    t0 = time.perf_counter()
    try:
        import torch

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import nbflash.torch as nbt

        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        shape = (1, 1, 200, d) if layout == "bhsd" else (1, 200, 2, d)
        q, k, v, do = (torch.randn(*shape, device="cuda", dtype=dtype) for _ in range(4))
        torch.use_deterministic_algorithms(route == "deterministic", warn_only=True)
        o, lse = nbt.attention_fwd(q, k, v, True, None, layout, backend)
        nbt.attention_bwd(do, q, k, v, o, lse, True, None, layout, backend)
        torch.cuda.synchronize()
    except Exception as e:  # reported, not fatal: the benchmark then compiles (or fails) on its own
        return job, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return job, time.perf_counter() - t0, ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--backends", default="tensor_core", help="comma list of nbflash backends (tensor_core, wgmma)")
    ap.add_argument("--routes", default="default", help="comma list of dQ routes: default, deterministic")
    ap.add_argument("--layouts", default="bhsd", help="comma list of layouts: bhsd (contiguous), bshd (strided views)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    if not os.environ.get("NUMBA_CACHE_DIR"):
        print("warning: NUMBA_CACHE_DIR is not set; the cache goes next to the sources", file=sys.stderr)
    dtypes = args.dtypes.split(",")
    if set(dtypes) - set(DTYPES):
        ap.error(f"--dtypes: one of {DTYPES}, got {args.dtypes}")
    layouts = args.layouts.split(",")
    if set(layouts) - {"bhsd", "bshd"}:
        ap.error(f"--layouts: bhsd or bshd, got {args.layouts}")
    jobs = list(itertools.product(dtypes, [int(x) for x in args.dims.split(",")], args.backends.split(","),
                                  args.routes.split(","), layouts))
    t0 = time.perf_counter()
    # spawn: every worker starts its own CUDA context (a forked one cannot)
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        failed = 0
        for (dtype, d, backend, route, layout), seconds, error in pool.map(warm, jobs):
            failed += bool(error)
            print(f"{dtype} D={d} {backend} {route} {layout}: {seconds:.0f} s{' ' + error if error else ''}",
                  flush=True)
    print(f"warmed {len(jobs) - failed} of {len(jobs)} in {time.perf_counter() - t0:.0f} s ({args.jobs} processes)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
