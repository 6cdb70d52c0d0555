"""Is the Hopper backward's default configuration bitwise repeatable, and how far is its worst error from the
flash-attn rule's bound (2x the naive bf16 backward's) over many fresh inputs?  A diagnostic (sm_90 GPU).

For each head dim and shape (default: D = 128 and 64, bf16, shapes of a single key block, where every dQ
element gets one contribution, so even the atomic dQ route must give the same bits every run):

1. ``--repeats`` runs on fixed inputs compared with the first;
2. ``--inputs`` fresh inputs (seeds ``--seed0`` ...) against float64 autograd.  An input whose error ratio
   passes ``--flag`` is logged with each gradient's worst element (index, value, float64 and naive values) and
   run ``--reruns`` more times: runs that differ from its first result mean a race, none an input-made error.

Run from a tree's root, which goes first on ``sys.path``, so that two trees can be compared on the same
inputs, and several processes side by side to share the GPU (time-slicing preempts running blocks)::

    python benchmarks/bwd_repeat.py TAG            # writes $R/race-TAG.json (R defaults to /tmp)
    python benchmarks/bwd_repeat.py TAG --dims 128 --shapes 200x97c --routes atomic --repeats 0 --inputs 2000
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from benchmarks.tc_backward import DTYPES, KIND, W, api, as_cupy, ref_grads, run_cfg, worst_element  # noqa: E402


def shape(spec: str):
    """``200x97c`` -> (200, 97, True): seqlen_q x seqlen_k, ``c`` for causal."""
    causal = spec.endswith("c")
    n_q, n_k = spec.rstrip("c").split("x")
    return int(n_q), int(n_k), causal


ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("tag")
ap.add_argument("--dims", default="128,64")
ap.add_argument("--shapes", default="200x97c,97x97,97x128c", help="seqlen_q x seqlen_k, c: causal")
ap.add_argument("--routes", default="atomic,det", help="atomic, det (D = 64 has the atomic route only)")
ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--heads", type=int, default=3)
ap.add_argument("--repeats", type=int, default=200)
ap.add_argument("--inputs", type=int, default=60)
ap.add_argument("--seed0", type=int, default=100)
ap.add_argument("--flag", type=float, default=1.8, help="log inputs whose err/naive passes this")
ap.add_argument("--reruns", type=int, default=50)
args = ap.parse_args()
dtype = DTYPES[args.dtype]


def inputs(seed, n_q, n_k, d, causal):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(args.batch, args.heads, n, d, device="cuda", dtype=dtype, generator=g)
               for n in (n_q, n_k, n_k))
    do = torch.randn(args.batch, args.heads, n_q, d, device="cuda", dtype=dtype, generator=g)
    o, lse = api.forward_arrays(*(as_cupy(x) for x in (q, k, v)), causal=causal, bf16_bits=dtype == torch.bfloat16)
    return q, k, v, do, o, lse


out = {}
for d in (int(x) for x in args.dims.split(",")):
    cfg = W.choose_config(d, KIND[dtype], simulator=False)
    for n_q, n_k, causal in (shape(s) for s in args.shapes.split(",")):
        for det in (r == "det" for r in args.routes.split(",")):
            if det and d == 64:
                continue
            key = f"D{d} {n_q}x{n_k} causal={causal} det={det}"
            # 1. repeatability on fixed inputs: runs against the first
            q, k, v, do, o, lse = inputs(1, n_q, n_k, d, causal)
            first = [x.clone() for x in run_cfg(cfg, q, k, v, do, o, lse, causal, det)]
            differ = {"q": 0, "k": 0, "v": 0}
            for _ in range(args.repeats):
                got = run_cfg(cfg, q, k, v, do, o, lse, causal, det)
                for name, a, b in zip("qkv", got, first, strict=True):
                    differ[name] += int(not torch.equal(a, b))
            # 2. err / naive over fresh inputs
            ratios, flagged = [], []
            for seed in range(args.seed0, args.seed0 + args.inputs):
                q, k, v, do, o, lse = inputs(seed, n_q, n_k, d, causal)
                got = [x.clone() for x in run_cfg(cfg, q, k, v, do, o, lse, causal, det)]
                ref = ref_grads(q, k, v, do, causal, "bhsd", torch.float64)
                naive = ref_grads(q, k, v, do, causal, "bhsd", dtype)
                r = [float((x.double() - rr).abs().max() / max(float((nv.double() - rr).abs().max()), 1e-9))
                     for x, rr, nv in zip(got, ref, naive, strict=True)]
                ratios.append(r)
                if max(r) > args.flag:
                    reruns_differing = sum(
                        any(not torch.equal(a, b) for a, b in zip(
                            run_cfg(cfg, q, k, v, do, o, lse, causal, det), got, strict=True))
                        for _ in range(args.reruns))
                    entry = {"seed": seed, "err_over_naive_qkv": r, "reruns": args.reruns,
                             "reruns_differing": reruns_differing}
                    for name, x, rr, nv in zip("qkv", got, ref, naive, strict=True):
                        i = int((x.double() - rr).abs().argmax())
                        entry[f"d{name}_worst"] = worst_element(x, rr) + f", naive {nv.flatten()[i].item():.5g}"
                        entry[f"d{name}_zeros_where_ref_nonzero"] = int(((x == 0) & (rr.abs() > 1e-3)).sum())
                    flagged.append(entry)
                    print(args.tag, key, "FLAGGED", json.dumps(entry), flush=True)
            worst = [max(r[i] for r in ratios) for i in range(3)] if ratios else []
            qs = sorted(max(r) for r in ratios)
            out[key] = {"runs_differing_from_first": differ, "repeats": args.repeats,
                        "worst_err_over_naive_qkv": worst, "inputs_over_2x": sum(x > 2 for x in qs),
                        "inputs": len(ratios), "seeds_from": args.seed0,
                        "ratio_quantiles_50_90_99": [qs[int(p * (len(qs) - 1))] for p in (0.5, 0.9, 0.99)]
                        if qs else [],
                        "flagged": flagged}
            print(args.tag, key, json.dumps({k: v for k, v in out[key].items() if k != "flagged"}), flush=True)
with open(os.path.join(os.environ.get("R", "/tmp"), f"race-{args.tag}.json"), "w") as f:
    json.dump({"args": vars(args), "results": out}, f, indent=1)
