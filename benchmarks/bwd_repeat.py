"""Is the Hopper backward's default configuration bitwise repeatable, and how far is its worst error from the
flash-attn rule's bound (2x the naive bf16 backward's) over many fresh inputs?  A diagnostic (sm_90 GPU).

For D = 128 and 64, bf16, shapes of a single key block (every dQ element gets one contribution, so even the
atomic dQ route must give the same bits every run): 200 runs on fixed inputs compared with the first, then 60
fresh inputs (seeds 100...) against float64 autograd.  Run from a tree's root, which goes first on ``sys.path``,
so that two trees can be compared on the same inputs::

    python benchmarks/bwd_repeat.py TAG            # writes $R/race-TAG.json (R defaults to /tmp)
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from benchmarks.tc_backward import W, api, as_cupy, ref_grads, run_cfg  # noqa: E402

tag = sys.argv[1]
out = {}
for d in (128, 64):
    cfg = W.choose_config(d, "bfloat16", simulator=False)
    for n_q, n_k, causal in ((200, 97, True), (97, 97, False), (97, 128, True)):
        for det in (False, True):
            if det and d == 64:
                continue
            key = f"D{d} {n_q}x{n_k} causal={causal} det={det}"
            # 1. repeatability on fixed inputs: 200 runs against the first
            g = torch.Generator(device="cuda").manual_seed(1)
            q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for n in (n_q, n_k, n_k))
            do = torch.randn(2, 3, n_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
            o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=True)
            first = [x.clone() for x in run_cfg(cfg, q, k, v, do, o, lse, causal, det)]
            differ = {"q": 0, "k": 0, "v": 0}
            for _ in range(200):
                got = run_cfg(cfg, q, k, v, do, o, lse, causal, det)
                for name, a, b in zip("qkv", got, first, strict=True):
                    differ[name] += int(not torch.equal(a, b))
            # 2. err / naive over fresh inputs
            ratios = []
            for seed in range(60):
                g = torch.Generator(device="cuda").manual_seed(100 + seed)
                q, k, v = (torch.randn(2, 3, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for n in (n_q, n_k, n_k))
                do = torch.randn(2, 3, n_q, d, device="cuda", dtype=torch.bfloat16, generator=g)
                o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=True)
                got = run_cfg(cfg, q, k, v, do, o, lse, causal, det)
                ref = ref_grads(q, k, v, do, causal, "bhsd", torch.float64)
                naive = ref_grads(q, k, v, do, causal, "bhsd", torch.bfloat16)
                ratios.append([float((x.double() - r).abs().max() / max(float((nv.double() - r).abs().max()), 1e-9))
                               for x, r, nv in zip(got, ref, naive, strict=True)])
            worst = [max(r[i] for r in ratios) for i in range(3)]
            over = sum(any(x > 2 for x in r) for r in ratios)
            out[key] = {"runs_differing_from_first": differ, "worst_err_over_naive_qkv": worst,
                        "inputs_over_2x": over, "inputs": len(ratios)}
            print(tag, key, json.dumps(out[key]), flush=True)
with open(os.path.join(os.environ.get("R", "/tmp"), f"race-{tag}.json"), "w") as f:
    json.dump(out, f, indent=1)
