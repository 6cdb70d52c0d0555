"""nbflash next to everything a user would pick instead: one GPU, one run, every figure written down.

    python benchmarks/bench.py                    # the full sweep on a CUDA GPU (needs CuPy and PyTorch)
    python benchmarks/bench.py --smoke            # a tiny run in Numba's CUDA simulator, on any CPU
    python benchmarks/plot.py RESULTS.json        # the plots again, from a committed JSON

**Providers** (:data:`PROVIDERS`; a later kernel is one more entry):

* ``nbflash-tc``: nbflash's tensor-core kernels (``mma.sync``; fp16/bf16; dQ by its own kernel, the
  default for them).
* ``nbflash-simt``: nbflash's fused SIMT kernels (fp32 arithmetic whatever the input dtype).
  fp16/fp32 go through the array API (:func:`nbflash.attention`, :func:`nbflash.attention_backward`)
  on ``cupy.from_dlpack`` views of the PyTorch inputs (zero copy); bf16, which CuPy lacks, through
  the PyTorch bridge's custom ops ``nbflash.torch.attention_fwd``/``attention_bwd`` (the same kernels).
  Its backward runs with the API's default (atomic dQ); ``nbflash-simt-det`` (not run by default) is
  the deterministic dQ kernel (``deterministic=True``; bf16 under ``torch.use_deterministic_algorithms``).
* ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``, ``sdpa-math``: PyTorch's
  ``scaled_dot_product_attention`` forced to one backend with ``torch.nn.attention.sdpa_kernel``;
  gradients by autograd.
* ``naive``: matmul → softmax → matmul in CuPy (NumPy in the simulator), the N×N matrices in memory;
  softmax in float32 for fp16 inputs, as ``torch.softmax`` does; a hand-written backward from the saved P.

A provider that cannot run a configuration records why ("flash: no fp32 support", an out-of-memory
error, SDPA's own reason) instead of leaving a gap.

**Passes**: ``forward``; ``backward`` — the forward's saved state (nbflash: ``o`` and ``lse``; SDPA:
the autograd graph; naive: ``o`` and P) is built first and only the backward call is timed;
``fwd+bwd``.  dtypes fp16, bf16, fp32; head dims 64 and 128; causal and not; by default
N = 512 … 16k with batch·N = 16k and heads·D = 2048 (FlashAttention's benchmark shapes).

**Correctness first.**  Each provider × pass × configuration is run once at batch 1, 2 heads and
N ≤ ``--check-seqlen`` and compared with float64 attention (its gradients by autograd).  The bound is
flash-attn's: at most twice the error of the naive formula computed in the input dtype, plus twice the
dtype's rounding at the output's size.  A provider that fails is marked ``failed-check`` and not timed.

**Figures** (``docs/benchmarks.md`` explains each):

* ms — median over many calls (``--min-reps`` … ``--max-reps``, about ``--target-ms`` of work) of
  CUDA-event timings, after warm-up.  Before each call the GPU spins (``torch.cuda._sleep``) for twice
  the call's host time, so the host's launch overhead stays out of the device timing; inputs rotate
  among ``--sets`` (≥ 3) independent sets so that L2 cannot keep them between calls.
* TFLOP/s — 4·B·H·N²·D for the forward, 2.5× that for the backward, 3.5× for both; causal halves.
* % of ceilings measured in the same run: device-to-device copy, fp32 sgemm (TF32 off: the SIMT
  ceiling), fp16 and bf16 matmul (tensor cores).  ``pct_peak`` compares with the matmul of the input
  dtype, ``pct_sgemm`` with sgemm (what nbflash's SIMT kernels can reach at most).
* peak extra memory — ``torch.cuda.max_memory_allocated`` during one call minus what was allocated
  before it (outputs and scratch; the inputs and saved state are not counted).  CuPy allocates through
  PyTorch's caching allocator here (``cupy.cuda.set_allocator``), so one counter sees every provider.
* host overhead — host time of one call at B=1, H=1, N=16, D=64 (median of ``--host-calls``), each
  provider through its own route and CuPy with its own memory pool.
* ``--ncu``: DRAM bytes read and written per call, from Nsight Compute, for nbflash and naive at the
  first selected configuration, next to the ideal fused count.

Output: tables in the terminal; ``<out>/<device>-<date>.json`` and ``.csv`` (environment, ceilings,
every row) and PNG plots (:mod:`plot`).  The JSON is rewritten after every configuration, and
``--resume`` continues an interrupted run into the same file.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tabulate import tabulate
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's nbflash, not an installed one

SCHEMA = 1
DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PASSES = ("forward", "backward", "fwd+bwd")
FLOP_FACTOR = {"forward": 1.0, "backward": 2.5, "fwd+bwd": 3.5}
OUTPUTS = {"forward": ("o",), "backward": ("dq", "dk", "dv"), "fwd+bwd": ("o", "dq", "dk", "dv")}
#: Saved forward state of the rotated input sets may take this much of the GPU's memory (at least one set).
STATE_MEMORY_FRACTION = 0.25
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum"
#: The columns of the CSV, in order (each row of the JSON's "results" has these keys and a few more).
CSV_FIELDS = (
    "provider", "pass", "dtype", "batch", "heads", "seqlen", "head_dim", "causal", "status", "reason",
    "ms", "ms_p10", "ms_p90", "reps", "sets", "tflops", "pct_peak", "pct_sgemm", "peak_mem_bytes",
    "host_us", "host_sync", "check_seqlen", "check_ratio", "device", "commit",
)  # fmt: skip


# ----------------------------------------------------------------------------
# What is measured
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measurement: a pass of attention at one shape, dtype and mask (layout bhsd, seqlen_q = seqlen_k)."""

    pass_name: str
    dtype: str
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    def flops(self) -> float:
        """4·B·H·N²·D for the forward (two matmuls of 2·N²·D each), 2.5× for the backward; causal halves."""
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.head_dim * FLOP_FACTOR[self.pass_name]
        return f / 2 if self.causal else f

    def key(self) -> tuple:
        return (self.pass_name, self.dtype, self.batch, self.heads, self.seqlen, self.head_dim, self.causal)


@dataclass
class Inputs:
    """One input set: ``q, k, v`` and the incoming gradient ``do``, all ``(B, H, N, D)`` in the config's dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor


def make_inputs(rt: Runtime, cfg: Config, count: int, seed: int = 0) -> list[Inputs]:
    """``count`` independent standard-normal input sets on the runtime's device."""
    gen = torch.Generator(device=rt.device).manual_seed(seed)
    return [
        Inputs(*(torch.randn(cfg.shape, generator=gen, device=rt.device, dtype=cfg.torch_dtype) for _ in range(4)))
        for _ in range(count)
    ]


# ----------------------------------------------------------------------------
# Runtimes: where kernels run, and how time and memory are measured there
# ----------------------------------------------------------------------------


class Runtime:
    """The GPU (CUDA events, PyTorch's allocator statistics) or, for ``--smoke``, the simulator on the CPU."""

    simulator: bool
    device: torch.device

    def sync(self) -> None:
        """Wait for all queued work."""

    def to_array(self, t: torch.Tensor) -> Any:
        """The array nbflash's array API takes, sharing ``t``'s memory (CuPy on the GPU, NumPy in the simulator)."""
        raise NotImplementedError

    def to_torch(self, x: Any) -> torch.Tensor:
        """A tensor sharing ``x``'s memory (a tensor is returned as it is)."""
        raise NotImplementedError

    def time_ms(self, call: Callable[[int], Any], n_sets: int, reps: int, host_s: float) -> list[float]:
        """Device time of ``call(r % n_sets)`` for ``r`` in ``range(reps)``, in milliseconds."""
        raise NotImplementedError

    def peak_extra_bytes(self, call: Callable[[int], Any]) -> int:
        """Peak memory allocated during ``call(0)`` beyond what was allocated before it."""
        raise NotImplementedError

    def blocks_host(self, key: tuple, call: Call) -> bool:
        """Does ``call(0)`` make the host wait for the GPU (cached by ``key``)?"""
        return False

    def allocated_bytes(self) -> int:
        return 0

    def state_budget(self) -> float:
        return math.inf

    def native_cupy_pool(self) -> contextlib.AbstractContextManager:
        """CuPy allocating from its own pool, as in a user's program (for the host-overhead figures)."""
        return contextlib.nullcontext()

    def free(self) -> None:
        gc.collect()

    def environment(self) -> dict[str, Any]:
        raise NotImplementedError


class GpuRuntime(Runtime):
    """CUDA: CuPy for the array API, PyTorch for everything else; one allocator (PyTorch's) for both."""

    simulator = False

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.device = torch.device("cuda", torch.cuda.current_device())
        # TF32 off: fp32 matmuls (sgemm ceiling, references, naive) run in true fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # Every CuPy allocation becomes a torch.empty: torch.cuda.max_memory_allocated sees all providers.
        cupy.cuda.set_allocator(self._torch_malloc)
        self.spin_cycles_per_s = self._calibrate_spin()
        self._blocks: dict[tuple, bool] = {}

    def _torch_malloc(self, nbytes: int):
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        # The CuPy memory holds `buf` (so the block) for as long as an array uses it.
        mem = self.cupy.cuda.UnownedMemory(buf.data_ptr(), nbytes, buf, self.device.index)
        return self.cupy.cuda.MemoryPointer(mem, 0)

    @staticmethod
    def _calibrate_spin() -> float:
        """Clock cycles per second of ``torch.cuda._sleep``, whose argument is in cycles."""
        cycles = 4_000_000
        torch.cuda._sleep(cycles)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e-3)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def to_array(self, t: torch.Tensor) -> Any:
        return self.cupy.from_dlpack(t)

    def to_torch(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)

    def time_ms(self, call: Callable[[int], Any], n_sets: int, reps: int, host_s: float) -> list[float]:
        spin = int(self.spin_cycles_per_s * max(2 * host_s, 50e-6))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        gc.disable()  # a collection inside the loop could outlast the spin
        try:
            for r, (start, end) in enumerate(events):
                # The GPU spins while the host queues start, the call and end: only device time is between them.
                torch.cuda._sleep(spin)
                start.record()
                call(r % n_sets)
                end.record()
            self.sync()
        finally:
            gc.enable()
        return [start.elapsed_time(end) for start, end in events]

    def blocks_host(self, key: tuple, call: Call) -> bool:
        """Queued behind a 20 ms spin, a call that returns within 10 ms did not wait for the GPU.

        A call that waits (a stream synchronisation on its path) leaves the GPU idle while the host
        finishes the launch, and no spin can hide that from its device time: the row is marked.
        """
        if key not in self._blocks:
            torch.cuda._sleep(int(self.spin_cycles_per_s * 0.02))
            t0 = time.perf_counter()
            out = call(0)
            self._blocks[key] = time.perf_counter() - t0 > 0.01
            del out
            self.sync()
        return self._blocks[key]

    def peak_extra_bytes(self, call: Callable[[int], Any]) -> int:
        self.sync()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        out = call(0)
        self.sync()
        peak = torch.cuda.max_memory_allocated(self.device)
        del out
        return peak - before

    def allocated_bytes(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def state_budget(self) -> float:
        return STATE_MEMORY_FRACTION * torch.cuda.get_device_properties(self.device).total_memory

    def native_cupy_pool(self) -> contextlib.AbstractContextManager:
        return self.cupy.cuda.using_allocator(self.cupy.get_default_memory_pool().malloc)

    def free(self) -> None:
        gc.collect()
        torch.cuda.empty_cache()

    def environment(self) -> dict[str, Any]:
        props = torch.cuda.get_device_properties(self.device)
        driver = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                           str(self.device.index)])
        return dict(
            device=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            driver=driver.splitlines()[0] if driver else str(self.cupy.cuda.runtime.driverGetVersion()),
            cuda_runtime=str(self.cupy.cuda.runtime.runtimeGetVersion()),
            torch_cuda=torch.version.cuda,
            cudnn=str(torch.backends.cudnn.version()),
            cupy=self.cupy.__version__,
            **_common_environment(),
        )


class SimulatorRuntime(Runtime):
    """Numba's CUDA simulator on the CPU: wall-clock times, output bytes for memory; proves the pipeline only."""

    simulator = True
    device = torch.device("cpu")

    def to_array(self, t: torch.Tensor) -> Any:
        return t.numpy()

    def to_torch(self, x: Any) -> torch.Tensor:
        return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)

    def time_ms(self, call: Callable[[int], Any], n_sets: int, reps: int, host_s: float) -> list[float]:
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            call(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def peak_extra_bytes(self, call: Callable[[int], Any]) -> int:
        """The outputs' bytes only: the simulator has no allocator statistics (tracemalloc would take minutes)."""
        return sum(self.to_torch(x).nbytes for x in call(0))

    def environment(self) -> dict[str, Any]:
        return dict(device="simulator", compute_capability="", driver="", cupy="", **_common_environment())


def _command(argv: Sequence[str], cwd: Path | None = None) -> str:
    """stdout of a command, or "" when it cannot run."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, cwd=cwd, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _common_environment() -> dict[str, Any]:
    import numba

    import nbflash

    try:
        from importlib.metadata import version

        numba_cuda = version("numba-cuda")
    except Exception:  # not installed as a distribution
        numba_cuda = "?"
    # A copy of the tree without .git (as on some GPU machines) says its commit through NBFLASH_COMMIT.
    in_git = _command(["git", "rev-parse", "--is-inside-work-tree"], cwd=ROOT) == "true"
    commit = os.environ.get("NBFLASH_COMMIT") or (_command(["git", "rev-parse", "HEAD"], cwd=ROOT) if in_git else "")
    dirty = bool(_command(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT)) if in_git else None
    return dict(
        nbflash=nbflash.__version__,
        commit=commit,
        commit_dirty=dirty,
        numba=numba.__version__,
        numba_cuda=numba_cuda,
        torch=torch.__version__,
        numpy=np.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        date=datetime.date.today().isoformat(),
        time=datetime.datetime.now().isoformat(timespec="seconds"),
    )


# ----------------------------------------------------------------------------
# Providers: one entry per implementation
# ----------------------------------------------------------------------------

#: ``call(i)`` runs the pass on input set ``i`` and returns its outputs (``OUTPUTS[pass]``, in order).
Call = Callable[[int], tuple]


@dataclass(frozen=True)
class Provider:
    """An attention implementation the benchmark can run.

    ``make_call(rt, cfg, sets)`` prepares everything a pass needs that is not timed (array views,
    the forward's saved state) and returns ``(call, n)``: ``call(i)`` runs the pass on input set
    ``i < n`` (``n`` may be smaller than ``len(sets)`` when the saved state is large, see
    :func:`saved_states`).  ``unsupported(cfg)`` says why a config cannot run, before trying.
    ``scope()`` is entered around everything (SDPA's backend choice).
    """

    name: str
    label: str
    family: str
    make_call: Callable[[Runtime, Config, list[Inputs]], tuple[Call, int]]
    unsupported: Callable[[Config], str | None] = lambda cfg: None
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    simt: bool = False  # computes in fp32 on the FMA units whatever the input dtype: compare with sgemm
    on_simulator: bool = False
    default: bool = True


def saved_states(rt: Runtime, n: int, build: Callable[[int], Any]) -> list[Any]:
    """``build(i)`` — the forward's saved state — for input sets ``0, 1, …`` while it fits in memory.

    At least one set; more while all of them stay within :data:`STATE_MEMORY_FRACTION` of the GPU.
    A naive provider saves an N×N matrix per set (tens of GB at N = 16k), and one that large is far
    beyond L2 anyway: rotating fewer sets flatters nothing.  The row records how many were rotated.
    """
    states: list[Any] = []
    base = rt.allocated_bytes()
    for i in range(n):
        states.append(build(i))
        used = rt.allocated_bytes() - base
        if used + used / len(states) > rt.state_budget():
            break
    return states


def _nbflash_call(deterministic: bool | None, backend: str) -> Callable[[Runtime, Config, list[Inputs]],
                                                                         tuple[Call, int]]:
    """nbflash's array API for fp16/fp32, its PyTorch ops for bf16, forced to ``backend`` ("simt",
    "tensor_core" or "wgmma"); ``deterministic=None``: the API's default dQ route for that backend."""

    def make_call(rt: Runtime, cfg: Config, sets: list[Inputs]) -> tuple[Call, int]:
        import nbflash

        if cfg.dtype == "bf16":  # CuPy and NumPy have no bfloat16: the PyTorch bridge's ops, same kernels
            import nbflash.torch as nbt

            def forward(q, k, v):
                return nbt.attention_fwd(q, k, v, cfg.causal, None, "bhsd", backend)

            def backward(do, q, k, v, o, lse):  # dQ variant: torch.are_deterministic_algorithms_enabled()
                return nbt.attention_bwd(do, q, k, v, o, lse, cfg.causal, None, "bhsd", backend)

            def view(t):
                return t
        else:
            flags = {"backend": backend} | ({} if deterministic is None else {"deterministic": deterministic})

            def forward(q, k, v):
                return nbflash.attention(q, k, v, causal=cfg.causal, return_lse=True, backend=backend)

            def backward(do, q, k, v, o, lse):
                return nbflash.attention_backward(do, q, k, v, o, lse, causal=cfg.causal, **flags)

            view = rt.to_array

        arrays = [tuple(view(t) for t in (s.q, s.k, s.v, s.do)) for s in sets]
        if cfg.pass_name == "forward":
            return (lambda i: forward(*arrays[i][:3])[:1]), len(sets)
        if cfg.pass_name == "backward":
            states = saved_states(rt, len(sets), lambda i: forward(*arrays[i][:3]))

            def call(i: int) -> tuple:
                q, k, v, do = arrays[i]
                return tuple(backward(do, q, k, v, *states[i]))

            return call, len(states)

        def call(i: int) -> tuple:
            q, k, v, do = arrays[i]
            o, lse = forward(q, k, v)
            return (o, *backward(do, q, k, v, o, lse))

        return call, len(sets)

    return make_call


def _nbflash_unsupported(
    variant: bool, tensor_core: bool = False, hopper: bool = False
) -> Callable[[Config], str | None]:
    """Why nbflash cannot run ``cfg``; ``variant``: a backward-only entry whose forward is nbflash-simt's;
    ``tensor_core``: the constraints of the tensor-core kernels (nbflash.which_backend has the full rule);
    ``hopper``: the wgmma kernels' (compute capability 9.x).  Both tensor-core backwards take every head dim
    that is a multiple of 8 up to 256 (above 128 in slices of 128 gradient columns)."""

    def unsupported(cfg: Config) -> str | None:
        import nbflash

        if cfg.pass_name != "forward" and not hasattr(nbflash, "attention_backward"):
            return "nbflash: this version has no attention_backward"
        if variant and cfg.pass_name == "forward":
            return "nbflash backward variant: its forward is nbflash-simt's"
        if cfg.head_dim > 256:
            return "nbflash: head dim > 256"
        if tensor_core:
            if cfg.dtype == "fp32":
                return "nbflash tensor cores: float16 and bfloat16 only"
            if cfg.head_dim % 8:
                return "nbflash tensor cores: head dim must be a multiple of 8"
            if hopper:
                cc = nbflash._device.compute_capability()
                if cc is None or cc[0] != 9:
                    return "nbflash wgmma: a Hopper GPU (compute capability 9.x) only"
        return None

    return unsupported


@contextlib.contextmanager
def _torch_deterministic() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for a block (warn-only: the references' matmuls still run)."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def autograd_call(attend: Callable[..., torch.Tensor], rt: Runtime, cfg: Config,
                  sets: list[Inputs]) -> tuple[Call, int]:
    """``make_call`` for any differentiable PyTorch attention ``attend(q, k, v) -> o``; gradients by autograd."""
    if cfg.pass_name == "forward":
        return (lambda i: (attend(sets[i].q, sets[i].k, sets[i].v),)), len(sets)
    leaves = [tuple(t.detach().requires_grad_() for t in (s.q, s.k, s.v)) for s in sets]
    if cfg.pass_name == "backward":
        outs = saved_states(rt, len(sets), lambda i: attend(*leaves[i]))
        return (lambda i: torch.autograd.grad(outs[i], leaves[i], sets[i].do, retain_graph=True)), len(outs)

    def call(i: int) -> tuple:
        o = attend(*leaves[i])
        return (o.detach(), *torch.autograd.grad(o, leaves[i], sets[i].do))

    return call, len(sets)


def _sdpa(backend: str) -> dict[str, Any]:
    """The fields of a provider for ``scaled_dot_product_attention`` forced to one backend."""
    short = {"FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn", "EFFICIENT_ATTENTION": "efficient",
             "MATH": "math"}[backend]

    def make_call(rt: Runtime, cfg: Config, sets: list[Inputs]) -> tuple[Call, int]:
        import torch.nn.functional as F

        return autograd_call(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal),
                             rt, cfg, sets)

    def unsupported(cfg: Config) -> str | None:
        if short in ("flash", "cudnn") and cfg.dtype == "fp32":
            return f"{short}: no fp32 support (fp16/bf16 only)"
        if short == "flash" and cfg.head_dim > 256:
            return "flash: head dim > 256"
        return None

    def scope() -> contextlib.AbstractContextManager:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, backend))

    return dict(name=f"sdpa-{short}", label=f"SDPA {short}", family="sdpa", make_call=make_call,
                unsupported=unsupported, scope=scope)


def naive_forward(q, k, v, causal: bool):
    """``(o, P)`` by matmul → softmax → matmul, materialising S and P (CuPy or NumPy arrays).

    Softmax in float32 for fp16 inputs (as ``torch.softmax`` computes internally); P is stored in the input
    dtype for the second matmul and the backward.
    """
    xp = _array_module(q)
    n, m = q.shape[-2], k.shape[-2]
    s = xp.matmul(q, k.swapaxes(-1, -2))
    if s.dtype == xp.float16:
        s = xp.multiply(s, q.shape[-1] ** -0.5, dtype=xp.float32)
    else:
        s *= q.shape[-1] ** -0.5
    if causal:  # square problems here: the lower triangle (bottom-right and top-left alignment agree)
        xp.copyto(s, -xp.inf, where=xp.arange(m)[None, :] > xp.arange(n)[:, None])
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    p = s.astype(q.dtype, copy=False)
    return xp.matmul(p, v), p


def naive_backward(do, q, k, v, o, p):
    """``(dq, dk, dv)`` from the saved P: dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = dS K, dK = dSᵀ Q."""
    xp = _array_module(q)
    half = q.dtype == xp.float16  # dS in float32, as torch's softmax backward computes it
    scale = q.shape[-1] ** -0.5
    dv = xp.matmul(p.swapaxes(-1, -2), do)
    dp = xp.matmul(do, v.swapaxes(-1, -2))
    delta = xp.multiply(do, o, dtype=xp.float32 if half else None).sum(-1, keepdims=True)
    if half:
        ds = xp.subtract(dp, delta, dtype=xp.float32)
    else:
        dp -= delta
        ds = dp
    ds *= p
    ds = ds.astype(q.dtype, copy=False)
    dq = xp.matmul(ds, k)
    dq *= scale
    dk = xp.matmul(ds.swapaxes(-1, -2), q)
    dk *= scale
    return dq, dk, dv


def _array_module(a):
    return np if isinstance(a, np.ndarray) else sys.modules["cupy"]


def _naive_call(rt: Runtime, cfg: Config, sets: list[Inputs]) -> tuple[Call, int]:
    arrays = [tuple(rt.to_array(t) for t in (s.q, s.k, s.v, s.do)) for s in sets]
    if cfg.pass_name == "forward":
        return (lambda i: naive_forward(*arrays[i][:3], cfg.causal)[:1]), len(sets)
    if cfg.pass_name == "backward":
        states = saved_states(rt, len(sets), lambda i: naive_forward(*arrays[i][:3], cfg.causal))

        def call(i: int) -> tuple:
            q, k, v, do = arrays[i]
            return naive_backward(do, q, k, v, *states[i])

        return call, len(states)

    def call(i: int) -> tuple:
        q, k, v, do = arrays[i]
        o, p = naive_forward(q, k, v, cfg.causal)
        return (o, *naive_backward(do, q, k, v, o, p))

    return call, len(sets)


#: Every implementation, in the order of tables and legends.  A new nbflash kernel is one more entry.
PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("nbflash-tc", "nbflash tensor cores", "nbflash", _nbflash_call(None, "tensor_core"),
                 _nbflash_unsupported(False, tensor_core=True), on_simulator=True),
        Provider("nbflash-wgmma", "nbflash wgmma (Hopper)", "nbflash", _nbflash_call(None, "wgmma"),
                 _nbflash_unsupported(False, tensor_core=True, hopper=True)),
        Provider("nbflash-simt", "nbflash SIMT", "nbflash", _nbflash_call(None, "simt"), _nbflash_unsupported(False),
                 simt=True, on_simulator=True),
        Provider("nbflash-simt-det", "nbflash SIMT, deterministic dQ", "nbflash", _nbflash_call(True, "simt"),
                 _nbflash_unsupported(True), scope=_torch_deterministic, simt=True, on_simulator=True, default=False),
        Provider(**_sdpa("FLASH_ATTENTION")),
        Provider(**_sdpa("CUDNN_ATTENTION")),
        Provider(**_sdpa("EFFICIENT_ATTENTION")),
        Provider(**_sdpa("MATH"), on_simulator=True),
        Provider("naive", "naive (CuPy)", "naive", _naive_call,
                 lambda cfg: "naive: CuPy has no bfloat16" if cfg.dtype == "bf16" else None, on_simulator=True),
    )
}


def select_providers(spec: str, rt: Runtime) -> list[Provider]:
    """``all``, ``default``, or a comma list of names and families (``nbflash`` = every nbflash-* entry)."""
    if spec in ("default", "all"):
        chosen = [p for p in PROVIDERS.values() if p.default or spec == "all"]
    else:
        chosen = []
        for word in spec.split(","):
            hits = [p for p in PROVIDERS.values() if word in (p.name, p.family)]
            if not hits:
                raise SystemExit(f"unknown provider {word!r}; known: {', '.join(PROVIDERS)} (or a family)")
            chosen += [p for p in hits if p not in chosen and (p.default or word == p.name)]
    if rt.simulator:
        chosen = [p for p in chosen if p.on_simulator]
    return chosen


# ----------------------------------------------------------------------------
# Correctness: each provider against float64 before it is timed
# ----------------------------------------------------------------------------


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """``softmax(Q Kᵀ / sqrt(D)) V`` materialised, in the tensors' dtype (square causal: lower triangle)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _outputs_with_grads(inp: Inputs, dtype: torch.dtype, causal: bool) -> dict[str, torch.Tensor]:
    q, k, v = (t.to(dtype).detach().requires_grad_() for t in (inp.q, inp.k, inp.v))
    o = naive_attention(q, k, v, causal)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), inp.do.to(dtype))
    return dict(o=o.detach(), dq=dq, dk=dk, dv=dv)


@dataclass
class Reference:
    """Check inputs, float64 outputs and gradients, and the error each output may have."""

    inputs: Inputs
    exact: dict[str, torch.Tensor]
    bound: dict[str, float]


def _max_abs(x: torch.Tensor) -> float:
    return float(x.abs().max()) if x.numel() else 0.0


#: Relative error every output may have whatever the naive formula achieves (fp32: the bound of tests/).
CHECK_FLOOR = {"fp32": 2e-5, "fp16": 1e-3, "bf16": 1e-3}


class Checker:
    """Runs each (provider, pass, dtype, D, causal) once at batch 1, 2 heads, N ≤ ``max_seqlen`` against float64.

    The flash-attn rule: an output may be off by at most twice the error of the naive formula in the
    input dtype, plus twice the dtype's rounding at the output's size (``(x + 0.3 − 0.3) − x``) but at
    least :data:`CHECK_FLOOR` ``· (1 + max |x|)`` — at tiny sizes fp32's naive error can be near zero
    by luck, and a different summation order is not a bug.
    """

    def __init__(self, rt: Runtime, max_seqlen: int):
        self.rt = rt
        self.max_seqlen = max_seqlen
        self.references: dict[tuple, Reference] = {}
        self.verdicts: dict[tuple, dict[str, Any]] = {}

    def shape_for(self, cfg: Config) -> Config:
        return dataclasses.replace(cfg, batch=1, heads=2, seqlen=min(cfg.seqlen, self.max_seqlen))

    def reference(self, cfg: Config) -> Reference:
        key = (cfg.dtype, cfg.head_dim, cfg.causal, cfg.seqlen)
        if key not in self.references:
            [inp] = make_inputs(self.rt, cfg, 1, seed=1234)
            exact = _outputs_with_grads(inp, torch.float64, cfg.causal)
            same = _outputs_with_grads(inp, cfg.torch_dtype, cfg.causal)
            bound = {}
            for name, x in exact.items():
                rounded = x.to(cfg.torch_dtype)
                atol = max(2 * _max_abs(((rounded + 0.3) - 0.3) - rounded), CHECK_FLOOR[cfg.dtype] * (1 + _max_abs(x)))
                bound[name] = 2 * _max_abs(same[name].double() - x) + atol
            self.references[key] = Reference(inp, exact, bound)
        return self.references[key]

    def check(self, provider: Provider, cfg: Config) -> dict[str, Any]:
        """``{"ok", "seqlen", "errors": {output: [err, bound]}, "ratio": max err/bound}``, cached."""
        small = self.shape_for(cfg)
        key = (provider.name, *small.key())
        if key not in self.verdicts:
            ref = self.reference(small)
            call, _ = provider.make_call(self.rt, small, [ref.inputs])
            outs = call(0)
            self.rt.sync()
            errors = {}
            for name, out in zip(OUTPUTS[cfg.pass_name], outs, strict=True):
                got = self.rt.to_torch(out).to(self.rt.device).double()
                err = _max_abs(got - ref.exact[name]) if torch.isfinite(got).all() else math.inf
                errors[name] = [err, ref.bound[name]]
            ratio = max(err / bound if bound > 0 else (0.0 if err == 0 else math.inf) for err, bound in errors.values())
            self.verdicts[key] = dict(ok=ratio <= 1.0, seqlen=small.seqlen, errors=errors, ratio=ratio)
            del call, outs
            self.rt.free()
        return self.verdicts[key]


# ----------------------------------------------------------------------------
# Measuring one provider on one config
# ----------------------------------------------------------------------------


@dataclass
class Timing:
    """How long and how often to measure."""

    sets: int = 3
    min_reps: int = 10
    max_reps: int = 100
    target_ms: float = 400.0


def warm_up(rt: Runtime, call: Call, n_sets: int) -> tuple[float, float]:
    """Run every input set once (compiles, settles caches); ``(host seconds, wall seconds)`` of one more call."""
    for i in range(n_sets):
        call(i)
    rt.sync()
    t0 = time.perf_counter()
    out = call(0)
    host = time.perf_counter() - t0
    rt.sync()
    wall = time.perf_counter() - t0
    del out
    return host, wall


def _short_error(exc: BaseException, caught: list[warnings.WarningMessage]) -> tuple[str, str]:
    """``(status, reason)`` for an exception raised while running a provider."""
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    low = str(exc).lower()
    if "out of memory" in low or "outofmemory" in type(exc).__name__.lower():
        return "oom", "out of memory: " + text[:160]
    if "no available kernel" in low:  # SDPA says why in its warnings
        why = [str(w.message).strip() for w in caught if not str(w.message).rstrip().endswith(":")]
        return "unsupported", ("; ".join(why) or text)[:240]
    return "error", text[:240]


def base_row(provider: Provider, cfg: Config) -> dict[str, Any]:
    return {
        "provider": provider.name, "label": provider.label, "family": provider.family, "simt": provider.simt,
        "pass": cfg.pass_name, "dtype": cfg.dtype, "batch": cfg.batch, "heads": cfg.heads, "seqlen": cfg.seqlen,
        "head_dim": cfg.head_dim, "causal": cfg.causal, "flops": cfg.flops(), "status": "", "reason": "",
    }  # fmt: skip


def measure(rt: Runtime, provider: Provider, cfg: Config, sets: list[Inputs], checker: Checker, timing: Timing,
            ceilings: dict[str, float]) -> dict[str, Any]:
    """One row: check, warm up, peak memory, then timed calls; or the reason it could not run."""
    row = base_row(provider, cfg)
    reason = provider.unsupported(cfg)
    if reason:
        return row | {"status": "unsupported", "reason": reason}
    call = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with provider.scope():
                verdict = checker.check(provider, cfg)
                row |= {"check_seqlen": verdict["seqlen"], "check_ratio": verdict["ratio"], "check": verdict["errors"]}
                if not verdict["ok"]:
                    worst = max(verdict["errors"].items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-300))
                    return row | {"status": "failed-check", "reason": f"{worst[0]} error {worst[1][0]:.2e} > bound "
                                  f"{worst[1][1]:.2e} at N={verdict['seqlen']}"}
                call, n_sets = provider.make_call(rt, cfg, sets)
                host_s, wall_s = warm_up(rt, call, n_sets)
                row["host_sync"] = rt.blocks_host((provider.name, cfg.pass_name, cfg.dtype), call)
                peak = rt.peak_extra_bytes(call)
                reps = min(max(math.ceil(timing.target_ms / 1e3 / max(wall_s, 1e-6)), timing.min_reps), timing.max_reps)
                times = rt.time_ms(call, n_sets, reps, host_s)
        except Exception as exc:  # recorded, and the sweep goes on
            status, reason = _short_error(exc, caught)
            return row | {"status": status, "reason": reason}
        finally:
            del call
            rt.free()
    ms = statistics.median(times)
    q10, q90 = (np.percentile(times, [10, 90]) if len(times) > 1 else (ms, ms))
    tflops = cfg.flops() / (ms * 1e-3) / 1e12
    peak_key = {"fp32": "sgemm_tflops", "fp16": "fp16_matmul_tflops", "bf16": "bf16_matmul_tflops"}[cfg.dtype]
    return row | {
        "status": "ok", "ms": ms, "ms_p10": float(q10), "ms_p90": float(q90), "reps": len(times), "sets": n_sets,
        "host_us": host_s * 1e6, "tflops": tflops, "peak_mem_bytes": peak,
        "pct_peak": 100 * tflops / ceilings[peak_key] if peak_key in ceilings else None,
        "pct_sgemm": 100 * tflops / ceilings["sgemm_tflops"] if "sgemm_tflops" in ceilings else None,
    }  # fmt: skip


# ----------------------------------------------------------------------------
# Ceilings and host overhead
# ----------------------------------------------------------------------------


def _time_simple(rt: Runtime, fn: Callable[[], Any], reps: int = 20) -> float:
    """Median device ms of ``fn()`` after warm-up."""
    call = lambda i: fn()  # noqa: E731
    host_s, _ = warm_up(rt, call, 2)
    return statistics.median(rt.time_ms(call, 1, reps, host_s))


def measure_ceilings(rt: GpuRuntime, matmul_size: int = 8192, copy_bytes: int = 2**30) -> dict[str, float]:
    """What the GPU can do at all, measured now: copy bandwidth and dense matmul rates (TF32 off)."""
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=rt.device)
    dst = torch.empty_like(src)
    out = {"copy_gbps": 2 * copy_bytes / (_time_simple(rt, lambda: dst.copy_(src)) * 1e-3) / 1e9}  # read + written
    n = matmul_size
    for key, dtype in (("sgemm_tflops", torch.float32), ("fp16_matmul_tflops", torch.float16),
                       ("bf16_matmul_tflops", torch.bfloat16)):
        a, b = (torch.randn(n, n, device=rt.device, dtype=dtype) for _ in range(2))
        out[key] = 2 * n**3 / (_time_simple(rt, lambda a=a, b=b: torch.mm(a, b)) * 1e-3) / 1e12
    return out


def measure_host_overhead(rt: Runtime, providers: list[Provider], calls: int, passes: Sequence[str],
                          seqlen: int = 16, head_dim: int = 64) -> list[dict]:
    """Host time of one call at B=1, H=1, N=16, D=64 (median of ``calls``), fp16 and bf16, forward and backward."""
    rows = []
    for dtype in ("fp16", "bf16"):
        for pass_name in [p for p in ("forward", "backward") if p in passes]:
            cfg = Config(pass_name, dtype, 1, 1, seqlen, head_dim, False)
            sets = make_inputs(rt, cfg, 1)
            for provider in providers:
                row = {"provider": provider.name, "dtype": dtype, "pass": pass_name, "seqlen": seqlen,
                       "head_dim": head_dim, "calls": calls}
                reason = provider.unsupported(cfg)
                if reason:
                    rows.append(row | {"status": "unsupported", "reason": reason})
                    continue
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        with provider.scope(), rt.native_cupy_pool():
                            call, _ = provider.make_call(rt, cfg, sets)
                            warm_up(rt, call, 1)
                            times = []
                            for i in range(calls):
                                t0 = time.perf_counter()
                                out = call(0)
                                times.append(time.perf_counter() - t0)
                                del out
                                if i % 64 == 63:  # keep the launch queue short
                                    rt.sync()
                            rt.sync()
                        rows.append(row | {"status": "ok", "us": statistics.median(times) * 1e6,
                                           "us_p10": float(np.percentile(times, 10)) * 1e6})
                    except Exception as exc:
                        status, reason = _short_error(exc, caught)
                        rows.append(row | {"status": status, "reason": reason})
                rt.free()
    return rows


# ----------------------------------------------------------------------------
# Nsight Compute: DRAM bytes per call
# ----------------------------------------------------------------------------


def ideal_bytes(cfg: Config) -> dict[str, int]:
    """Theoretical DRAM traffic of one call.

    ``fused``: every input read once and every output written once (q, k, v → o and the fp32 lse;
    backward q, k, v, o, do, lse → dq, dk, dv).  ``unfused``: plus S and P each written and read once in
    the forward; P read twice, dP and dS written once and read (dS twice) in the backward — the least an
    implementation that materialises the N×N matrices in the input dtype can move.
    """
    e = torch.empty((), dtype=cfg.torch_dtype).element_size()
    bhnd = cfg.batch * cfg.heads * cfg.seqlen * cfg.head_dim
    bhn = cfg.batch * cfg.heads * cfg.seqlen
    nn = cfg.batch * cfg.heads * cfg.seqlen**2 * e
    fwd, bwd = 4 * bhnd * e + 4 * bhn, 8 * bhnd * e + 4 * bhn
    fused = {"forward": fwd, "backward": bwd, "fwd+bwd": fwd + bwd}[cfg.pass_name]
    extra = {"forward": 4 * nn, "backward": 7 * nn, "fwd+bwd": 11 * nn}[cfg.pass_name]
    return {"fused": fused, "unfused": fused + extra}


def _ncu_executable() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu"):
        if os.path.exists(cand):
            return cand
    return None


def parse_ncu_csv(text: str) -> dict[str, float]:
    """Sum each metric over all profiled kernels in ``ncu --csv --print-units base`` output; ``kernels`` counted."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    totals: dict[str, float] = {}
    ids = set()
    for rec in csv.DictReader(lines):
        name, value = rec.get("Metric Name"), rec.get("Metric Value", "")
        if not name:
            continue
        ids.add(rec.get("ID"))
        try:
            totals[name] = totals.get(name, 0.0) + float(value.replace(",", ""))
        except ValueError:
            continue
    totals["kernels"] = len(ids)
    return totals


def run_ncu(args: argparse.Namespace, cfgs: list[Config], providers: list[Provider]) -> list[dict]:
    """Profile one call per (provider, pass) under Nsight Compute, each in a subprocess of this script."""
    exe = _ncu_executable()
    rows = []
    for cfg in cfgs:
        for provider in providers:
            if provider.family not in ("nbflash", "naive") or provider.unsupported(cfg):
                continue
            row = base_row(provider, cfg) | {f"ideal_{k}_bytes": v for k, v in ideal_bytes(cfg).items()}
            if exe is None:
                rows.append(row | {"status": "error", "reason": "ncu not found"})
                continue
            with tempfile.TemporaryDirectory() as tmp:
                log = os.path.join(tmp, "ncu.csv")
                cmd = [exe, "--clock-control", "none", "--profile-from-start", "off", "--metrics", NCU_METRICS,
                       "--csv", "--print-units", "base", "--log-file", log,
                       sys.executable, str(Path(__file__).resolve()), "--ncu-child", "--providers", provider.name,
                       "--passes", cfg.pass_name, "--dtypes", cfg.dtype, "--dims", str(cfg.head_dim),
                       "--seqlens", str(cfg.seqlen), "--batch", str(cfg.batch), "--heads", str(cfg.heads),
                       "--causal", "true" if cfg.causal else "false"]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.ncu_timeout)
                text = Path(log).read_text() if os.path.exists(log) else ""
            totals = parse_ncu_csv(text)
            if proc.returncode != 0 or "dram__bytes_read.sum" not in totals:
                tail = (proc.stderr or proc.stdout or text).strip().splitlines()[-3:]
                rows.append(row | {"status": "error", "reason": f"ncu rc={proc.returncode}: {' | '.join(tail)}"[:300]})
                continue
            read, write = totals["dram__bytes_read.sum"], totals["dram__bytes_write.sum"]
            rows.append(row | {"status": "ok", "dram_read_bytes": read, "dram_write_bytes": write,
                               "kernels": totals["kernels"],
                               "dram_over_fused": (read + write) / row["ideal_fused_bytes"]})
    return rows


def ncu_child(rt: GpuRuntime, provider: Provider, cfg: Config) -> None:
    """Under ncu: warm up with profiling off, then profile exactly one call."""
    sets = make_inputs(rt, cfg, 1)
    with provider.scope():
        call, _ = provider.make_call(rt, cfg, sets)
        warm_up(rt, call, 1)
        torch.cuda.profiler.start()
        out = call(0)
        rt.sync()
        torch.cuda.profiler.stop()
        del out


# ----------------------------------------------------------------------------
# Output: JSON, CSV, terminal tables
# ----------------------------------------------------------------------------


def write_results(result: dict[str, Any], json_path: Path) -> Path:
    """The JSON (everything) and, beside it, the CSV (one line per result row); returns the CSV's path."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_finite(result), indent=1, allow_nan=False))
    tmp.replace(json_path)
    csv_path = json_path.with_suffix(".csv")
    env = result["environment"]
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in result["results"]:
            writer.writerow(row | {"device": env["device"], "commit": env["commit"]})
    return csv_path


def _finite(x: Any) -> Any:
    """``x`` for strict JSON: NumPy scalars as Python numbers, non-finite floats (a failed check's ratio) as None."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


_CELL = {"unsupported": "–", "failed-check": "FAIL", "oom": "OOM", "error": "ERR"}


def _pivot(rows: list[dict], providers: list[str], value: Callable[[dict], str]) -> tuple[list[str], list[list]]:
    """One line per configuration, one column per provider."""
    configs: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["batch"], r["heads"])
        configs.setdefault(key, {})[r["provider"]] = r
    headers = ["pass", "dtype", "D", "causal", "N", "B×H", *providers]
    table = []
    for (pass_name, dtype, d, causal, n, b, h), cells in configs.items():
        line = [pass_name, dtype, d, "yes" if causal else "no", n, f"{b}×{h}"]
        for p in providers:
            r = cells.get(p)
            line.append("" if r is None else value(r) if r["status"] == "ok" else _CELL.get(r["status"], "?"))
        table.append(line)
    return headers, table


def print_tables(result: dict[str, Any], write: Callable[[str], None] = print) -> None:
    """Speed, memory, ceilings, host overhead and ncu tables, and why anything did not run."""
    rows = result["results"]
    providers = [p for p in result["providers"] if any(r["provider"] == p for r in rows)]
    env = result["environment"]
    write(f"\n{env['device']} · commit {env['commit'][:10] or '?'}{' (dirty)' if env.get('commit_dirty') else ''}"
          f" · torch {env['torch']} · numba-cuda {env['numba_cuda']} · cupy {env.get('cupy') or '-'}")
    if rows:
        headers, table = _pivot(rows, providers, lambda r: _num(r["tflops"]))
        simt = [r for r in rows if r.get("simt") and r["status"] == "ok"]
        if simt:  # nbflash's share of what its arithmetic could reach
            pct = {(r["pass"], r["dtype"], r["head_dim"], r["causal"], r["seqlen"], r["provider"]): r for r in simt}
            names = sorted({r["provider"] for r in simt}, key=providers.index)
            for name in names:
                headers += [f"{name} %sgemm", f"{name} %peak"]
            for line in table:
                for name in names:
                    r = pct.get((line[0], line[1], line[2], line[3] == "yes", line[4], name))
                    line += [_pct(r, "pct_sgemm"), _pct(r, "pct_peak")]
        write("\nTFLOP/s (– unsupported, FAIL failed its check, OOM out of memory, ERR error; reasons below)")
        write(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
        headers, table = _pivot(rows, providers, lambda r: _mib(r["peak_mem_bytes"]))
        write("\nPeak extra memory, MiB" + (" (simulator: output bytes only)" if env["device"] == "simulator" else ""))
        write(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
        reasons = sorted({(r["provider"], r["status"], r["reason"]) for r in rows if r["status"] != "ok"})
        if reasons:
            write("\nNot run")
            write(tabulate(reasons, headers=["provider", "status", "reason"], tablefmt="github"))
        waits = sorted({(r["provider"], r["pass"], r["dtype"]) for r in rows if r.get("host_sync")})
        if waits:
            write("\nCalls that make the host wait for the GPU (their ms include the launch after the wait): "
                  + ", ".join(" ".join(w) for w in waits))
    if result.get("ceilings"):
        write("\nCeilings measured in this run")
        write(tabulate([[k, f"{v:.1f}"] for k, v in result["ceilings"].items()], headers=["ceiling", "value"],
                       tablefmt="github", disable_numparse=True))
    if result.get("host_overhead"):
        table = [[r["provider"], r["dtype"], r["pass"], _num(r["us"]) if r["status"] == "ok" else r["reason"]]
                 for r in result["host_overhead"]]
        r = result["host_overhead"][0]
        write(f"\nHost time per call, B=1 H=1 N={r['seqlen']} D={r['head_dim']} (µs, median of {r['calls']})")
        write(tabulate(table, headers=["provider", "dtype", "pass", "µs"], tablefmt="github", disable_numparse=True))
    if result.get("ncu"):
        table = [[r["provider"], r["pass"], r["dtype"], r["seqlen"], r["head_dim"], r["causal"],
                  _mib(r.get("dram_read_bytes")), _mib(r.get("dram_write_bytes")), _mib(r["ideal_fused_bytes"]),
                  _mib(r["ideal_unfused_bytes"]), r["reason"] or f"{r['dram_over_fused']:.2f}"] for r in result["ncu"]]
        write("\nDRAM traffic per call (Nsight Compute), MiB")
        write(tabulate(table, headers=["provider", "pass", "dtype", "N", "D", "causal", "read", "written",
                                       "ideal fused", "ideal unfused", "measured/fused"],
                       tablefmt="github", disable_numparse=True))


def _pct(r: dict | None, key: str) -> str:
    return "" if r is None or r.get(key) is None else f"{r[key]:.0f}%"


def _num(x: float | None) -> str:
    """Three significant digits, no exponent above 1 (12345 → "12345", 24.31 → "24.3", 0.00123 → "0.00123")."""
    if x is None:
        return ""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _mib(x: float | None) -> str:
    return "" if x is None else _num(x / 2**20)


# ----------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------


def _csv_list(text: str, kind: Callable[[str], Any] = str) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


#: Defaults of the full sweep; ``--smoke`` replaces some (tiny shapes, one repetition: its numbers only
#: prove that every stage works).  Options given on the command line win over both.
DEFAULTS: dict[str, Any] = dict(
    providers="default", passes=",".join(PASSES), dtypes="fp16,bf16,fp32", dims="64,128",
    seqlens="512,1024,2048,4096,8192,16384", sets=3, min_reps=10, max_reps=100, check_seqlen=2048, host_calls=1000,
)  # fmt: skip
SMOKE: dict[str, Any] = dict(
    providers="nbflash,sdpa-math,naive", dtypes="fp32,bf16", dims="16", seqlens="4,8", batch=1, heads=2,
    min_reps=1, max_reps=1, check_seqlen=32, host_calls=3,
)  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def option(group, flag: str, help: str, **kw) -> None:
        key = flag[2:].replace("-", "_")
        shown = [f"default {DEFAULTS[key]}"] if key in DEFAULTS else []
        shown += [f"--smoke: {SMOKE[key]}"] if key in SMOKE else []
        group.add_argument(flag, help=f"{help} ({'; '.join(shown)})" if shown else help, **kw)

    sel = ap.add_argument_group("what to run")
    option(sel, "--providers", f"comma list of names or families, 'default' or 'all' (known: {', '.join(PROVIDERS)})")
    option(sel, "--passes", "comma list of forward, backward, fwd+bwd")
    option(sel, "--dtypes", "comma list of fp16, bf16, fp32")
    option(sel, "--dims", "head dims, comma list (256 works too)")
    option(sel, "--seqlens", "sequence lengths, comma list")
    sel.add_argument("--causal", choices=("both", "true", "false"), default="both")
    option(sel, "--batch", "fixed batch (default: --tokens // N)", type=int)
    option(sel, "--heads", "fixed heads (default: --hidden // D)", type=int)
    sel.add_argument("--tokens", type=int, default=16384, help="batch·N when --batch is not given (default 16384)")
    sel.add_argument("--hidden", type=int, default=2048, help="heads·D when --heads is not given (default 2048)")
    how = ap.add_argument_group("how")
    option(how, "--sets", "input sets rotated between calls (≥ 3 keeps L2 honest)", type=int)
    option(how, "--min-reps", "fewest timed calls per measurement", type=int)
    option(how, "--max-reps", "most timed calls per measurement", type=int)
    how.add_argument("--target-ms", type=float, default=400.0, help="about this much work per measurement (400)")
    option(how, "--check-seqlen", "largest N of the float64 check", type=int)
    option(how, "--host-calls", "calls per host-overhead figure, 0 skips them", type=int)
    how.add_argument("--no-ceilings", action="store_true", help="skip the copy / matmul ceilings")
    how.add_argument("--ncu", action="store_true",
                     help="also DRAM bytes per call with Nsight Compute (nbflash, naive; first dtype, D, N, causal)")
    how.add_argument("--ncu-timeout", type=int, default=900, help="seconds per profiled call (900)")
    out = ap.add_argument_group("output")
    out.add_argument("--out", type=Path, help="results folder (default benchmarks/results; --smoke: a temp folder)")
    out.add_argument("--name", help="file stem (default <device>-<date>)")
    out.add_argument("--resume", action="store_true", help="continue the run in an existing JSON: skip rows it has")
    out.add_argument("--no-plot", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny run in the CUDA simulator on the CPU (nbflash, SDPA math, naive NumPy)")
    ap.add_argument("--list", action="store_true", help="list the providers and exit")
    ap.add_argument("--ncu-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (DEFAULTS | (SMOKE if args.smoke else {})).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None and args.smoke:
        args.out = Path(tempfile.mkdtemp(prefix="nbflash-bench-smoke-"))
    elif args.out is None:
        args.out = ROOT / "benchmarks" / "results"
    if args.sets < 3 and not args.ncu_child:
        print(f"warning: --sets {args.sets} < 3: L2 may keep inputs between calls", file=sys.stderr)
    return args


def make_runtime(smoke: bool) -> Runtime:
    """The GPU, or (``--smoke``) the simulator — chosen before nbflash (and so Numba) is imported."""
    if smoke:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        sys.setswitchinterval(1e-4)  # the simulator switches threads at every syncthreads
        torch.set_num_threads(1)  # PyTorch's spinning workers would slow the simulator's threads
    import nbflash

    if nbflash.SIMULATOR:
        if not smoke:
            raise SystemExit("no CUDA GPU here (nbflash runs in the simulator): use --smoke, or run on a GPU")
        return SimulatorRuntime()
    return GpuRuntime()


def config_groups(args: argparse.Namespace) -> Iterator[tuple[Config, list[Config]]]:
    """``(shape, [that shape for each pass])``: the passes of a shape share its input sets."""
    passes = _csv_list(args.passes)
    for p in passes:
        if p not in PASSES:
            raise SystemExit(f"unknown pass {p!r}; known: {', '.join(PASSES)}")
    dtypes = _csv_list(args.dtypes)
    for dt in dtypes:
        if dt not in DTYPES:
            raise SystemExit(f"unknown dtype {dt!r}; known: {', '.join(DTYPES)}")
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    for dtype in dtypes:
        for d in _csv_list(args.dims, int):
            for causal in causals:
                for n in _csv_list(args.seqlens, int):
                    batch = args.batch or max(1, args.tokens // n)
                    heads = args.heads or max(1, args.hidden // d)
                    shape = Config(passes[0], dtype, batch, heads, n, d, causal)
                    yield shape, [dataclasses.replace(shape, pass_name=p) for p in passes]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for p in PROVIDERS.values():
            print(f"{p.name:22} {p.label}{'' if p.default else '  (not in the default selection)'}")
        return 0
    rt = make_runtime(args.smoke)
    providers = select_providers(args.providers, rt)
    groups = list(config_groups(args))
    if args.ncu_child:
        shape, cfgs = groups[0]
        ncu_child(rt, providers[0], cfgs[0])
        return 0

    env = rt.environment()
    stem = args.name or f"{env['device'].replace(' ', '-')}-{env['date']}"
    json_path = args.out / f"{stem}.json"
    result: dict[str, Any] = {"schema": SCHEMA, "environment": env, "settings": _settings(args),
                              "providers": list(PROVIDERS), "ceilings": {}, "host_overhead": [], "results": []}
    done: set[tuple] = set()
    if args.resume and json_path.exists():
        old = json.loads(json_path.read_text())
        result |= {k: old[k] for k in ("environment", "settings", "ceilings", "host_overhead", "results", "ncu")
                   if k in old}
        result["resumed"] = [*old.get("resumed", []), {"time": env["time"], "commit": env["commit"],
                                                       "settings": _settings(args)}]
        done = {(r["provider"], r["pass"], r["dtype"], r["batch"], r["heads"], r["seqlen"], r["head_dim"], r["causal"])
                for r in result["results"]}
    print(f"{env['device']} · commit {env['commit'][:10] or '?'} · providers {', '.join(p.name for p in providers)}"
          f" · writing {json_path}", flush=True)

    if not rt.simulator and not args.no_ceilings and not result["ceilings"]:
        result["ceilings"] = measure_ceilings(rt)
    if args.host_calls and not result["host_overhead"]:
        tiny = dict(seqlen=8, head_dim=16) if rt.simulator else {}  # the simulator is slow
        result["host_overhead"] = measure_host_overhead(rt, providers, args.host_calls, _csv_list(args.passes), **tiny)
    write_results(result, json_path)

    checker = Checker(rt, args.check_seqlen)
    timing = Timing(args.sets, args.min_reps, args.max_reps, args.target_ms)
    bar = tqdm(total=sum(len(cfgs) for _, cfgs in groups), unit="config", dynamic_ncols=True)
    for shape, cfgs in groups:
        todo = [(c, p) for c in cfgs for p in providers if (p.name, *c.key()) not in done]
        if not todo:
            bar.update(len(cfgs))
            continue
        try:
            sets = make_inputs(rt, shape, args.sets)
        except Exception as exc:  # inputs alone do not fit: every row says so
            status, reason = _short_error(exc, [])
            result["results"] += [base_row(p, c) | {"status": status, "reason": "inputs: " + reason} for c, p in todo]
            bar.update(len(cfgs))
            continue
        for cfg in cfgs:
            bar.set_description(f"{cfg.pass_name} {cfg.dtype} D={cfg.head_dim} N={cfg.seqlen}"
                                f"{' causal' if cfg.causal else ''}")
            for provider in providers:
                if (provider.name, *cfg.key()) in done:
                    continue
                bar.set_postfix_str(provider.name)
                result["results"].append(measure(rt, provider, cfg, sets, checker, timing, result["ceilings"]))
            bar.update(1)
        del sets
        rt.free()
        write_results(result, json_path)
    bar.close()

    if args.ncu:
        _, ncu_cfgs = groups[0]
        result["ncu"] = run_ncu(args, ncu_cfgs, providers)
    csv_path = write_results(result, json_path)
    print_tables(result)
    print(f"\nwrote {json_path}\nwrote {csv_path}")
    if not args.no_plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            from plot import write_plots
        except ImportError as exc:  # e.g. no matplotlib on the GPU machine: the JSON is the evidence
            print(f"no plots ({exc}); make them anywhere with: python benchmarks/plot.py {json_path}")
            return 0
        for path in write_plots(json_path):
            print(f"wrote {path}")
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("list", "ncu_child")}


if __name__ == "__main__":
    sys.exit(main())
