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
   warm-up, next to SDPA's flash backward (autograd.grad on a retained graph)
   in the same run.

Results go to ``<out>/tc-backward-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward_sweep import environment  # noqa: E402
from benchmarks.tc_sweep import as_cupy, cuda_time_ms  # noqa: E402
from nbflash import api  # noqa: E402


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


def check(log, dims, dtypes):
    failures = 0
    g = torch.Generator(device="cuda").manual_seed(0)
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
                do = torch.randn_like(q)
                ref = ref_grads(q, k, v, do, causal, layout, torch.float64)
                naive = ref_grads(q, k, v, do, causal, layout, dtype)
                for det in (False, True):
                    out = nb_backward(q, k, v, do, causal, layout, det)
                    for name, x, r, nv in zip("q k v".split(), out, ref, naive, strict=True):
                        err = (x.double() - r).abs().max().item()
                        nerr = (nv.double() - r).abs().max().item()
                        ok = math.isfinite(err) and err <= 2 * nerr + 1e-4
                        worst = max(worst, err / max(nerr, 1e-9))
                        if not ok:
                            failures += 1
                            log(
                                f"FAIL D{d} {dtype} {n_q}x{n_k} causal={causal} {layout} det={det} d{name}: "
                                f"err {err:.2e} naive {nerr:.2e}"
                            )
            log(f"check backward D{d} {dtype}: worst err/naive {worst:.2f}")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[s] for s in args.dtypes.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    env = environment()
    if not args.no_check:
        log(f"correctness failures: {check(log, dims, dtypes)}")
    results = []
    for d in dims:
        for dtype in dtypes:
            for causal in (False, True):
                for n in [int(x) for x in args.seqlens.split(",") if x]:
                    b, h = max(1, 16384 // n), 2048 // d
                    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=dtype) for _ in range(4))
                    fl = 2.5 * 4.0 * b * h * n * n * d / (2 if causal else 1)
                    row = {"dtype": str(dtype).split(".")[-1], "D": d, "causal": causal, "N": n}
                    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                        ms = cuda_time_ms(lambda i: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True), 1)
                    row["sdpa-flash"] = fl / ms / 1e9
                    bf16 = dtype == torch.bfloat16
                    cq, ck, cv, cdo = (as_cupy(x) for x in (q, k, v, do))
                    o_, lse = api.forward_arrays(cq, ck, cv, causal=causal, bf16_bits=bf16)
                    for name, det, backend in (
                        ("nb-tc", False, "tensor_core"),
                        ("nb-tc-det", True, "tensor_core"),
                        ("nb-simt", False, "simt"),
                    ):

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
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name().replace(" ", "-")
    path = os.path.join(args.out, f"tc-backward-{dev}-{datetime.date.today()}.json")
    with open(path, "w") as f:
        json.dump({"environment": env, "results": results, "log": lines}, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
