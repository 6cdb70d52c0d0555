"""Host overhead per call: nbflash's launch paths next to CuPy's and PyTorch's, at a tiny shape (issue 4).

    python benchmarks/overhead.py --out benchmarks/results          # on a CUDA GPU (CuPy and PyTorch)
    NBFLASH_COMMIT=$(git rev-parse --short HEAD) python benchmarks/overhead.py --out benchmarks/results

At B=1, H=1, N=16, D=64 the kernels take a few µs, so the time of a call is
its host time.  Each row is the median over ``--calls`` calls (after
``--warmup``), each call timed on its own with ``time.perf_counter_ns``:

* ``async`` — the call only (the GPU is synchronised every 128 calls, outside
  the timing, so the launch queue never fills);
* ``sync`` — the call and a synchronisation of its stream: host time plus
  GPU latency, what a caller waiting for the result sees.

The torch rows come in pairs, nbflash next to SDPA, timed in alternating
rounds (:func:`interleaved_us`) so that the ratio in the last column is not
at the mercy of the host's speed drifting between two rows.

Rows: a CuPy elementwise kernel (the floor for a Python-launched kernel);
Numba's dispatcher and nbflash's fast launcher (:mod:`nbflash._launch`) on the
same forward kernel and CuPy arrays — the whole :func:`~nbflash._launch.launch`
and its parts (describing the arguments; a prepared launcher's pack-and-launch,
through ``extra`` and through ``kernelParams``); ``nbflash.attention`` on CuPy
arrays (fp16, fp32), and ``nbflash.attention_backward``; ``nbflash.torch.attention`` forward and forward+backward;
PyTorch's ``scaled_dot_product_attention`` forward and forward+backward.

Also measured, each in a fresh process with its own empty ``NUMBA_CACHE_DIR``:
the first call of each route (compile + load) and the second, twice — *cold*
(the cache directory is empty: every kernel compiles) and *warm* (a second
process on the same directory: the kernels load from Numba's on-disk cache,
see ``nbflash/_device.py``), with the disk-cache hits and misses of each.

Checks (a failure is reported in the table and the JSON, and the exit status is 1):
the fast launch writes the same bits as the dispatcher's launch; a
``torch.cuda.graph`` capture of ``nbflash.torch.attention`` replays on new inputs
copied into its static inputs and matches a fresh call.

Output: a table in the terminal and ``<out>/overhead-<device>-<date>.json``
(device, versions, ``NBFLASH_COMMIT``, every row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

B, H, N, D = 1, 1, 16, 64


def median_us(fn, *, calls: int, warmup: int, sync=None) -> float:
    """Median host time of ``fn()`` in µs; with ``sync``, of ``fn(); sync()`` (one round of :func:`interleaved_us`)."""
    return interleaved_us({"fn": fn}, calls=calls, warmup=warmup, rounds=1, sync=sync)["fn"]


def _device_sync():
    import cupy as cp

    cp.cuda.runtime.deviceSynchronize()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name, mod in (
        ("numba-cuda", "numba_cuda"),
        ("numba", "numba"),
        ("cupy", "cupy"),
        ("torch", "torch"),
        ("cuda-bindings", "cuda.bindings"),
        ("numpy", "numpy"),
    ):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[name] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - report what is missing
            out[name] = f"missing ({type(e).__name__})"
    return out


# ----------------------------------------------------------------------------
# Timed rows
# ----------------------------------------------------------------------------


def rows_cupy_and_launch(calls: int, warmup: int) -> list[dict]:
    import cupy as cp

    import nbflash
    from nbflash import _device, _launch, forward

    rows = []
    sync = cp.cuda.get_current_stream().synchronize

    def row(name, fn, note=""):
        rows.append(
            dict(
                call=name,
                async_us=median_us(fn, calls=calls, warmup=warmup),
                sync_us=median_us(fn, calls=calls, warmup=warmup, sync=sync),
                note=note,
            )
        )

    x = cp.ones(1024, cp.float32)
    y = cp.empty_like(x)
    axpy = cp.ElementwiseKernel("float32 x", "float32 y", "y = 2 * x", "nbflash_overhead_axpy")
    row("cupy elementwise kernel (floor)", lambda: axpy(x, y))

    for dtype in (np.float16, np.float32):
        q, k, v = (cp.random.standard_normal((B, H, N, D), dtype=np.float32).astype(dtype) for _ in range(3))
        name = np.dtype(dtype).name
        row(f"nbflash.attention cupy {name}", lambda q=q, k=k, v=v: nbflash.attention(q, k, v))
        o_, lse_ = nbflash.attention(q, k, v, return_lse=True)
        row(
            f"nbflash.attention_backward cupy {name}",
            lambda q=q, k=k, v=v, o=o_, lse=lse_: nbflash.attention_backward(q, q, k, v, o, lse),
        )

        cfg = forward.choose_config(D, name)
        kern = forward.forward_kernel(cfg)
        o = cp.empty_like(q)
        lse = cp.empty((B, H, N), np.float32)
        trace = cp.zeros((1, 1, 1, 1, 2), np.float32)
        grid, block = (-(-N // cfg.block_m), H, B), (cfg.threads_x, cfg.threads_y, 1)
        nbytes = forward.shared_bytes(cfg)
        args = (q, k, v, o, lse, 0.18, False, trace)
        row(
            f"forward kernel, Numba dispatcher {name}",
            lambda a=args, kern=kern, g=grid, b=block, n=nbytes: _device.dispatcher_launch(kern, g, b, 0, n, *a),
        )
        row(
            f"forward kernel, fast launch {name}",
            lambda a=args, kern=kern, g=grid, b=block, n=nbytes: _launch.launch(kern, g, b, 0, n, a),
        )
        key, values = _launch._flatten(args)
        launcher = _launch.launcher(kern, key)
        dev = _launch.current_device()
        if name == "float32":
            rows.append(
                dict(
                    call="  part: describe 8 arguments (_flatten)",
                    async_us=median_us(lambda a=args: _launch._flatten(a), calls=calls, warmup=warmup),
                    sync_us=None,
                    note="host only",
                )
            )
            rows.append(
                dict(
                    call="  part: current device (cuCtxGetDevice)",
                    async_us=median_us(_launch.current_device, calls=calls, warmup=warmup),
                    sync_us=None,
                    note="host only",
                )
            )
            for via in ("extra", "params"):
                _launch.PARAMS_VIA = via
                row(
                    f"  part: prepared launcher, pack + cuLaunchKernel via {via}",
                    lambda lz=launcher, g=grid, b=block, n=nbytes, vals=values, dev=dev: lz(g, b, 0, n, vals, dev),
                )
            _launch.PARAMS_VIA = "extra"
    return rows


def interleaved_us(fns: dict, *, calls: int, warmup: int, rounds: int = 25, sync=None) -> dict:
    """Median host µs per call of each of ``fns`` (name -> callable), timed in alternating rounds.

    Each round times ``calls // rounds`` calls of every function in turn, so a
    change in the host's speed during the run (clock frequency, other
    processes) falls on every row alike and the ratios between rows stay
    honest; one row measured after another can differ by 2× on a noisy host.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _device_sync()
    times = {name: [] for name in fns}
    per_round = max(1, calls // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            ts = times[name]
            for i in range(per_round):
                t0 = time.perf_counter_ns()
                fn()
                if sync is not None:
                    sync()
                ts.append(time.perf_counter_ns() - t0)
                if sync is None and i % 128 == 127:
                    _device_sync()
            _device_sync()
    return {name: statistics.median(ts) / 1e3 for name, ts in times.items()}


def rows_torch(calls: int, warmup: int) -> list[dict]:
    """nbflash.torch next to SDPA, each pair timed interleaved (:func:`interleaved_us`), with the ratio."""
    import torch
    import torch.nn.functional as F

    import nbflash.torch as nbt

    rows = []
    sync = torch.cuda.current_stream().synchronize

    def pair(name, nb, sdpa, note=""):
        fns = {"nb": nb, "sdpa": sdpa}
        a = interleaved_us(fns, calls=calls, warmup=warmup)
        s = interleaved_us(fns, calls=calls, warmup=warmup, sync=sync)
        ratio = f"{a['nb'] / a['sdpa']:.2f}x SDPA"
        rows.append(dict(call=f"nbflash.torch.attention {name}", async_us=a["nb"], sync_us=s["nb"], note=ratio))
        rows.append(dict(call=f"sdpa {name}", async_us=a["sdpa"], sync_us=s["sdpa"], note=note))

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        do = torch.randn_like(q)
        pair(
            f"forward {name}",
            lambda q=q, k=k, v=v: nbt.attention(q, k, v),
            lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v),
            "inputs without grad (inference)",
        )
        pair(
            f"forward {name}, grad",
            lambda q=qg, k=kg, v=vg: nbt.attention(q, k, v),
            lambda q=qg, k=kg, v=vg: F.scaled_dot_product_attention(q, k, v),
            "inputs require grad (training forward, graph built)",
        )

        def nb_fb(q=qg, k=kg, v=vg, do=do):
            torch.autograd.grad(nbt.attention(q, k, v), (q, k, v), do)

        def sdpa_fb(q=qg, k=kg, v=vg, do=do):
            torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)

        pair(f"fwd+bwd {name}", nb_fb, sdpa_fb, "torch.autograd.grad of the output")
    return rows


# ----------------------------------------------------------------------------
# First calls and the disk cache, in fresh processes
# ----------------------------------------------------------------------------

FIRST_CALL = r"""
import json, sys, time
route, dtype = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
import nbflash
from nbflash._device import disk_cache_stats
if route == "cupy":
    import cupy as cp
    q, k, v = (cp.random.standard_normal((1, 1, 16, 64), dtype="float32").astype(dtype) for _ in range(3))
    sync = cp.cuda.runtime.deviceSynchronize
    call = lambda: nbflash.attention(q, k, v)
else:
    import torch
    import nbflash.torch as nbt
    q, k, v = (torch.randn(1, 1, 16, 64, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
               for _ in range(3))
    sync = torch.cuda.synchronize
    if route == "torch-fwd":
        call = lambda: nbt.attention(q, k, v)
    else:
        call = lambda: torch.autograd.grad(nbt.attention(q, k, v).sum(), (q, k, v))
sync()
t_import = time.perf_counter() - t0
times = []
for _ in range(2):
    t = time.perf_counter(); call(); sync(); times.append(time.perf_counter() - t)
stats = disk_cache_stats()
print(json.dumps(dict(route=route, dtype=dtype, import_s=t_import, first_s=times[0], second_s=times[1],
                      hits=stats["hits"], misses=stats["misses"])))
"""


def _subprocess_json(script: str, *args: str, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode or not lines:
        return dict(ok=False, error=(out.stderr or out.stdout)[-800:])
    return json.loads(lines[-1])


def first_calls() -> list[dict]:
    """Per route: a cold process (empty cache directory) and a warm one (the same directory, second process)."""
    rows = []
    for route, dtype in (
        ("cupy", "float16"),
        ("cupy", "float32"),
        ("torch-fwd", "float16"),
        ("torch-fwd", "bfloat16"),
        ("torch-fwd+bwd", "float16"),
        ("torch-fwd+bwd", "float32"),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, NUMBA_CACHE_DIR=tmp)
            env.pop("NBFLASH_DISK_CACHE", None)
            cold = _subprocess_json(FIRST_CALL, route, dtype, env=env)
            warm = _subprocess_json(FIRST_CALL, route, dtype, env=env)
        rows.append(dict(route=route, dtype=dtype, cold=cold, warm=warm))
    return rows


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------


def check_fast_equals_dispatcher() -> dict:
    import cupy as cp

    from nbflash import _device, _launch, forward

    results = {}
    for dtype in (np.float16, np.float32):
        for layout in ("bhsd", "bshd"):
            name = np.dtype(dtype).name
            cfg = forward.choose_config(D, name)
            kern = forward.forward_kernel(cfg)
            shape = (2, 3, 300, D) if layout == "bhsd" else (2, 300, 3, D)
            q, k, v = (cp.random.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(3))
            canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.transpose(0, 2, 1, 3))
            outs = []
            for fast in (False, True):
                o = cp.full(shape, np.nan, dtype)
                lse = cp.full((2, 3, 300), np.nan, np.float32)
                trace = cp.zeros((1, 1, 1, 1, 2), np.float32)
                args = (canon(q), canon(k), canon(v), canon(o), lse, 0.18, True, trace)
                grid, block = (-(-300 // cfg.block_m), 3, 2), (cfg.threads_x, cfg.threads_y, 1)
                if fast:
                    assert _launch.launch(kern, grid, block, 0, forward.shared_bytes(cfg), args)
                else:
                    _device.dispatcher_launch(kern, grid, block, 0, forward.shared_bytes(cfg), *args)
                cp.cuda.runtime.deviceSynchronize()
                outs.append((o, lse))
            same = all(cp.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(*outs, strict=True))
            results[f"{name} {layout}"] = bool(same)
    return dict(ok=all(results.values()), cases=results)


def check_cuda_graph() -> dict:
    import torch

    import nbflash.torch as nbt

    q, k, v = (torch.randn(2, 4, 130, D, device="cuda", dtype=torch.float16) for _ in range(3))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nbt.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = nbt.attention(q, k, v, causal=True)
    ok = True
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        for x in (q, k, v):
            x.copy_(torch.randn_like(x))
        graph.replay()
        want = nbt.attention(q.clone(), k.clone(), v.clone(), causal=True)
        torch.cuda.synchronize()
        ok &= bool(torch.equal(o, want))
    return dict(ok=ok, replays=3)


# ----------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    ap.add_argument("--calls", type=int, default=5000, help="timed calls per row")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--skip-subprocess", action="store_true", help="no first-call (cold / warm cache) measurements")
    args = ap.parse_args(argv)

    from tabulate import tabulate

    import nbflash

    if nbflash.SIMULATOR:
        print("overhead.py needs a CUDA GPU (the simulator is active)", file=sys.stderr)
        return 2
    import torch

    device = torch.cuda.get_device_name()
    result = dict(
        device=device,
        date=datetime.date.today().isoformat(),
        commit=os.environ.get("NBFLASH_COMMIT", ""),
        versions=versions(),
        shape=dict(batch=B, heads=H, seqlen=N, headdim=D),
        calls=args.calls,
        warmup=args.warmup,
    )
    checks = dict(fast_equals_dispatcher=check_fast_equals_dispatcher(), cuda_graph=check_cuda_graph())
    result["checks"] = checks
    rows = rows_cupy_and_launch(args.calls, args.warmup) + rows_torch(args.calls, args.warmup)
    result["rows"] = rows
    print(f"{device}   B={B} H={H} N={N} D={D}   median of {args.calls} calls (µs per call)")
    print(
        tabulate(
            [[r["call"], r["async_us"], r["sync_us"], r["note"]] for r in rows],
            headers=["call", "host µs", "+ sync µs", ""],
            floatfmt=".1f",
        )
    )
    if not args.skip_subprocess:
        result["first_call"] = first_calls()
        print()
        print(
            tabulate(
                [
                    [
                        r["route"],
                        r["dtype"],
                        r["cold"].get("first_s"),
                        r["warm"].get("first_s"),
                        r["warm"].get("second_s"),
                        f"{r['warm'].get('hits', '?')}/{r['warm'].get('misses', '?')}",
                        (r["cold"].get("error", "") or r["warm"].get("error", ""))[:60],
                    ]
                    for r in result["first_call"]
                ],
                headers=["first call (fresh process)", "dtype", "cold s", "warm s", "second s", "warm hits/misses",
                         "error"],
                floatfmt=".3f",
            )
        )
    print("checks:", json.dumps(checks))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"overhead-{device.replace(' ', '_')}-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
