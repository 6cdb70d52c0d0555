"""Candidate tile configurations of the fp32 SIMT kernels, forward and backward, checked then timed next to SDPA.

One GPU run of about four minutes (compilation included: 10–20 s per configuration) answers "which
configuration meets the target?" (forward ≥ 25, backward ≥ 20 TFLOP/s at N ≥ 2k)::

    python benchmarks/fp32_candidates.py --suffix=-try1              # the default plan (DEFAULT_PLAN)
    python benchmarks/fp32_candidates.py --candidates fwd/64/128x32/8x16/mb2/il --seqlens 2048
    python benchmarks/fp32_candidates.py --list                      # the plan only; no GPU
    python benchmarks/fp32_candidates.py --compile-only              # registers and spills for sm_90; no GPU
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/fp32_candidates.py --smoke   # the whole pipeline, in the simulator

**Candidates** are written ``/``-separated; flags apply to the tile just before them::

    fwd/D/default                          the forward configuration the API picks for head dim D
    fwd/D/BMxBN/TXxTY[/mbN][/il][/lf]      BLOCK_M × BLOCK_N, THREADS_X × THREADS_Y
    bwd/D/default                          the backward configurations the API picks
    bwd/D/kvKEYSxQUERIES/TXxTY[xG][/mbN][/il][/lf][/dqQUERIESxKEYS/TXxTY[/mbN][/il][/lf]]

    mbN  launch bounds asking for N resident blocks per SM     il  head-dim columns in 16-byte runs
    lf   every head's longest tile first (grid order)           xG  G thread groups (dK/dV kernel: 1 or 2)
    as   tiles copied by cp.async (``async_copy``), the API's choice for aligned float32

``fwd/D/default`` and ``bwd/D/default`` are what the API runs on these contiguous float32 inputs: where D is a
multiple of 4 the forward takes ``as``/``lf`` (:func:`nbflash.forward.with_copies`), the backward ``as`` on
both tiles, with ``mb3`` at D ≤ 64 (:func:`nbflash.backward.with_copies`, :func:`~nbflash.backward.async_variant`).
To time a backward with plain loads against its cp.async variant, spell the tiles out::

    bwd/64/kv64x32/16x8/dq64x32/16x8            plain loads (the default before cp.async)
    bwd/64/kv64x32/16x8/as/mb3/dq64x32/16x8/as/mb3   = bwd/64/default

A backward candidate without ``dq…`` keeps the API's dQ tile (it only matters with ``--deterministic``):
with ``as`` on the dK/dV tile, the API's cp.async dQ tile.

**Shapes** (FlashAttention's benchmark): batch·N = ``--tokens`` (16k), heads·D = ``--width`` (2048),
N in ``--seqlens`` (2048, 8192), causal and not; the head dims are the candidates' own.

**Per candidate and shape:** one call on outputs poisoned with NaN, compared (batch 0, the first two
heads) with float64 attention, its gradients by autograd; the fp32 rule: max |error| ≤ 2e-5 · (1 +
max |reference|), or at most twice the error of the same formula computed naively in fp32.  Only a
candidate that passes is timed: median of CUDA-event timings after warm-up (about ``--target-ms`` of
work, 3–20 calls).  The backward is the API's default route (atomic dQ); ``--deterministic`` adds the
dQ kernel route.  TFLOP/s count 4·B·H·N²·D for the forward, 2.5× that for the backward; causal halves.
PyTorch SDPA's efficient kernel (fp32) is timed first, forward and backward, at the same shapes.

Output: ``<out>/fp32-candidates-<device>-<date><suffix>.json``, rewritten after every candidate
(a run cut short keeps what it measured), and a summary table.  Candidates not started within
``--budget-s`` seconds of the start are listed as skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

if "--compile-only" in sys.argv:  # compile offline with the real numba-cuda, whatever the machine
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's nbflash, not an installed one

from nbflash import backward as bw  # noqa: E402
from nbflash import forward as fw  # noqa: E402
from nbflash._device import SIMULATOR  # noqa: E402
from nbflash._tiles import TileConfig, pad_head_dim  # noqa: E402

#: The default plan, most important first (the budget cuts from the end).  Backward at D = 128 is
#: the largest miss: two thread groups on 64 × 64 tiles, against the API's 32 × 32.
DEFAULT_PLAN = (
    "bwd/128/kv64x64/16x8x2/il",
    "fwd/128/128x64/16x16/il",
    "bwd/128/default",
    "fwd/64/128x32/8x16/mb2/il",
    "bwd/128/kv64x32/16x8x2/il",
    "fwd/64/default",
    "bwd/128/kv64x64/16x16/il",
    "fwd/128/default",
    "bwd/128/kv64x64/16x8x2/il/lf",
    "bwd/64/default",
    "fwd/64/128x32/8x16/mb2/il/lf",
    "fwd/128/128x64/16x16/il/lf",
    "bwd/128/kv64x64/16x8x2",
    "bwd/128/kv64x32/16x8/il",
)
#: --smoke: configurations small enough for the simulator (a Python thread per CUDA thread).
SMOKE_PLAN = (
    "fwd/32/default", "fwd/32/8x8/4x2/il/lf", "fwd/32/8x8/4x2/as", "bwd/32/default", "bwd/32/kv8x8/4x2x2/il/as",
    "bwd/32/kv8x8/4x2x2/il/lf",
)
TARGET_TFLOPS = {"forward": 25.0, "backward": 20.0}
FLOP_FACTOR = {"forward": 1.0, "backward": 2.5}


# ----------------------------------------------------------------------------
# Candidates
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One configuration to check and time: ``kind`` is "fwd" (a TileConfig) or "bwd" (a BackwardConfig)."""

    spec: str
    kind: str
    head_dim: int
    config: Any


_TILE = re.compile(r"^(kv|dq)?(\d+)x(\d+)$")
_THREADS = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?$")


def _tile_fields(tokens: list[str], spec: str) -> tuple[str, dict, list[str]]:
    """Parse ``[kv|dq]AxB/TXxTY[xG][/flags]`` off the front of ``tokens``: (prefix, fields, rest)."""
    if len(tokens) < 2:
        raise ValueError(f"{spec!r}: a tile needs its size and its threads (AxB/TXxTY)")
    tile, threads = _TILE.match(tokens[0]), _THREADS.match(tokens[1])
    if not tile or not threads:
        raise ValueError(f"{spec!r}: cannot read tile {tokens[0]!r} / threads {tokens[1]!r}")
    fields = dict(a=int(tile.group(2)), b=int(tile.group(3)), threads_x=int(threads.group(1)),
                  threads_y=int(threads.group(2)), groups=int(threads.group(3) or 1))
    rest = tokens[2:]
    while rest and not _TILE.match(rest[0]):
        flag = rest.pop(0)
        if flag == "il":
            fields["interleave"] = True
        elif flag == "lf":
            fields["longest_first"] = True
        elif flag == "as":
            fields["async_copy"] = True
        elif re.fullmatch(r"mb\d+", flag):
            fields["min_blocks"] = int(flag[2:])
        else:
            raise ValueError(f"{spec!r}: unknown flag {flag!r} (mbN, il, lf, as)")
    return tile.group(1) or "", fields, rest


def _pad_step(fields: dict) -> int:
    """The multiple the head dim is padded to for a tile (TileConfig's rule)."""
    return fields["threads_x"] * fields.get("groups", 1) * (4 if fields.get("interleave") else 1)


def parse_candidate(spec: str, simulator: bool = SIMULATOR) -> Candidate:
    """A :class:`Candidate` from its spec string (grammar in the module docstring)."""
    tokens = [t for t in spec.strip().split("/") if t]
    if len(tokens) < 3 or tokens[0] not in ("fwd", "bwd") or not tokens[1].isdigit():
        raise ValueError(f"{spec!r}: expected fwd/D/... or bwd/D/...")
    kind, head_dim, rest = tokens[0], int(tokens[1]), tokens[2:]
    if rest == ["default"]:
        if kind == "bwd":
            return Candidate(spec, kind, head_dim, _api_backward(head_dim, simulator))
        cfg = fw.choose_config(head_dim, "float32", simulator=simulator)
        # What the API runs on these (contiguous, aligned) inputs: cp.async copies where rows are 16-byte chunks.
        aligned = head_dim % 4 == 0
        return Candidate(spec, kind, head_dim, dataclasses.replace(cfg, async_copy=aligned, longest_first=aligned))
    prefix, first, rest = _tile_fields(rest, spec)
    if kind == "fwd":
        if prefix or rest:
            raise ValueError(f"{spec!r}: a forward candidate is one tile, BMxBN/TXxTY[/flags]")
        bm, bn = first.pop("a"), first.pop("b")
        d_pad = pad_head_dim(head_dim, _pad_step(first))
        return Candidate(spec, kind, head_dim, TileConfig(bm, bn, d_pad, input_kind="float32", **first))
    if prefix != "kv":
        raise ValueError(f"{spec!r}: a backward candidate starts with its dK/dV tile, kvKEYSxQUERIES")
    default_dq = bw.choose_config(head_dim, "float32", simulator=simulator).dq
    if first.get("async_copy"):
        default_dq = bw.async_variant(bw.choose_config(head_dim, "float32", simulator=simulator)).dq
    if rest:
        dq_prefix, second, rest = _tile_fields(rest, spec)
        if dq_prefix != "dq" or rest:
            raise ValueError(f"{spec!r}: after the dK/dV tile only a dQ tile, dqQUERIESxKEYS/TXxTY[/flags]")
    else:
        second = dict(a=default_dq.block_m, b=default_dq.block_n, threads_x=default_dq.threads_x,
                      threads_y=default_dq.threads_y, async_copy=default_dq.async_copy,
                      min_blocks=default_dq.min_blocks)
    d_pad = pad_head_dim(head_dim, math.lcm(_pad_step(first), _pad_step(second)))
    keys, queries = first.pop("a"), first.pop("b")
    dkdv = TileConfig(queries, keys, d_pad, input_kind="float32", **first)  # block_m = queries, block_n = keys
    dq_m, dq_n = second.pop("a"), second.pop("b")
    dq = TileConfig(dq_m, dq_n, d_pad, input_kind="float32", **second)
    return Candidate(spec, kind, head_dim, bw.BackwardConfig(dkdv=dkdv, dq=dq))


def _api_backward(head_dim: int, simulator: bool) -> bw.BackwardConfig:
    """The backward configuration the API runs on contiguous float32 inputs of this head dim (aligned: the
    cp.async variant where the head dim is a multiple of 4 and it fits, as :func:`nbflash.backward.with_copies`)."""
    cfg = bw.choose_config(head_dim, "float32", simulator=simulator)
    if head_dim % 4:
        return cfg
    copies = bw.async_variant(cfg)
    ok, _ = _can_implement(Candidate("", "bwd", head_dim, copies))
    return copies if ok else cfg


def _can_implement(cand: Candidate) -> tuple[bool, str]:
    """The kernel module's own answer; without a GPU to ask (``--compile-only``), an H200's limits."""
    module = fw if cand.kind == "fwd" else bw
    try:
        return module.can_implement(cand.config)
    except Exception:  # no device to ask for its shared-memory limit
        tiles = [cand.config] if cand.kind == "fwd" else [cand.config.dkdv, cand.config.dq]
        smem = [fw.shared_bytes(cand.config)] if cand.kind == "fwd" else [
            bw.dkdv_shared_bytes(cand.config.dkdv), bw.dq_shared_bytes(cand.config.dq)]
        if max(smem) > 227 * 1024 or max(t.threads for t in tiles) > 1024:
            return False, f"shared memory {smem} bytes or {[t.threads for t in tiles]} threads exceed an H200's"
        return True, ""


def describe(cand: Candidate) -> dict[str, Any]:
    """Threads, shared memory and whether the configuration fits the device (227 KB per block on an H200)."""
    ok, why = _can_implement(cand)
    if cand.kind == "fwd":
        cfg = cand.config
        return dict(threads=cfg.threads, smem=fw.shared_bytes(cfg), head_dim_pad=cfg.head_dim_pad, fits=ok,
                    why=why, config=repr(cfg))
    kv, dq = cand.config.dkdv, cand.config.dq
    return dict(threads=kv.threads, dq_threads=dq.threads, smem=bw.dkdv_shared_bytes(kv),
                dq_smem=bw.dq_shared_bytes(dq), head_dim_pad=kv.head_dim_pad, fits=ok, why=why,
                config=repr(cand.config))


def shapes(tokens: int, width: int, head_dim: int, seqlens: list[int]) -> list[tuple[int, int, int]]:
    """(batch, heads, N) for each N: batch·N = tokens and heads·D = width (each at least 1)."""
    return [(max(tokens // n, 1), max(width // head_dim, 1), n) for n in seqlens]


def flops(pass_name: str, b: int, h: int, n: int, d: int, causal: bool) -> float:
    f = 4.0 * b * h * n * n * d * FLOP_FACTOR[pass_name]
    return f / 2 if causal else f


def error_bound(ref_max: float, naive_err: float) -> float:
    """The fp32 rule: 2e-5 · (1 + max |reference|), or twice the naive fp32 error if that is larger."""
    return max(2e-5 * (1.0 + ref_max), 2.0 * naive_err)


# ----------------------------------------------------------------------------
# Offline compilation (--compile-only): registers, spills and shared memory for sm_90
# ----------------------------------------------------------------------------


def compile_targets(cand: Candidate, deterministic: bool) -> list[tuple[str, TileConfig, Any, tuple]]:
    """(name, tile, kernel, signature) of the kernels a candidate launches."""
    if cand.kind == "fwd":
        return [("forward", cand.config, fw.forward_kernel(cand.config), fw.kernel_signature(cand.config))]
    kv, dq = cand.config.dkdv, cand.config.dq
    out = [("dkdv_atomic", kv, bw.dkdv_kernel(kv, True), bw.kernel_signature("dkdv_atomic", kv))]
    if deterministic:
        out += [("dkdv", kv, bw.dkdv_kernel(kv, False), bw.kernel_signature("dkdv", kv)),
                ("dq", dq, bw.dq_kernel(dq), bw.kernel_signature("dq", dq))]
    return out


def compile_offline(cand: Candidate, deterministic: bool) -> list[dict[str, Any]]:
    """Compile to PTX (NVVM) and link for sm_90 (nvJitLink runs ptxas): registers, spills, stack per kernel."""
    from nbflash._device import compile_ptx_offline, ptxas_info

    rows = []
    for name, tile, kern, sig in compile_targets(cand, deterministic):
        t0 = time.perf_counter()
        opts = dict(launch_bounds=(tile.threads, tile.min_blocks)) if tile.min_blocks else {}
        ptx = compile_ptx_offline(kern.py_func, sig, cc=(9, 0), fastmath=True, **opts)
        info = ptxas_info(ptx, "sm_90")  # nvJitLink runs ptxas; ImportError without cuda.bindings
        rows.append(dict(spec=cand.spec, kernel=name, regs=info["registers"], spill_bytes=info["spill_bytes"],
                         stack=info["stack_bytes"], threads=tile.threads,
                         seconds=round(time.perf_counter() - t0, 1)))
    return rows


# ----------------------------------------------------------------------------
# Running: the GPU (CuPy arrays, CUDA events) or the simulator (NumPy, wall clock)
# ----------------------------------------------------------------------------


class Runtime:
    """Arrays for nbflash, tensors for the references and SDPA, and a timer, on the GPU or in the simulator."""

    def __init__(self, simulator: bool):
        import torch

        self.torch = torch
        self.simulator = simulator
        if simulator:
            self.xp, self.device = np, torch.device("cpu")
        else:
            import cupy

            self.xp, self.device = cupy, torch.device("cuda", torch.cuda.current_device())
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references and naive errors in true fp32
            torch.backends.cudnn.allow_tf32 = False

    def array(self, t):
        """The array nbflash takes, sharing ``t``'s memory."""
        return t.numpy() if self.simulator else self.xp.from_dlpack(t)

    def tensor(self, a):
        torch = self.torch
        return torch.from_numpy(np.asarray(a)) if self.simulator else torch.from_dlpack(a)

    def sync(self) -> None:
        if not self.simulator:
            self.torch.cuda.synchronize(self.device)

    def time_ms(self, fn, target_ms: float) -> tuple[float, int]:
        """Median time of ``fn()`` in ms (CUDA events on the default stream), and how many calls were timed."""
        if self.simulator:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3, 1
        torch = self.torch
        fn()  # warm-up (the kernel is already compiled: the check ran it)
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        est_ms = (time.perf_counter() - t0) * 1e3
        reps = int(min(20, max(3, target_ms // max(est_ms, 1e-3))))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in events), reps


def _environment(rt: Runtime) -> dict[str, Any]:
    import numba

    commit = os.environ.get("NBFLASH_COMMIT", "")
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
            commit = out if len(out) == 40 else ""
        except OSError:
            pass
    try:
        import numba_cuda

        numba_cuda_version = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        numba_cuda_version = "?"
    env = dict(python=platform.python_version(), numba=numba.__version__, numba_cuda=numba_cuda_version,
               numpy=np.__version__,
               torch=rt.torch.__version__, commit=commit or "unknown", date=datetime.date.today().isoformat())
    if rt.simulator:
        return dict(device="simulator", **env)
    props = rt.torch.cuda.get_device_properties(rt.device)
    return dict(device=props.name, cc=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                cupy=rt.xp.__version__, torch_cuda=rt.torch.version.cuda, **env)


class Workload:
    """Inputs, nbflash's forward state and float64 references per (D, N, causal), made once and shared."""

    def __init__(self, rt: Runtime, tokens: int, width: int, check_heads: int = 2):
        self.rt, self.tokens, self.width, self.check_heads = rt, tokens, width, check_heads
        self._inputs: dict = {}
        self._state: dict = {}
        self._refs: dict = {}

    def inputs(self, d: int, b: int, h: int, n: int) -> dict[str, Any]:
        """Standard-normal q, k, v, do: torch tensors ``t`` and nbflash arrays ``a`` sharing memory."""
        key = (d, b, h, n)
        if key not in self._inputs:
            self._inputs.clear()  # one shape at a time: the largest take over 1 GB each
            self._state.clear()
            torch = self.rt.torch
            gen = torch.Generator(device=self.rt.device).manual_seed(1000 * d + n)
            t = {name: torch.randn((b, h, n, d), generator=gen, device=self.rt.device)
                 for name in ("q", "k", "v", "do")}
            self._inputs[key] = dict(t=t, a={name: self.rt.array(x) for name, x in t.items()})
        return self._inputs[key]

    def forward_state(self, d: int, b: int, h: int, n: int, causal: bool):
        """``o`` and ``lse`` from the API's forward (the backward's inputs)."""
        import nbflash

        key = (d, b, h, n, causal)
        if key not in self._state:
            a = self.inputs(d, b, h, n)["a"]
            self._state[key] = nbflash.attention(a["q"], a["k"], a["v"], causal=causal, return_lse=True)
        return self._state[key]

    def reference(self, d: int, b: int, h: int, n: int, causal: bool) -> dict[str, Any]:
        """float64 o, dq, dk, dv of batch 0, the first heads; and the errors of the same formula in fp32."""
        key = (d, n, causal)
        if key not in self._refs:
            torch = self.rt.torch
            t = self.inputs(d, b, h, n)["t"]
            hs = min(self.check_heads, h)
            out = {}
            for dtype in (torch.float64, torch.float32):
                q, k, v = (t[name][:1, :hs].detach().to(dtype).clone().requires_grad_() for name in ("q", "k", "v"))
                o = _naive_attention(q, k, v, causal)
                grads = torch.autograd.grad(o, (q, k, v), t["do"][:1, :hs].to(dtype))
                out[dtype] = [x.detach().double() for x in (o, *grads)]
            ref, naive = out[torch.float64], out[torch.float32]
            self._refs[key] = {name: (r, float(r.abs().max()), float((f - r).abs().max()))
                               for name, r, f in zip(("o", "dq", "dk", "dv"), ref, naive, strict=True)}
        return self._refs[key]


def _naive_attention(q, k, v, causal: bool):
    """softmax(q kᵀ / √D) v, bottom-right causal, in the inputs' dtype."""
    import torch

    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + nk - nq, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def _check(rt: Runtime, wl: Workload, outputs: dict[str, Any], d, b, h, n, causal) -> tuple[bool, dict]:
    """Compare batch 0, the first heads of ``outputs`` (name → array) with the float64 reference."""
    refs = wl.reference(d, b, h, n, causal)
    hs = min(wl.check_heads, h)
    ok, report = True, {}
    for name, arr in outputs.items():
        ref, ref_max, naive_err = refs[name]
        got = rt.tensor(arr)
        finite = bool(rt.torch.isfinite(got).all())
        err = float((got[:1, :hs].double() - ref).abs().max())
        bound = error_bound(ref_max, naive_err)
        report[name] = dict(err=err, bound=bound, naive_err=naive_err, finite=finite)
        ok = ok and finite and err <= bound
    return ok, report


def _registers(kern) -> dict[str, Any]:
    """Registers and local memory per thread of a compiled dispatcher (empty in the simulator)."""
    try:
        overloads = list(kern.overloads.values())
        return dict(regs=[o.regs_per_thread for o in overloads],
                    local_bytes=[o.local_mem_per_thread for o in overloads])
    except Exception:  # the simulator's dispatchers compile nothing
        return {}


def measure_candidate(rt: Runtime, wl: Workload, cand: Candidate, args, log) -> list[dict[str, Any]]:
    """Check, then time, one candidate at every shape; a row per (shape, causal[, dQ route])."""
    rows = []
    d = cand.head_dim
    scale = 1.0 / math.sqrt(d)
    routes = [None] if cand.kind == "fwd" else ([False, True] if args.deterministic else [False])
    for b, h, n in shapes(args.tokens, args.width, d, args.seqlens):
        for causal in (False, True):
            a = wl.inputs(d, b, h, n)["a"]
            for deterministic in routes:
                xp = rt.xp
                row = dict(spec=cand.spec, pass_name="forward" if cand.kind == "fwd" else "backward",
                           head_dim=d, seqlen=n, batch=b, heads=h, causal=causal)
                if cand.kind == "fwd":
                    o, lse = xp.full(a["q"].shape, np.nan, np.float32), xp.full(a["q"].shape[:3], np.nan, np.float32)

                    def call(o=o, lse=lse, causal=causal):
                        fw.launch_forward(cand.config, a["q"], a["k"], a["v"], o, lse, scale, causal)

                    outputs = dict(o=o)
                    kern = fw.forward_kernel(cand.config)
                else:
                    row["route"] = "deterministic" if deterministic else "atomic"
                    o, lse = wl.forward_state(d, b, h, n, causal)
                    dq, dk, dv = (xp.full(a["q"].shape, np.nan, np.float32) for _ in range(3))

                    def call(o=o, lse=lse, dq=dq, dk=dk, dv=dv, causal=causal, det=deterministic):
                        bw.launch_backward(cand.config, a["q"], a["k"], a["v"], o, a["do"], lse, dq, dk, dv, scale,
                                           causal, deterministic=det)

                    outputs = dict(dq=dq, dk=dk, dv=dv)
                    kern = bw.dkdv_kernel(cand.config.dkdv, not deterministic)
                try:
                    t0 = time.perf_counter()
                    call()
                    rt.sync()
                    row["first_call_s"] = round(time.perf_counter() - t0, 2)
                    ok, row["check"] = _check(rt, wl, outputs, d, b, h, n, causal)
                    row["ok"] = ok
                    row.update(_registers(kern))
                    if ok:
                        ms, reps = rt.time_ms(call, args.target_ms)
                        row.update(ms=ms, reps=reps, tflops=flops(row["pass_name"], b, h, n, d, causal) / ms / 1e9)
                except Exception as exc:  # report it and go on with the next shape
                    row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                rows.append(row)
                log(_row_line(row))
                del outputs, call
    return rows


def measure_sdpa(rt: Runtime, wl: Workload, dims: list[int], args, log) -> list[dict[str, Any]]:
    """PyTorch SDPA's efficient kernel in fp32, forward and backward (autograd), at every shape."""
    torch = rt.torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    rows = []
    for d in dims:
        for b, h, n in shapes(args.tokens, args.width, d, args.seqlens):
            t = wl.inputs(d, b, h, n)["t"]
            for causal in (False, True):
                base = dict(spec="sdpa-efficient", head_dim=d, seqlen=n, batch=b, heads=h, causal=causal)
                try:
                    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                        def fwd(t=t, causal=causal):
                            return F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=causal)

                        ms, reps = rt.time_ms(fwd, args.target_ms)
                        rows.append(dict(base, pass_name="forward", ms=ms, reps=reps, ok=True,
                                         tflops=flops("forward", b, h, n, d, causal) / ms / 1e9))
                        log(_row_line(rows[-1]))
                        xq, xk, xv = (t[name].detach().clone().requires_grad_() for name in ("q", "k", "v"))
                        out = F.scaled_dot_product_attention(xq, xk, xv, is_causal=causal)

                        def bwd(out=out, xq=xq, xk=xk, xv=xv, do=t["do"]):
                            return torch.autograd.grad(out, (xq, xk, xv), do, retain_graph=True)

                        ms, reps = rt.time_ms(bwd, args.target_ms)
                        rows.append(dict(base, pass_name="backward", ms=ms, reps=reps, ok=True,
                                         tflops=flops("backward", b, h, n, d, causal) / ms / 1e9))
                        log(_row_line(rows[-1]))
                        del out, xq, xk, xv
                except Exception as exc:
                    rows.append(dict(base, pass_name="forward+backward", ok=False,
                                     error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    log(_row_line(rows[-1]))
    return rows


def _row_line(row: dict[str, Any]) -> str:
    what = f"{row['pass_name']:8s} D={row['head_dim']:3d} N={row['seqlen']:5d} causal={row['causal']!s:5}"
    route = f" {row['route']}" if "route" in row else ""
    if "error" in row:
        return f"{what} {row['spec']}{route}: ERROR {row['error']}"
    errs = ""
    if "check" in row:
        worst = max(row["check"].values(), key=lambda c: c["err"] / c["bound"])
        errs = f" err {worst['err']:.1e} (bound {worst['bound']:.1e})"
    if not row.get("ok"):
        return f"{what} {row['spec']}{route}: FAILED CHECK{errs}"
    regs = f" regs={row['regs']}" if row.get("regs") else ""
    return f"{what} {row['spec']}{route}: {row['ms']:8.3f} ms {row['tflops']:6.2f} TFLOP/s{errs}{regs}"


def _json_safe(x: Any) -> Any:
    """NaN and infinities (a failed check's error) as strings: strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per (pass, D, N, causal): the default configuration, the best candidate, SDPA, and the target."""
    lines = [f"{'pass':8s} {'D':>3s} {'N':>5s} {'causal':6s} | {'default':>7s} | {'best':>6s} {'candidate':40s} | "
             f"{'sdpa':>6s} | target"]
    keys = sorted({(r["pass_name"], r["head_dim"], r["seqlen"], r["causal"]) for r in rows if "tflops" in r})
    for key in keys:
        pass_name, d, n, causal = key
        same = [r for r in rows if (r["pass_name"], r["head_dim"], r["seqlen"], r["causal"]) == key
                and "tflops" in r and r.get("route", "atomic") == "atomic"]
        nb = [r for r in same if r["spec"] != "sdpa-efficient"]
        default = next((r["tflops"] for r in nb if r["spec"].endswith("/default")), None)
        best = max(nb, key=lambda r: r["tflops"], default=None)
        sdpa = next((r["tflops"] for r in same if r["spec"] == "sdpa-efficient"), None)
        target = TARGET_TFLOPS.get(pass_name, 0.0)
        met = "met" if best and best["tflops"] >= target else "missed"

        def f(x, width):
            return f"{x:{width}.2f}" if x is not None else "n/a".rjust(width)

        lines.append(f"{pass_name:8s} {d:3d} {n:5d} {causal!s:6s} | {f(default, 7)} | "
                     f"{f(best['tflops'] if best else None, 6)} {(best['spec'] if best else ''):40s} | "
                     f"{f(sdpa, 6)} | {met} ({target:g})")
    return lines


def output_path(out_dir: str, device: str, date: str, suffix: str) -> str:
    return os.path.join(out_dir, f"fp32-candidates-{re.sub(r'[^A-Za-z0-9_.-]+', '-', device)}-{date}{suffix}.json")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--candidates", default=None, help="comma-separated specs (default: DEFAULT_PLAN)")
    ap.add_argument("--add", action="append", default=[], help="one more spec after the plan (repeatable)")
    ap.add_argument("--seqlens", default="2048,8192")
    ap.add_argument("--tokens", type=int, default=16384, help="batch · N")
    ap.add_argument("--width", type=int, default=2048, help="heads · D")
    ap.add_argument("--deterministic", action="store_true", help="also time the backward's dQ-kernel route")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--target-ms", type=float, default=300.0, help="about this much timed work per point")
    ap.add_argument("--budget-s", type=float, default=225.0, help="start no candidate after this many seconds")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--suffix", default="", help="appended to the JSON's name, e.g. -try1")
    ap.add_argument("--list", action="store_true", help="print the plan (configurations, shared memory) and stop")
    ap.add_argument("--compile-only", action="store_true", help="compile each candidate for sm_90 offline: "
                    "registers, spills (no GPU needed)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and SMOKE_PLAN (for the simulator)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.width = min(args.tokens, 40), min(args.width, 64)
        if args.seqlens == "2048,8192":
            args.seqlens = "13,20"
    args.seqlens = [int(x) for x in args.seqlens.split(",") if x]
    plan = SMOKE_PLAN if args.smoke else DEFAULT_PLAN
    args.specs = [s for s in (args.candidates.split(",") if args.candidates else plan) if s] + args.add
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cands = [parse_candidate(s, simulator=args.smoke) for s in args.specs]  # a typo fails here, before any GPU work
    if args.list or args.compile_only:
        for c in cands:
            info = describe(c)
            print(f"{c.spec:45s} threads={info['threads']:4d} smem={info['smem'] / 1024:6.1f} KB "
                  f"D_PAD={info['head_dim_pad']} {'fits' if info['fits'] else 'DOES NOT FIT: ' + info['why']}")
            if args.compile_only:
                for r in compile_offline(c, args.deterministic):
                    print(f"    {r['kernel']:12s} regs={r['regs']} spill={r['spill_bytes']} stack={r['stack']} "
                          f"({r['seconds']} s)", flush=True)
        return 0
    if args.smoke and not SIMULATOR:
        print("--smoke runs in the simulator: set NUMBA_ENABLE_CUDASIM=1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rt = Runtime(SIMULATOR)
    wl = Workload(rt, args.tokens, args.width)
    env = _environment(rt)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    log(json.dumps(env))
    os.makedirs(args.out, exist_ok=True)
    path = output_path(args.out, env["device"], env["date"], args.suffix)
    settings = {k: v for k, v in vars(args).items() if k not in ("list", "compile_only")}
    result: dict[str, Any] = dict(environment=env, settings=settings, candidates={c.spec: describe(c) for c in cands},
                                  rows=[], skipped=[])

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - start, 1)
        with open(path, "w") as f:
            json.dump(_json_safe(result), f, indent=1, allow_nan=False, default=str)

    if not args.no_sdpa:
        result["rows"] += measure_sdpa(rt, wl, sorted({c.head_dim for c in cands}), args, log)
        save()
    for cand in cands:
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(cand.spec)
            log(f"skipped (budget {args.budget_s:g} s): {cand.spec}")
            continue
        info = result["candidates"][cand.spec]
        if not info["fits"]:
            log(f"{cand.spec}: does not fit: {info['why']}")
            continue
        t0 = time.perf_counter()
        result["rows"] += measure_candidate(rt, wl, cand, args, log)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        save()
    result["summary"] = summary(result["rows"])
    for line in result["summary"]:
        log(line)
    save()
    log(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
