"""A/B of the ``mma.sync`` backward: earlier versions of ``nbflash/backward_tc.py`` beside the current one, one run.

Each earlier version is a copy of the module inside the package (its relative imports must resolve), e.g.::

    git show 790450a:nbflash/backward_tc.py > nbflash/_btc_old.py
    VARIANTS=old,new python benchmarks/backward_tc_ab.py benchmarks/results/tc-backward-ab.json

``VARIANTS``: names of ``nbflash._btc_<name>`` modules, ``new`` being ``nbflash.backward_tc`` itself.

1. Check: every variant's deterministic and atomic routes (64 × 64 tiles; for ``new`` at D = 128 also the
   8-warp 64 × 128 atomic tiles) against float64 autograd, the flash-attn rule (each gradient's error at most
   twice that of PyTorch's own bf16 math), over ragged and causal shapes; outputs poisoned with NaN first.
2. Time: bf16, D 64 / 128, causal and not, N = 1k / 4k / 16k at batch·N = 16k, heads·D = 2048, the backward
   alone (2.5× the forward's FLOPs, halved for causal; medians of CUDA events, tc_backward.events_ms),
   SDPA flash's backward in the same run.

``--ncu D`` instead runs a short workload for Nsight Compute: each variant's deterministic backward, then SDPA
flash's, twice (``ncu -k regex:"dkdv|dq_dk_dv" --launch-skip <variants + 1> ...``), N = 4096, non-causal.
"""

import importlib
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from benchmarks.forward_sweep import environment  # noqa: E402
from benchmarks.tc_backward import events_ms, kernel_info, ref_grads  # noqa: E402
from benchmarks.tc_sweep import as_cupy  # noqa: E402
from nbflash import api  # noqa: E402

MODS = {
    name: importlib.import_module("nbflash.backward_tc" if name == "new" else f"nbflash._btc_{name}")
    for name in os.environ.get("VARIANTS", "old,new").split(",")
}
DT = torch.bfloat16
CASES = [(97, 97, False), (200, 97, True), (97, 200, True), (1025, 1025, True), (2048, 2048, False), (128, 128, True)]


def variants(d):
    """(label, module, config, deterministic) of every timed route."""
    out = []
    for name, mod in MODS.items():
        base = mod.choose_config(d, "bfloat16")
        out += [(f"{name}-64x64-det", mod, base, True), (f"{name}-64x64-atomic", mod, base, False)]
        if d == 128 and name == "new":
            wide = mod.TCBackwardConfig(64, 128, d, "bfloat16", kv_in_registers=False, vector_red=base.vector_red)
            out.append((f"{name}-64x128-atomic", mod, wide, False))
    return out


def run(mod, cfg, det, q, k, v, do, o, lse, causal, grads=None):
    if grads is None:
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    cq, ck, cv, cdo, cdq, cdk, cdv = (as_cupy(x) for x in (q, k, v, do, *grads))
    mod.launch_backward_tc(cfg, cdo, cq, ck, cv, o, lse, cdq, cdk, cdv, 1 / math.sqrt(q.shape[-1]), causal, det,
                           check=False)
    return grads


def ncu_workload(d):
    b, h, n = 4, 2048 // d, 4096
    q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=DT) for _ in range(4))
    o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), bf16_bits=True)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    for _ in range(2):
        for mod in MODS.values():
            run(mod, mod.choose_config(d, "bfloat16"), True, q, k, v, do, o, lse, False, grads)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
            F.scaled_dot_product_attention(qq, kk, vv).backward(do)
    torch.cuda.synchronize()


def main(out):
    lines = []

    def log(m):
        print(m, flush=True)
        lines.append(m)

    fails = 0
    g = torch.Generator(device="cuda").manual_seed(1)
    for d in (64, 128):
        worst = {}
        for nq, nk, causal in CASES:
            q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=DT, generator=g) for n in (nq, nk, nk))
            do = torch.randn_like(q)
            ref = ref_grads(q, k, v, do, causal, "bhsd", torch.float64)
            naive = ref_grads(q, k, v, do, causal, "bhsd", DT)
            o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=True)
            for name, mod, cfg, det in variants(d):
                got = run(mod, cfg, det, q, k, v, do, o, lse, causal)
                for gname, x, r, nv in zip("qkv", got, ref, naive, strict=True):
                    err, nerr = (x.double() - r).abs().max().item(), (nv.double() - r).abs().max().item()
                    worst[name] = max(worst.get(name, 0), err / max(nerr, 1e-9))
                    if not (math.isfinite(err) and err <= 2 * nerr + 1e-4):
                        fails += 1
                        log(f"FAIL {name} D{d} {nq}x{nk} causal={causal} d{gname} err {err:.2e} naive {nerr:.2e}")
        log(f"check D{d}: worst err/naive " + json.dumps({k: round(x, 2) for k, x in worst.items()}))
    log(f"check failures: {fails}")
    for d in (64, 128):
        for name, mod, cfg, det in variants(d):
            info = f"dkdv {kernel_info(mod.dkdv_tc_kernel(cfg, not det))}"
            log(f"regs D{d} {name}: {info}" + (f" dq {kernel_info(mod.dq_tc_kernel(cfg))}" if det else ""))
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for n in (1024, 4096, 16384):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=DT) for _ in range(4))
                fl = 2.5 * 4.0 * b * h * n * n * d / (2 if causal else 1)
                row = {"D": d, "causal": causal, "N": n}
                qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    oo = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
                    ms = events_ms(lambda: torch.autograd.grad(oo, (qs, ks, vs), do, retain_graph=True), 10)
                row["sdpa-flash"] = fl / ms / 1e9
                o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=True)
                grads = [torch.empty_like(x) for x in (q, k, v)]
                for name, mod, cfg, det in variants(d):
                    ms = events_ms(lambda: run(mod, cfg, det, q, k, v, do, o, lse, causal, grads), 10)
                    row[name] = fl / ms / 1e9
                rows.append(row)
                log(" ".join(f"{k}={x:.1f}" if isinstance(x, float) else f"{k}={x}" for k, x in row.items()))
    with open(out, "w") as f:
        json.dump({"environment": environment(), "rows": rows, "log": lines}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--ncu":
        ncu_workload(int(sys.argv[2]))
    else:
        main(sys.argv[1])
