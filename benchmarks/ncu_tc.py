"""A workload for Nsight Compute: the ``mma.sync`` forward (and backward) beside SDPA's flash kernels.

    ncu --clock-control none -k regex:flash --launch-skip 2 --launch-count 2 --csv \\
        --metrics sm__inst_executed.sum,gpu__time_duration.sum,... python benchmarks/ncu_tc.py fwd 128 0

Arguments: ``fwd``, ``bwd`` (deterministic dQ) or ``bwd-atomic`` (atomic dQ: the default above D = 64, with
the dK/dV kernel in FlashAttention-2's warp grid at D = 96 and 128) or ``bwd-bulk`` (that route's kernel with
``bulk_dq``: dQ by bulk reductions from shared memory, sm_90), the head dim, and 1 for causal.
``fwd-wg`` and ``bwd-wg`` (sm_90) run nbflash's defaults instead (``backend="auto"``: the ``wgmma`` kernels,
the backward by its default dQ route) beside SDPA's **cuDNN** kernels, the target of issue 7; filter with
``-k regex:"wgmma|cudnn|sdpa"``.
bf16, N = 4096, batch 4, heads·D = 2048;
three repetitions, so that ``--launch-skip`` can pass the first (compiling) one; the last one runs between
``cudaProfilerStart`` and ``Stop``, so ``--profile-from-start off`` profiles just its kernels.  Each repetition
launches nbflash's kernels first, then SDPA flash's (forward: 2 kernels; backward: 8).
``benchmarks/results/ncu-tc-H200-2026-11-30.txt`` was made with it.
"""

import dataclasses
import os
import sys

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.tc_sweep import as_cupy  # noqa: E402
from nbflash import api, backward_tc  # noqa: E402

what, d, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
WHATS = ("fwd", "bwd", "bwd-atomic", "bwd-bulk", "fwd-wg", "bwd-wg")
if what not in WHATS:
    sys.exit(f"the first argument must be one of {', '.join(WHATS)}, got {what!r}")
backward = what.startswith("bwd")
hopper = what.endswith("-wg")
backend = "auto" if hopper else "tensor_core"
peer = SDPBackend.CUDNN_ATTENTION if hopper else SDPBackend.FLASH_ATTENTION
torch.manual_seed(0)
B, H, N = 4, 2048 // d, 4096
q, k, v, do = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
cq, ck, cv, cdo = (as_cupy(x) for x in (q, k, v, do))
for rep in range(3):
    if rep == 2:  # for ``ncu --profile-from-start off``: the last repetition only, every kernel of it
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    o, lse = api.forward_arrays(cq, ck, cv, causal=causal, bf16_bits=True, backend=backend)
    if what == "bwd-bulk":
        cfg = dataclasses.replace(backward_tc.choose_config(d, "bfloat16", atomic=True), bulk_dq=True)
        grads = [cp.empty_like(x) for x in (cq, ck, cv)]
        backward_tc.launch_backward_tc(cfg, cdo, cq, ck, cv, o, lse, *grads, d**-0.5, causal, deterministic=False)
    elif backward:
        api.backward_arrays(cdo, cq, ck, cv, o, lse, causal=causal, bf16_bits=True,
                            deterministic={"bwd": True, "bwd-atomic": False}.get(what), backend=backend)
    with sdpa_kernel(peer):
        qq, kk, vv = (x.clone().requires_grad_(backward) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        if backward:
            out.backward(do)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("done", what, d, causal)
