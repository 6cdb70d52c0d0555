"""Tensor-core forward on the GPU: correctness at real sizes, and a tile sweep against SDPA.

Run on a CUDA machine (CuPy and PyTorch needed)::

    python benchmarks/tc_sweep.py --out benchmarks/results

Only some candidates, by tag (see :func:`tag`; ``default`` is the
configuration :func:`nbflash.forward_tc.choose_config` picks, ``default-split``
the same tiles in FlashAttention-2's split K/V pipeline), e.g. the two
pipelines side by side at D = 64 and 128::

    python benchmarks/tc_sweep.py --dims 64,128 --configs default,default-split --suffix -pipelines

1. For each candidate tile configuration of :mod:`nbflash.forward_tc`: the
   compile time, and registers / shared / local memory of the compiled kernel.
2. Correctness: each configuration against a float64 reference over odd sizes,
   causal and not, both layouts; the error must stay within twice that of
   PyTorch's own fp16/bf16 math attention (the flash-attn rule).  Outputs are
   poisoned (NaN) before every run.
3. Timing at batch·N = 16k, heads·D = 2048 next to SDPA's flash and cuDNN
   backends in the same run: medians of CUDA-event timings after warm-up,
   inputs rotated over several sets so the L2 cache does not flatter.

Results go to ``<out>/tc-forward-<device>-<date>.json`` (device, versions, commit).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import cupy as cp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.forward_sweep import environment  # noqa: E402
from nbflash import forward_tc as T  # noqa: E402
from nbflash import forward_wgmma as W  # noqa: E402

KIND = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
# (block_m, block_n, q_in_regs, m_tiles, kv_pipeline) per head dim.
CANDIDATES = {
    64: [
        (64, 64, True, 1, "double"),
        (128, 64, True, 2, "double"),
        (128, 64, True, 2, "split"),  # the same tiles in FlashAttention-2's split K/V pipeline (36 KB, not 54)
        (128, 32, True, 2, "double"),
        (64, 64, True, 2, "double"),
    ],
    128: [
        (64, 32, True, 1, "double"),
        (64, 64, True, 1, "double"),
        (128, 32, False, 2, "double"),
        (64, 32, False, 2, "double"),
        (128, 64, False, 1, "double"),
        (128, 64, False, 2, "double"),  # FlashAttention-2's D = 128 tiles: 4 warps × 32 rows, Q re-read from smem
        (128, 64, False, 2, "split"),  # ... and its split K/V pipeline (68 KB of shared memory, not 102)
    ],
    256: [(64, 32, False, 1, "double")],
}
#: The wgmma kernel's candidates (nbflash.forward_wgmma, Hopper only): (block_m, block_n, pipeline[:stages]) per
#: head dim.
WG_CANDIDATES = {
    64: [(128, 128, "plain"), (128, 64, "plain"), (128, 128, "overlap"), (128, 64, "overlap"), (192, 128, "overlap"),
         (192, 64, "overlap"), (64, 128, "overlap"), (128, 64, "pingpong"), (128, 128, "pingpong"),
         (128, 128, "ws:2"), (128, 128, "ws:3"), (128, 128, "ws:4"), (128, 192, "ws:2"), (128, 64, "ws:3"),
         (128, 128, "ws-overlap:3"), (128, 192, "ws-overlap:3"), (128, 128, "ws:2:tma"), (128, 64, "ws:3:tma"),
         (128, 128, "ws:3:tma"), (128, 128, "ws:2:tma:r"), (128, 128, "ws-overlap:3:tma:r"),
         (128, 192, "ws:2:tma:r"), (128, 192, "ws-overlap:3:tma:r"), (128, 128, "ws-overlap:4:tma:r"),
         (128, 192, "ws-overlap:4:tma:r"), (128, 128, "ws:2:tma::p"), (128, 192, "ws-overlap:3:tma:r:p"),
         (128, 192, "ws-overlap:2:tma:r:p:s"), (128, 192, "ws-overlap:3:tma:r:p:s"), (128, 128, "ws:2:tma::p:s"),
         (128, 192, "ws-overlap:3:tma:r:p::pin"), (128, 128, "ws-overlap:3:tma:r:p::pin"),
         (128, 128, "ws-overlap:3:tma:r:p"),
         # three consumer warpgroups (FlashAttention-3's D = 64 shape; 192 × 160 and wider spill, offline)
         (192, 128, "ws-overlap:3:tma:r:p"), (192, 128, "ws-overlap:3:tma:r"), (192, 128, "ws-overlap:4:tma:r:p"),
         (192, 128, "ws-overlap:2:tma:r:p:s"),
         (192, 128, "ws:2:tma:r:p"),
         # two Q_i buffers, and the seam step between items
         (192, 128, "ws-overlap:3:tma:r:p:::q2"), (192, 128, "ws-overlap:3:tma:r:p:::seam"),
         (192, 128, "ws-overlap:3:tma:r::::seam"), (128, 192, "ws-overlap:3:tma:r:p:::q2"),
         (128, 192, "ws-overlap:3:tma:r:p:::seam"), (128, 128, "ws-overlap:3:tma:r:p:::seam"),
         # the dynamic scheduler: persistent blocks take their next chunk off a counter
         (192, 128, "ws-overlap:3:tma:r:pd"), (128, 192, "ws-overlap:3:tma:r:pd"), (128, 128, "ws-overlap:3:tma:r:pd"),
         (192, 128, "ws-overlap:3:tma:r:pd:::seam"),
         # a share of the exponentials by the polynomial on the FMA units (FlashAttention-4's split)
         (192, 128, "ws-overlap:3:tma:r:pd::::e2"), (192, 128, "ws-overlap:3:tma:r:pd::::e3"),
         (192, 128, "ws-overlap:3:tma:r:pd::::e4"), (192, 128, "ws-overlap:3:tma:r:::::e3"),
         (128, 192, "ws-overlap:3:tma:r:p::::e2"), (128, 192, "ws-overlap:3:tma:r:p::::e3"),
         (128, 192, "ws-overlap:3:tma:r:p::::e4"), (128, 128, "ws-overlap:3:tma:r:p::::e3"),
         (192, 128, "ws-overlap:3:tma:r:p::::e3"),
         # session 39: causal items one at a time, longest first, off the dynamic scheduler
         (128, 192, "ws-overlap:3:tma:r:pdl"), (192, 128, "ws-overlap:3:tma:r:pdl"),
         (128, 128, "ws-overlap:3:tma:r:pdl"), (128, 192, "ws-overlap:3:tma:r:pdl::::e2"),
         (128, 192, "ws-overlap:3:tma:r:pdl:::seam"), (192, 128, "ws-overlap:3:tma:r:pdl:::seam"),
         (128, 128, "ws-overlap:3:tma:r:pdl:::seam")],
    128: [(128, 128, "plain"), (128, 128, "overlap"), (128, 64, "overlap"), (64, 128, "overlap"),
          (128, 128, "pingpong"), (128, 64, "pingpong"), (128, 128, "ws:2"), (128, 128, "ws:3"), (128, 64, "ws:3"),
          (128, 64, "ws:4"), (128, 192, "ws:2"), (128, 128, "ws-overlap:3"), (128, 128, "ws-overlap:4"),
          (128, 64, "ws-overlap:4"), (128, 128, "ws:2:tma"), (128, 128, "ws:3:tma"), (128, 64, "ws:3:tma"),
          (128, 64, "ws:4:tma"), (128, 192, "ws:2:tma"), (128, 128, "ws-overlap:3:tma"),
          (128, 128, "ws:2:tma:r"), (128, 128, "ws-overlap:3:tma:r"), (128, 192, "ws:2:tma:r"),
          (128, 128, "ws-overlap:3:tma:r:p"), (128, 128, "ws-overlap:2:tma:r:p:s"),
          (128, 128, "ws-overlap:3:tma:r:p:s"), (128, 176, "ws-overlap:2:tma:r:p:s"),
          (128, 160, "ws-overlap:2:tma:r:p:s"), (128, 176, "ws-overlap:2:tma:r::s"),
          (128, 128, "ws-overlap:3:tma:r::s"), (128, 128, "ws-overlap:3:tma:r:p::pin"),
          (128, 192, "ws-overlap:2:tma:r:p:s"),
          # three consumer warpgroups: 192 × 64 fits 160 registers (192 × 80 spills, offline)
          (192, 64, "ws-overlap:3:tma:r:p"), (192, 64, "ws-overlap:4:tma:r:p"),
          # two Q_i buffers (2 stages: 3 do not fit beside them), and the seam step between items
          (128, 128, "ws-overlap:2:tma:r:p:s::q2"), (128, 128, "ws-overlap:2:tma:r:p:s::seam"),
          (128, 128, "ws-overlap:2:tma:r:p:s"),
          # the dynamic scheduler
          (128, 128, "ws-overlap:2:tma:r:pd:s"), (128, 128, "ws-overlap:3:tma:r:pd"),
          (192, 64, "ws-overlap:3:tma:r:pd"),
          (128, 176, "ws-overlap:2:tma:r:pd:s"),
          (128, 128, "ws-overlap:3:tma:r:p::::e2"), (128, 128, "ws-overlap:3:tma:r:::::e2"),
          (128, 128, "ws-overlap:3:tma:r:pdl")],
    # D > 128 with TMA: 2 split stages (3 do not fit beside Q_i), S's k-steps unrolled, WIDE_REGISTER_SPLIT; the
    # widest tiles without local memory offline (128 × 80 at D = 256 and 128 × 112 at D = 192 spill)
    176: [(128, 64, "overlap"), (128, 96, "ws-overlap:2:tma:r:p:s"), (128, 96, "ws-overlap:2:tma:r::s")],
    256: [(128, 64, "overlap"), (128, 64, "ws:2"), (128, 32, "ws:3"),
          (128, 64, "ws-overlap:2:tma:r:p:s"), (128, 64, "ws-overlap:2:tma:r::s"), (128, 64, "ws:2:tma:r:p")],
}


def wg_config(bm, bn, d, kind, pipe) -> W.WGConfig:
    """A :class:`~nbflash.forward_wgmma.WGConfig` from a candidate (``"ws:3"``: the ws pipeline, 3 stages;
    ``"ws:3:tma"``: the same with TMA copies; ``"ws:3:tma:r"``: and registers moved by ``setmaxnreg``;
    ``"ws:3:tma:r:p"``: and persistent blocks (``pd``: taking their chunks off a counter, ``dynamic``; a trailing
    ``l``, as in ``pdl`` or ``l``: causal items one at a time, longest first, ``causal_pairs=False``);
    ``"ws-overlap:2:tma:r:p:s"``: K and V on their own mbarriers,
    ``split_kv``; a seventh field ``pin``: ws-overlap's softmax pinned between its waits, ``pin_softmax=True``;
    an eighth ``q2``: two Q_i buffers, ``q_buffers=2``, or ``seam``: and the seam step, ``seam=True``; a ninth
    ``e<k>``: k of every 8 exponentials by the polynomial, ``poly_exp2=k``)."""
    name, stages, copies, regs, persist, split, pin, q, poly = (pipe.split(":") + [""] * 8)[:9]
    fields = [(regs, ("", "r")), (persist, ("", "p", "pd", "l", "pl", "pdl")), (split, ("", "s")), (pin, ("", "pin")),
              (q, ("", "q2", "seam"))]  # pairs, not a dict keyed by the values: two fields may hold the same text
    if any(v not in ok for v, ok in fields) or (poly and not poly[1:].isdigit()) or len(pipe.split(":")) > 9:
        raise ValueError(f"candidate {pipe!r}: a field out of place (see wg_config)")
    return W.WGConfig(bm, bn, d, kind, name, **({"stages": int(stages)} if stages else {}),
                      **({"copies": copies} if copies else {}), setmaxnreg=regs == "r",
                      persistent="p" in persist, dynamic="d" in persist, causal_pairs="l" not in persist,
                      split_kv=split == "s", pin_softmax=pin == "pin", q_buffers=2 if q in ("q2", "seam") else 1,
                      seam=q == "seam", poly_exp2=int(poly[1:]) if poly else 0)
#: Names accepted by --configs besides tags: choose_config's pick for each head dim and dtype, its split pipeline,
#: the same with S = Q Kᵀ in straight-line groups of 1 or 2 k-steps (``qk_unroll``), and the wgmma kernel's pick;
#: ``default-eager``: the pick with O rescaled at every key tile (``lazy_rescale=False``, FlashAttention-2's softmax);
#: ``wg-default-lazy``: the wgmma pick with the lazy rescale (``lazy_rescale=True``; off by default there);
#: ``default-direct``: the pick with O stored from the registers (``stage_o=False``), not staged in shared memory;
#: ``wg-default-p`` / ``wg-default-np``: the wgmma pick with persistent blocks / one block per work chunk (for
#: picks that copy with TMA; others as they are).
NAMED = ("default", "default-split", "default-u1", "default-u2", "wg-default", "default-eager", "wg-default-lazy",
         "default-direct", "wg-default-p", "wg-default-np")
#: Head dims checked for correctness only (the default configuration).
CHECK_ONLY = (40, 96, 256)


def tag(cfg) -> str:
    """``64x32`` (Q fragments in registers) or ``64x32s`` (Q re-read from shared memory); ``/2``: two m-tiles
    per warp; ``-split``: FlashAttention-2's split K/V pipeline (one K and one V buffer, two cp.async groups);
    ``-u1``: S = Q Kᵀ as straight-line code in groups of one k-step (``qk_unroll``);
    ``wg128x128``: the wgmma kernel's tiles, overlapped pipeline (``-plain``: every product waited for at once;
    ``-pp``: the two warpgroups take turns; ``-ws3``: a producer warpgroup and 3 K/V stages; ``-wso3``: the same,
    each warpgroup also overlapping its softmax with its own P V; ``-tma``: the producer copies with TMA; ``-r``:
    ``setmaxnreg`` moves registers from the producer to the consumers; ``-eager`` (mma.sync): O rescaled at every
    key tile; ``-direct`` (mma.sync): O stored from the registers, not staged in shared memory; ``-lazy``
    (wgmma): O rescaled only when a row's max moves past the slack; ``-p`` (wgmma): persistent blocks (``-pd``: with
    the dynamic scheduler; ``-pdl``, ``-pl``, ``-l``: causal items one at a time, longest first); ``-kv``
    (wgmma): K and V on their own mbarriers and releases, ``split_kv``; ``-pin`` (wgmma): ws-overlap's softmax
    pinned between its waits, ``pin_softmax=True``; ``-q2`` (wgmma): two Q_i buffers; ``-seam`` (wgmma): and the
    seam step between items; ``-e<k>`` (wgmma): k of every 8 exponentials by the polynomial on the FMA units)."""
    if isinstance(cfg, W.WGConfig):
        suffix = {"plain": "-plain", "overlap": "", "pingpong": "-pp", "ws": f"-ws{cfg.stages}",
                  "ws-overlap": f"-wso{cfg.stages}"}[cfg.pipeline]
        copies = "-tma" if cfg.copies == "tma" else ""
        lazy = "-lazy" if cfg.lazy_rescale else ""
        persist = ("-pd" if cfg.dynamic else "-p" if cfg.persistent else "") + ("" if cfg.causal_pairs else
                                                                                 ("l" if cfg.persistent else "-l"))
        split = "-kv" if cfg.split_kv else ""
        pin = "-pin" if cfg.pin_softmax else ""
        q = "-seam" if cfg.seam else "-q2" if cfg.q_buffers == 2 else ""
        poly = f"-e{cfg.poly_exp2}" if cfg.poly_exp2 else ""
        return (f"wg{cfg.block_m}x{cfg.block_n}{suffix}{copies}{'-r' if cfg.setmaxnreg else ''}{lazy}{persist}{split}"
                f"{pin}{q}{poly}")
    return (
        f"{cfg.block_m}x{cfg.block_n}{'' if cfg.q_in_regs else 's'}{'/2' if cfg.m_tiles == 2 else ''}"
        f"{'-split' if cfg.kv_pipeline == 'split' else ''}{f'-u{cfg.qk_unroll}' if cfg.qk_unroll else ''}"
        f"{'' if cfg.lazy_rescale else '-eager'}{'' if cfg.stage_o else '-direct'}"
    )


def persistent(cfg: W.WGConfig, on: bool) -> W.WGConfig:
    """``cfg`` with persistent blocks on or off, where it can have them (a ws pipeline copying with TMA)."""
    return dataclasses.replace(cfg, persistent=on) if cfg.warp_specialized and cfg.copies == "tma" else cfg


def select(dims, kinds, wanted=None):
    """The candidates of ``dims`` × ``kinds``; with ``wanted`` (tags or :data:`NAMED`), only those, each once."""
    cfgs = []
    for d in dims:
        for kind in kinds:
            listed = [T.TCConfig(bm, bn, d, kind, qr, mt, kp) for bm, bn, qr, mt, kp in CANDIDATES.get(d, [])]
            listed += [wg_config(bm, bn, d, kind, pipe) for bm, bn, pipe in WG_CANDIDATES.get(d, [])]
            if wanted is None:
                cfgs += listed
                continue
            default = T.choose_config(d, kind, simulator=False)
            named = {"default": default, "default-split": dataclasses.replace(default, kv_pipeline="split"),
                     "default-u1": dataclasses.replace(default, qk_unroll=1),
                     "default-u2": dataclasses.replace(default, qk_unroll=2),
                     "wg-default": W.choose_config(d, kind, simulator=False),
                     "default-eager": dataclasses.replace(default, lazy_rescale=False),
                     "wg-default-lazy": dataclasses.replace(W.choose_config(d, kind, simulator=False),
                                                            lazy_rescale=True),
                     "default-direct": dataclasses.replace(default, stage_o=False),
                     "wg-default-p": persistent(W.choose_config(d, kind, simulator=False), True),
                     "wg-default-np": persistent(W.choose_config(d, kind, simulator=False), False)}
            for cfg in [named[w] for w in NAMED if w in wanted] + [c for c in listed if tag(c) in wanted]:
                if cfg not in cfgs:
                    cfgs.append(cfg)
    return cfgs


def compile_in_processes(script: str, jobs: int) -> list[int]:
    """Run ``script`` with this process's arguments plus ``--compile-part=i/jobs`` in ``jobs`` processes at once:
    each compiles its share of the candidates into the on-disk kernel cache, from which the caller then loads them.
    Returns the processes' exit codes."""
    argv = [sys.executable, os.path.abspath(script), *sys.argv[1:]]
    procs = [subprocess.Popen([*argv, f"--compile-part={i}/{jobs}"], stdout=subprocess.DEVNULL) for i in range(jobs)]
    return [p.wait() for p in procs]


def as_cupy(t: torch.Tensor):
    """Zero-copy CuPy view (bfloat16 as its uint16 bits)."""
    if t.dtype == torch.bfloat16:
        return cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)
    return cp.from_dlpack(t)


def run_tc(cfg, q, k, v, causal, layout="bhsd"):
    """Launch the tensor-core forward on torch tensors; returns (o, lse) tensors."""
    o = torch.full_like(q, float("nan"))
    b, n_q, h = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bhsd" else (q.shape[0], q.shape[1], q.shape[2])
    lse = torch.full((b, h, n_q), float("nan"), device=q.device)
    canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.swapaxes(1, 2))
    qc, kc, vc, oc = (canon(as_cupy(x)) for x in (q, k, v, o))
    launcher(cfg)(cfg, qc, kc, vc, oc, as_cupy(lse), 1 / math.sqrt(q.shape[-1]), causal)
    return o, lse


def launcher(cfg):
    """The launch function of the kernel family of ``cfg``: mma.sync (forward_tc) or wgmma (forward_wgmma)."""
    return W.launch_forward_wgmma if isinstance(cfg, W.WGConfig) else T.launch_forward_tc


def module(cfg):
    return W if isinstance(cfg, W.WGConfig) else T


def ref(q, k, v, causal, dtype=torch.float64):
    """Materialised attention in ``dtype`` (bottom-right causal), (B, H, N, D)."""
    q, k, v = (x.to(dtype) for x in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    lse = torch.logsumexp(s.double(), -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v, lse


def check(log, cfgs, dtypes):
    failures = 0
    g = torch.Generator(device="cuda").manual_seed(0)
    for cfg in cfgs:
        dtype = next(d for d, k in KIND.items() if k == cfg.input_kind)
        if dtype not in dtypes:
            continue
        worst = 0.0
        for n_q, n_k, causal, layout in [
            (97, 97, False, "bhsd"),
            (200, 97, True, "bhsd"),
            (97, 200, True, "bshd"),
            (1025, 1025, True, "bhsd"),
            (1025, 2048, False, "bshd"),
            (2048, 2048, True, "bshd"),
            (128, 128, False, "bhsd"),
        ]:
            d = cfg.head_dim
            shp = (lambda n: (2, 3, n, d)) if layout == "bhsd" else (lambda n: (2, n, 3, d))
            q, k, v = (torch.randn(shp(n), device="cuda", dtype=dtype, generator=g) for n in (n_q, n_k, n_k))
            o, lse = run_tc(cfg, q, k, v, causal, layout)
            canon = (lambda x: x) if layout == "bhsd" else (lambda x: x.swapaxes(1, 2))
            qb, kb, vb, ob = (canon(x) for x in (q, k, v, o))
            r, rl = ref(qb, kb, vb, causal)
            naive, _ = ref(qb, kb, vb, causal, dtype)
            err = (ob.double() - r).abs().max().item()
            nerr = (naive.double() - r).abs().max().item()
            seen = torch.isfinite(rl)  # rows that see no key: lse must be -inf there
            lerr = (lse.double() - rl)[seen].abs().max().item() if seen.any() else 0.0
            lerr = lerr if bool((lse[~seen] == -math.inf).all()) else math.inf
            ok = math.isfinite(err) and err <= 2 * nerr + 1e-5 and lerr < 1e-3 and not torch.isnan(o).any()
            worst = max(worst, err / max(nerr, 1e-9))
            if not ok:
                failures += 1
                log(f"FAIL {cfg} {n_q}x{n_k} causal={causal} {layout}: err {err:.2e} naive {nerr:.2e} lse {lerr:.2e}")
        log(f"check {tag(cfg)} D{cfg.head_dim} {cfg.input_kind}: worst err/naive {worst:.2f}")
    return failures


#: GPU cycles of ``torch.cuda._sleep`` queued before each timed call (about 0.5 ms on the H200): the host
#: launches the call while the GPU still spins, so the events time the kernels back to back, not the host's
#: launch latency (which differs between SDPA's dispatcher and nbflash's launcher).
SLEEP_CYCLES = 1_000_000


def cuda_times_ms(fn, n_sets, reps=10, warmup=3):
    """``reps`` CUDA-event timings (ms) of ``fn(i)``, input set i rotating, after ``warmup`` calls."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        fn(r % n_sets)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def cuda_time_ms(fn, n_sets, reps=30, warmup=3):
    """The median of :func:`cuda_times_ms`."""
    return statistics.median(cuda_times_ms(fn, n_sets, reps, warmup))


def capped_grid(launch, factor: int):
    """``launch`` with a persistent grid of at most ``factor`` blocks per multiprocessor (one block still runs per
    multiprocessor at a time, so each takes about 1 / ``factor`` of the items a persistent block takes): how the
    cost of a persistent block depends on the number of items it runs in turn."""
    def run(*args, **kwargs):
        sms = W.multiprocessor_count
        W.multiprocessor_count = lambda: factor * sms()
        try:
            return launch(*args, **kwargs)
        finally:
            W.multiprocessor_count = sms
    return run


def time_row(sets, causal, fl, cfgs, rounds=3, reps=10, grid_factors=()):
    """TFLOP/s of SDPA flash, SDPA cuDNN and each tensor-core configuration on the same input sets (persistent
    wgmma configurations also with their grid capped at each of ``grid_factors`` blocks per multiprocessor,
    tagged ``-g<factor>``).

    The providers take turns: ``rounds`` rounds of ``reps`` calls each, so a drift of the GPU's clock or
    temperature during the row falls on all of them alike; each figure is the median of its
    ``rounds · reps`` timings.
    """
    b, h, n, d = sets[0][0].shape
    calls = {}
    for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(i, be=be):
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(*sets[i], is_causal=causal)
        calls[name] = sdpa
    outs = [(torch.empty_like(s[0]), torch.empty(b, h, n, device="cuda")) for s in sets]
    cargs = [tuple(as_cupy(x) for x in (*s, *o)) for s, o in zip(sets, outs, strict=True)]
    for cfg in cfgs:
        launch = launcher(cfg)
        calls[f"nb-{tag(cfg)}"] = lambda i, cfg=cfg, launch=launch: launch(cfg, *cargs[i], 1 / math.sqrt(d), causal)
        for f in grid_factors if getattr(cfg, "persistent", False) else ():
            capped = capped_grid(launch, f)
            calls[f"nb-{tag(cfg)}-g{f}"] = lambda i, cfg=cfg, capped=capped: capped(cfg, *cargs[i], 1 / math.sqrt(d),
                                                                                   causal)
    samples = {name: [] for name in calls}
    failed = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            if name in failed:
                continue
            try:
                samples[name] += cuda_times_ms(fn, len(sets), reps)
            except Exception as e:  # a backend that cannot run here says why
                failed[name] = type(e).__name__
    return {name: failed.get(name) or fl / statistics.median(samples[name]) / 1e9 for name in calls}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument(
        "--configs",
        help="only these candidates, by tag (e.g. 64x64,128x64s/2,128x64s/2-split) or name (default, default-split); "
        "no check-only dims",
    )
    ap.add_argument("--suffix", default="", help="appended to the JSON's file name")
    ap.add_argument("--shapes", default="",
                    help="time these batch x heads x N (e.g. 8x32x2048,1x256x2048) instead of --seqlens at "
                         "batch·N = 16k, heads·D = 2048")
    ap.add_argument("--grid-factors", default="",
                    help="also time each persistent candidate with at most this many blocks per multiprocessor "
                         "(e.g. 2,4: a block takes a half, a quarter of the items in turn)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="compile the candidates first in this many processes (through the disk cache)")
    ap.add_argument("--compile-part", help=argparse.SUPPRESS)  # i/n: compile every n-th candidate from i, and exit
    args = ap.parse_args()
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[s] for s in args.dtypes.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",") if x]
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    except ValueError:
        shapes = [()]
    try:
        grid_factors = [int(x) for x in args.grid_factors.split(",") if x]
    except ValueError:
        grid_factors = [0]
    if not all(f > 0 for f in grid_factors):
        ap.error(f"--grid-factors: expected positive integers, comma-separated (e.g. 2,4), got {args.grid_factors!r}")
    if not all(len(s) == 3 and min(s) > 0 for s in shapes):
        ap.error(f"--shapes: expected batch x heads x N, comma-separated (e.g. 8x32x2048), got {args.shapes!r}")
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    env = environment()
    log(json.dumps(env))
    kinds = [KIND[dt] for dt in dtypes]
    if args.configs:
        wanted = set(args.configs.split(","))
        cfgs = select(dims, kinds, wanted)
        known = {tag(c) for c in select(dims, kinds)} | set(NAMED)
        if wanted - known:
            ap.error(f"--configs: no candidate {sorted(wanted - known)} at D = {dims}; known: {sorted(known)}")
    else:
        cfgs = select(dims, kinds)
        cfgs += [T.choose_config(d, k) for d in CHECK_ONLY if d not in dims for k in kinds]
        cfgs += [W.choose_config(d, k) for d in CHECK_ONLY if d not in dims for k in kinds]
    if args.compile_part:  # a --jobs worker: its share of the candidates, into the disk cache
        i, n = (int(x) for x in args.compile_part.split("/"))
        cfgs = cfgs[i::n]
    elif args.jobs > 1:
        t0 = time.perf_counter()
        codes = compile_in_processes(__file__, args.jobs)
        log(f"compiled in {args.jobs} processes in {time.perf_counter() - t0:.0f} s (exit codes {codes})")
    compiled = []
    for cfg in cfgs:
        t0 = time.perf_counter()
        try:
            dt = next(d for d, k in KIND.items() if k == cfg.input_kind)
            x = torch.randn(1, 1, 64, cfg.head_dim, device="cuda", dtype=dt)
            run_tc(cfg, x, x, x, False)
            torch.cuda.synchronize()
        except Exception as e:  # a configuration that cannot compile or launch is reported, not fatal
            log(f"{cfg}: {type(e).__name__}: {e}")
            continue
        if not args.no_check:
            try:  # the check's bshd cases are strided views, another compiled kernel (Numba types them layout "A")
                y = torch.randn(1, 64, 2, cfg.head_dim, device="cuda", dtype=dt)
                run_tc(cfg, y, y, y, False, "bshd")
                torch.cuda.synchronize()
            except Exception as e:  # reported; the check then says whether the candidate runs there
                log(f"{cfg} (bshd): {type(e).__name__}: {e}")
        mod = module(cfg)
        disp = mod.forward_wgmma_kernel(cfg) if mod is W else T.forward_tc_kernel(cfg)
        kern = next(iter(disp.overloads.values()))
        info = {a: getattr(kern, a, None) for a in ("regs_per_thread", "local_mem_per_thread", "shared_mem_per_block")}
        name = f"{tag(cfg)} D{cfg.head_dim} {cfg.input_kind}"
        log(f"compiled {name} in {time.perf_counter() - t0:.1f} s: {info} dynamic smem {mod.shared_bytes(cfg)}")
        compiled.append((cfg, info))
    if args.compile_part:
        return
    if not args.no_check:
        fails = check(log, [c for c, _ in compiled], dtypes)
        log(f"correctness failures: {fails}")

    results = []
    for d in dims:
        for dt in dtypes:
            for causal in (False, True):
                for b, h, n in shapes or [(max(1, 16384 // n), 2048 // d, n) for n in seqlens]:
                    sets = [tuple(torch.randn(b, h, n, d, device="cuda", dtype=dt) for _ in range(3)) for _ in range(3)]
                    fl = 4.0 * b * h * n * n * d / (2 if causal else 1)
                    row = {"dtype": str(dt).split(".")[-1], "D": d, "causal": causal, "N": n, "B": b, "H": h}
                    row.update(
                        time_row(
                            sets, causal, fl, [c for c, _ in compiled if c.head_dim == d and c.input_kind == KIND[dt]],
                            grid_factors=grid_factors,
                        )
                    )
                    results.append(row)
                    log(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name().replace(" ", "-")
    path = os.path.join(args.out, f"tc-forward-{dev}-{datetime.date.today()}{args.suffix}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "environment": env,
                "configs": [{"cfg": str(c), **i} for c, i in compiled],
                "results": results,
                "log": lines,
            },
            f,
            indent=1,
        )
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
