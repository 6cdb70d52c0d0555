"""Where the host time of a tiny nbflash call goes: cProfile of each public route (issue 4).

    python benchmarks/profile_host.py [--calls 2000] [--top 25]      # on a CUDA GPU (CuPy and PyTorch)

At B=1, H=1, N=16, D=64 a call is all host time.  For each route (CuPy
forward, CuPy backward, torch forward, torch forward+backward; fp16 and fp32)
this prints the wall time per call without the profiler, then the functions
with the most own time under cProfile (which inflates small functions, so
read it for where, not how much).  Also times the driver launch itself two
ways: through ``cuda.bindings`` (what :mod:`nbflash._launch` uses) and through
``ctypes`` straight into ``libcuda``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, H, N, D = 1, 1, 16, 64


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(200):
        fn()
    sync()
    t = time.perf_counter()
    for i in range(calls):
        fn()
        if i % 128 == 127:
            sync()
    sync()
    return (time.perf_counter() - t) / calls * 1e6


def profile(name: str, fn, calls: int, top: int, sync) -> None:
    us = per_call_us(fn, calls, sync)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 128 == 127:
            sync()
    prof.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    body = buf.getvalue()
    body = body[body.find("ncalls") :]
    print(f"\n=== {name}: {us:.1f} us/call without the profiler ===\n{body}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)

    import cupy as cp
    import numpy as np
    import torch

    import nbflash
    import nbflash.torch as nbt

    csync = cp.cuda.runtime.deviceSynchronize
    tsync = torch.cuda.synchronize
    for dtype in ("float16", "float32"):
        q, k, v, do = (cp.random.standard_normal((B, H, N, D), dtype=np.float32).astype(dtype) for _ in range(4))
        o, lse = nbflash.attention(q, k, v, return_lse=True)
        profile(f"cupy forward {dtype}", lambda: nbflash.attention(q, k, v), args.calls, args.top, csync)
        profile(
            f"cupy backward {dtype}",
            lambda: nbflash.attention_backward(do, q, k, v, o, lse),
            args.calls // 2,
            args.top,
            csync,
        )
        tq, tk, tv = (torch.randn(B, H, N, D, device="cuda", dtype=getattr(torch, dtype)) for _ in range(3))
        gq, gk, gv = (x.clone().requires_grad_() for x in (tq, tk, tv))
        tdo = torch.randn_like(tq)
        profile(f"torch forward {dtype}", lambda: nbt.attention(tq, tk, tv), args.calls, args.top, tsync)
        profile(
            f"torch fwd+bwd {dtype}",
            lambda: torch.autograd.grad(nbt.attention(gq, gk, gv), (gq, gk, gv), tdo),
            args.calls // 2,
            args.top,
            tsync,
        )

    # The driver call alone: cuda.bindings versus ctypes, on a prepared forward launcher.
    import ctypes

    from nbflash import _launch, forward

    q, k, v = (cp.random.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))
    cfg = forward.choose_config(D, "float32")
    kern = forward.forward_kernel(cfg)
    o, lse, trace = cp.empty_like(q), cp.empty((B, H, N), np.float32), cp.zeros((1, 1, 1, 1, 2), np.float32)
    grid, block, nbytes = (-(-N // cfg.block_m), H, B), (cfg.threads_x, cfg.threads_y, 1), forward.shared_bytes(cfg)
    a = (q, k, v, o, lse, 0.18, False, trace)
    assert _launch.launch(kern, grid, block, 0, nbytes, a)
    key, values = _launch._flatten(a)
    lz = _launch.launcher(kern, key)
    dev = _launch.current_device()
    func = lz.devices[dev][0]
    print(f"\nlaunch parts: flatten {per_call_us(lambda: _launch._flatten(a), args.calls, csync):.2f} us")
    bound = per_call_us(lambda: lz(grid, block, 0, nbytes, values, dev), args.calls, csync)
    print(f"prepared launcher (cuda.bindings) {bound:.2f} us")
    lib = ctypes.CDLL("libcuda.so.1")
    f = lib.cuLaunchKernel
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    fptr = int(func)
    extra = ctypes.addressof(lz._extra)

    def raw():
        lz.struct.pack_into(lz.buffer, 0, *values)
        err = f(fptr, grid[0], grid[1], grid[2], block[0], block[1], block[2], nbytes, None, None, extra)
        assert err == 0, err

    print(f"prepared launcher (ctypes libcuda) {per_call_us(raw, args.calls, csync):.2f} us")
    ref = o.copy()
    o.fill(np.nan)
    raw()
    csync()
    print("ctypes launch equals the fast launch:", bool(cp.array_equal(o, ref)))


if __name__ == "__main__":
    main()
