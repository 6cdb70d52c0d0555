"""Training check: a small transformer trained with nbflash attention follows the SDPA loss curve.

Run on a CUDA machine (it needs PyTorch and CuPy)::

    python benchmarks/train_check.py                      # float32, 300 steps
    python benchmarks/train_check.py --dtype bf16-autocast
    python benchmarks/train_check.py --dtype bfloat16     # pure bf16 parameters and optimizer state
    python benchmarks/train_check.py --smoke              # any CPU, CUDA simulator, ~seconds

What it checks.  Kernel tests compare one call against a float64 reference;
this checks that the forward *and* backward kernels, wired through
``nbflash.torch.attention``, are good enough to train with.  A pre-LN,
decoder-only transformer (default 2 layers, d_model 256, 4 heads of dim 64,
sequence 256, vocabulary 512, batch 16) is trained with AdamW for ``--steps``
steps, three times, from the same initial weights on the same batches; only
the attention call differs:

1. ``sdpa``:      ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``,
   PyTorch's default backend (the one chosen is recorded in the JSON);
2. ``nbflash``:   ``nbflash.torch.attention(q, k, v, causal=True)``;
3. ``sdpa_math``: SDPA forced to its math backend (``--no-floor`` skips it).
   It is a second *correct* implementation, so ``sdpa_math − sdpa`` is the
   noise floor: how far two runs drift apart from rounding alone.

The data are random, yet mostly learnable, and mostly only through attention.  A
fixed random Markov chain gives every token ``--branching`` (4) equally likely
successors; each sequence is a 32-token walk of the chain (``--period``)
repeated 8 times.  The first 31 targets can only be guessed (``ln 4 ≈ 1.39``
nats at best: ``chain_loss``); the other 225 are copies of a token 32
positions back (``copy_loss``, 0 at best), which a model predicts only by
attending back to the previous repeat (an induction head).  The ideal mean is
``31/256 · ln 4 ≈ 0.17`` nats.  The curve has two phases: from ``ln 512 ≈
6.24`` down to about 1.7 as the bigram statistics are learned (steps 0-100),
then a drop to about 0.21 when the copy is learned (steps ~100-150) — the
second phase exists only if attention's forward and backward are right.  On
an H200 the default run ends at loss 0.21, ``copy_loss`` 0.008.

Schedule: 10 % linear warm-up to lr 3e-3, cosine decay to 3e-4, betas
(0.9, 0.95), weight decay 0.1, gradients clipped at norm 1; the loss is the
float32 cross-entropy over every position.  Times: ``wall s`` is the whole
run, whose first step includes compiling nbflash's kernels (about 10 s on the
H200); ``ms/step`` is the median step after the first five.

How to read the figure (``<out>/train_check-<device>-<date>.png``).  Top: the
loss curves; nbflash should lie on top of SDPA.  Bottom, log scale:
``|Δloss|`` per step against SDPA, for nbflash and for the math-backend floor,
with the tolerance as a dashed line and the last 50 steps shaded.  At step 0
the weights and batch are identical, so ``|Δloss|`` is attention's rounding
alone.  Training then amplifies that perturbation most while the copy is being
learned (the loss is most sensitive to the weights there) and damps it as the
learning rate decays.  A correct kernel gives a red curve that tracks the
grey one; a kernel bug shows as a red curve that leaves it: a step-0
difference far above rounding, a gap that keeps growing, a loss that plateaus
higher (typically ``copy_loss`` staying up), or a non-finite loss.

What an H200 gave (numba-cuda 0.30.4, torch 2.11, default settings, seed 0),
|Δloss| of nbflash against SDPA and, in brackets, of the math-backend floor:

============== ======== ===================== =====================
dtype          step 0   max over all steps    max over last 50
============== ======== ===================== =====================
float32        0        1.2e-6 (1.1e-6)       8.9e-8 (7.5e-8)
bf16-autocast  5e-5     4.1e-3 (4.4e-3)       4.8e-4 (5.9e-4)
bfloat16       7e-5     4.3e-3 (5.2e-3)       9.1e-4 (1.2e-3)
============== ======== ===================== =====================

(seed 1, float32: 7.2e-7 and 1.3e-7.)  In float32 the runs barely drift: 300
steps with a decaying learning rate are too few for rounding at 1e-7 to grow
past 1e-6 — about the loss's own resolution (one float32 step at 0.2-6 is
1.5e-8 to 4.8e-7), which is why many steps show a difference of exactly 0.  bfloat16 keeps 8 significant
bits (relative rounding 2⁻⁹ ≈ 0.2 %), so attention's outputs differ by that
from the first step, and pure-bf16 parameters also round every AdamW update.

Verdict.  The curves agree if the largest ``|Δloss|`` over the last 50 steps
is at most the tolerance for the dtype:

* float32: 1e-4.  A thousand times the floor over the last 50 steps and a
  hundred times its largest value anywhere — room for other seeds and for
  ``--layers``/``--steps``/``--lr`` settings whose dynamics amplify rounding
  more — but tight enough to see small gradient errors (table below).  A
  guess like 0.02 for "diverging rounding" would pass every one of them.
* bf16-autocast: 1e-2, and bfloat16: 2e-2: about 17 times the floor over the
  last 50 steps, and above the largest difference anywhere in the run.  Here
  rounding hides small errors; only gross ones (a wrong mask, a gradient
  wrong by tens of %, NaNs) can show.

A second check, on the gradients before the first update (same weights, same
batch): the relative L2 error of nbflash's full parameter gradient against
SDPA's must be at most 1e-5 in float32 (measured 3.6e-7, floor 3.2e-7) and
2e-2 in bfloat16 (measured 2.7e-3 to 3.0e-3, the same as the floor).  It
sees a kernel error directly, before training can wash it out.

What the loss curve can and cannot see.  AdamW normalises each gradient by
its own running scale, so a gradient that is slightly off in size barely
changes where training ends.  Deliberate errors planted in SDPA's gradients
(a hook on q, k or v), float32, seed 0, against the clean run:

============================== ================== ================
planted error                  max over all steps max over last 50
============================== ================== ================
dq × 0.99, every head          4.5e-3             1.4e-4
dk × 0.99, head 0              1.5e-3             5.1e-5
dv × 0.999, every head         1.1e-3             1.4e-4
dq × 0.9, head 0               1.5e-2             7.3e-4
dv × 1.01, head 1              1.9e-3             1.8e-4
============================== ================== ================

Every one is a thousand times the floor at its peak, mid-run; four of the
five stay above 1e-4 at the end (dk × 0.99 in one head does not).  In
bf16-autocast the first two end at 5.7e-4 and 5.0e-4: inside the floor.
Hence the figure: a red curve that rises far above the grey one anywhere, and
not just at the end, is worth a look even when the verdict is AGREE (the
summary says so when nbflash's peak is over 10 times the floor's).

The tolerances are judgements, not theorems: the summary also prints the
noise floor, and flags when the floor itself exceeds the tolerance (then the
tolerance is too tight for that configuration, and nbflash should be judged
against the floor).  A failure is reported as one, and the exit status is 1.

Outputs: ``<out>/train_check-<device>-<date>[-<dtype>][-smoke].json`` (the
dtype is named unless float32) with the configuration, versions (torch,
numba, numba-cuda, CuPy), git commit, per-step losses, gradient norms and
step times of every run, the statistics above and the verdict; the PNG beside
it.  ``--dry-run`` builds the data and the full-size model and runs one SDPA
forward on whatever device there is (the CPU here), then stops.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

#: Largest |Δloss| over the last 50 steps at which the curves still agree (see the module docstring).
TOLERANCE = {"float32": 1e-4, "bf16-autocast": 1e-2, "bfloat16": 2e-2}
#: Largest relative L2 error of nbflash's step-0 parameter gradient against SDPA's.
GRAD_TOLERANCE = {"float32": 1e-5, "bf16-autocast": 2e-2, "bfloat16": 2e-2}
#: Steps at the end over which agreement is judged.
LAST = 50


@dataclasses.dataclass
class Config:
    """Model, data and optimiser settings."""

    layers: int = 2
    d_model: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 512
    batch: int = 16
    branching: int = 4
    period: int | None = 32
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0


SMOKE = dict(layers=1, d_model=16, heads=2, seq=8, vocab=11, batch=2, steps=3, period=4)


# ----------------------------------------------------------------------------
# Data: a walk of a fixed random Markov chain, repeated to fill the sequence
# ----------------------------------------------------------------------------


def make_batches(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``, each ``(steps, batch, seq)`` int64 on the CPU: inputs and next-token targets.

    Token ``t`` is followed by one of ``succ[t, :]`` (``branching`` fixed random
    successors, uniformly).  Each sequence walks the chain for ``period`` tokens
    and then repeats that walk: token ``i`` equals token ``i - period``.
    Deterministic in ``cfg.seed``.
    """
    g = torch.Generator().manual_seed(cfg.seed + 1)
    succ = torch.randint(cfg.vocab, (cfg.vocab, cfg.branching), generator=g)
    rows, period = cfg.steps * cfg.batch, period_of(cfg)
    walk = torch.empty(rows, period, dtype=torch.int64)
    walk[:, 0] = torch.randint(cfg.vocab, (rows,), generator=g)
    choice = torch.randint(cfg.branching, (rows, period), generator=g)
    for i in range(1, period):
        walk[:, i] = succ[walk[:, i - 1], choice[:, i]]
    tokens = walk[:, torch.arange(cfg.seq + 1) % period].view(cfg.steps, cfg.batch, cfg.seq + 1)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def period_of(cfg: Config) -> int:
    """The walk's length: ``cfg.period``, or half the sequence (rounded up) when unset."""
    return cfg.period or (cfg.seq + 2) // 2


def copy_mask(cfg: Config) -> torch.Tensor:
    """``(seq,)`` bool: the positions whose target is a copy (predictable only by attention)."""
    return torch.arange(cfg.seq) + 1 >= period_of(cfg)


def ideal_loss(cfg: Config) -> float:
    """About the best mean loss: ``ln(branching)`` on the chain's targets, 0 on the copied ones."""
    return float((~copy_mask(cfg)).float().mean()) * math.log(cfg.branching)


# ----------------------------------------------------------------------------
# Model: pre-LN decoder; the attention call is the only thing that varies
# ----------------------------------------------------------------------------


class Block(nn.Module):
    """``x + attn(LN(x))``, then ``x + MLP(LN(x))``."""

    def __init__(self, cfg: Config, attend):
        super().__init__()
        d = cfg.d_model
        self.heads, self.attend = cfg.heads, attend
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        # (3, b, heads, n, head_dim): strided views of one buffer, head dim contiguous (read in place by nbflash).
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        o = self.attend(q, k, v)
        x = x + self.proj(o.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, final LN, untied unembedding."""

    def __init__(self, cfg: Config, attend):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attend) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's init; residual projections scaled down by depth
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_math(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def nbflash_attention(q, k, v):
    import nbflash.torch

    return nbflash.torch.attention(q, k, v, causal=True)


RUNS = {"sdpa": sdpa, "nbflash": nbflash_attention, "sdpa_math": sdpa_math}


# ----------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 10 % of steps, then cosine decay to 0.1."""
    warmup = max(1, steps // 10)
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(cfg: Config, attend, init: dict, data, device: torch.device, dtype: str, log) -> dict:
    """Train a fresh ``TinyGPT`` from the weights ``init`` on ``data``; per-step records and the step-0 gradient."""
    model = TinyGPT(cfg, attend)
    model.load_state_dict(init)
    model.to(device=device, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.steps))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16-autocast")
    copied = copy_mask(cfg).to(device)
    xs, ys = data
    rec = dict(loss=[], chain_loss=[], copy_loss=[], grad_norm=[], step_s=[])
    grad0 = None
    synchronize(device)
    start = time.perf_counter()
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        x, y = xs[step], ys[step]
        with autocast:
            logits = model(x)
        per_token = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
        loss = per_token.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step == 0:
            grad0 = torch.cat([p.grad.detach().double().flatten() for p in model.parameters()]).cpu()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            halves = torch.stack([per_token[:, ~copied].mean(), per_token[:, copied].mean(), gnorm.float()])
        loss_v, (chain_v, copy_v, gnorm_v) = loss.item(), halves.tolist()  # .item() waits for the step
        rec["loss"].append(loss_v)
        rec["chain_loss"].append(chain_v)
        rec["copy_loss"].append(copy_v)
        rec["grad_norm"].append(gnorm_v)
        rec["step_s"].append(time.perf_counter() - t0)
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"  step {step:4d}  loss {loss_v:.4f}  (chain {chain_v:.3f}, copy {copy_v:.3f})  |g| {gnorm_v:.3f}")
        if not math.isfinite(loss_v):
            log(f"  non-finite loss at step {step}: stopping this run")
            break
    synchronize(device)
    rec["wall_s"] = time.perf_counter() - start
    steady = rec["step_s"][5:] or rec["step_s"]
    rec["first_step_s"] = rec["step_s"][0]
    rec["median_step_ms"] = 1e3 * statistics.median(steady)
    return rec, grad0


# ----------------------------------------------------------------------------
# Comparison, environment, outputs
# ----------------------------------------------------------------------------


def compare(run: dict, ref: dict, last: int) -> dict:
    """Statistics of ``|run.loss − ref.loss|`` per step."""
    a, b = run["loss"], ref["loss"]
    n = min(len(a), len(b))
    diff = [abs(a[i] - b[i]) for i in range(n)]
    finite = all(math.isfinite(d) for d in diff) and len(a) == len(b)
    tail = diff[-last:]
    worst = max(range(n), key=lambda i: diff[i] if math.isfinite(diff[i]) else math.inf)
    return dict(
        abs_diff=diff,
        finite=finite,
        step0=diff[0],
        max=diff[worst],
        max_step=worst,
        max_last=max(tail),
        mean_last=statistics.fmean(tail),
        final_diff=a[-1] - b[-1],
    )


def grad_rel_error(g: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖g − ref‖ / ‖ref‖`` of the flattened step-0 gradients."""
    return float((g - ref).norm() / ref.norm())


def sdpa_backend(cfg: Config, device: torch.device, dtype: str) -> str:
    """The backend SDPA's default dispatch picks for this model's q, k, v (as in training: requiring grad)."""
    try:
        shape = (cfg.batch, cfg.heads, cfg.seq, cfg.d_model // cfg.heads)
        t = torch.float32 if dtype == "float32" else torch.bfloat16
        q, k, v = (torch.empty(shape, device=device, dtype=t, requires_grad=True) for _ in range(3))
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True)).name
    except Exception as e:  # private API: record, never fail on it
        return f"unknown ({type(e).__name__})"


def git_commit() -> tuple[str, bool | None]:
    """``(commit, dirty)`` of the checkout, or ``NBFLASH_COMMIT`` where there is no git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        )
        if len(commit) == 40 and all(c in "0123456789abcdef" for c in commit):  # not a copy without history
            return commit, bool(status.stdout.strip())
    except OSError:
        pass
    return os.environ.get("NBFLASH_COMMIT", ""), None


def environment(device: torch.device) -> dict:
    """Device, library versions and commit."""
    import numba
    import numpy

    import nbflash

    try:
        import numba_cuda

        numba_cuda_version = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        numba_cuda_version = None
    try:
        import cupy

        cupy_version = cupy.__version__
    except ImportError:
        cupy_version = None
    commit, dirty = git_commit()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        cc = "{}.{}".format(*torch.cuda.get_device_capability(device))
    else:
        name, cc = ("cpu-simulator" if nbflash.SIMULATOR else "cpu"), None
    return dict(
        device=name,
        cc=cc,
        simulator=nbflash.SIMULATOR,
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        numba=numba.__version__,
        numba_cuda=numba_cuda_version,
        cupy=cupy_version,
        numpy=numpy.__version__,
        nbflash=nbflash.__version__,
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        commit=commit,
        dirty=dirty,
        date=datetime.date.today().isoformat(),
    )


def plot(path: str, result: dict) -> None:
    """Loss curves (top) and per-step |Δloss| against SDPA on a log scale (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, diffs, tol = result["runs"], result["diff"], result["tolerance"]
    style = {"sdpa": ("C0", "-"), "nbflash": ("C3", "--"), "sdpa_math": ("C7", ":")}
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
    for name, rec in runs.items():
        color, ls = style[name]
        ax1.plot(rec["loss"], color=color, ls=ls, lw=1.2, label=f"{name} (final {rec['loss'][-1]:.4f})")
    cfg = result["config"]
    ax1.axhline(result["ideal_loss"], color="k", lw=0.6, ls="-.", label=f"ideal ≈ {result['ideal_loss']:.3f}")
    ax1.set_ylabel("training loss (nats)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.grid(alpha=0.3)
    steps = len(runs["sdpa"]["loss"])
    for name, d in diffs.items():
        color, _ = style[name]
        label = f"|{name} − sdpa|" + (" (noise floor)" if name == "sdpa_math" else "")
        ax2.semilogy([max(x, 1e-9) for x in d["abs_diff"]], color=color, lw=0.9, label=label)
    ax2.axhline(tol, color="k", ls="--", lw=0.8, label=f"tolerance {tol:g}")
    ax2.axvspan(max(0, steps - LAST), steps - 1, color="C2", alpha=0.12, label=f"last {result['last_steps']} steps")
    ax2.set_xlabel("step")
    ax2.set_ylabel("|Δloss| vs sdpa (0 drawn at 1e-9)")
    ax2.legend(loc="lower right", fontsize=8)
    ax2.grid(alpha=0.3, which="both")
    env = result["environment"]
    fig.suptitle(
        f"nbflash vs SDPA training check — {env['device']}, {result['dtype']}: {result['verdict']}, step-0 gradients "
        f"{'OK' if result['grad0_ok'] else 'OFF'}\n"
        f"{cfg['layers']} layers, d={cfg['d_model']}, {cfg['heads']} heads, N={cfg['seq']}, V={cfg['vocab']}, "
        f"B={cfg['batch']}, commit {env['commit'][:10]}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, help="training steps (default 300; 3 with --smoke)")
    ap.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    ap.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU tensors in the CUDA simulator")
    ap.add_argument("--dry-run", action="store_true", help="build data and model, one SDPA forward, no training")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--period", type=int, help="length of the repeated walk (default 32; 0: half the sequence)")
    ap.add_argument("--branching", type=int, help="successors per token in the Markov chain (default 4)")
    ap.add_argument("--lr", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--tol", type=float, help="override the dtype's tolerance")
    ap.add_argument("--no-floor", action="store_true", help="skip the SDPA-math noise-floor run")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    fields = {f.name for f in dataclasses.fields(Config)}
    cfg = Config(**(SMOKE if args.smoke else {}))
    for key, value in vars(args).items():
        if key in fields and value is not None:
            setattr(cfg, key, value)
    if cfg.d_model % cfg.heads:
        raise SystemExit(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}")

    if args.smoke:
        # CPU tensors need the simulator; Numba reads the switch when nbflash first imports it.
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
        device = torch.device("cpu")
    elif args.dry_run:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("no CUDA GPU: run with --smoke (simulator) or --dry-run (build only)")
    import nbflash

    if args.smoke and not nbflash.SIMULATOR:
        raise SystemExit("--smoke runs CPU tensors in the CUDA simulator, but NUMBA_ENABLE_CUDASIM=0 is set")

    torch.manual_seed(cfg.seed)
    init = copy.deepcopy(TinyGPT(cfg, sdpa).state_dict())
    x_all, y_all = make_batches(cfg)
    data = (x_all.to(device), y_all.to(device))
    params = sum(t.numel() for t in init.values())
    env = environment(device)
    tol = args.tol if args.tol is not None else TOLERANCE[args.dtype]
    print(
        f"train_check: {env['device']}, {args.dtype}; layers={cfg.layers}, d={cfg.d_model}, heads={cfg.heads}, "
        f"N={cfg.seq}, V={cfg.vocab}, B={cfg.batch}, {cfg.steps} steps, {params / 1e6:.2f}M parameters; "
        f"commit {env['commit'][:10]}{' (dirty)' if env['dirty'] else ''}",
        flush=True,
    )

    if args.dry_run:
        model = TinyGPT(cfg, sdpa).to(device)
        model.load_state_dict(init)
        with torch.no_grad():
            logits = model(data[0][0])
            loss = F.cross_entropy(logits.flatten(0, 1), data[1][0].flatten()).item()
        print(
            f"dry run on {device}: logits {tuple(logits.shape)}, initial loss {loss:.4f} (ln V = "
            f"{math.log(cfg.vocab):.4f}); SDPA backend {sdpa_backend(cfg, device, args.dtype)}; no training"
        )
        return 0

    def log(msg):
        print(msg, flush=True)

    runs, grads = {}, {}
    for name in ("sdpa", "nbflash") + (() if args.no_floor else ("sdpa_math",)):
        log(f"run {name}")
        runs[name], grads[name] = train(cfg, RUNS[name], init, data, device, args.dtype, log)

    last = min(LAST, cfg.steps)
    diff = {name: compare(runs[name], runs["sdpa"], last) for name in runs if name != "sdpa"}
    grad_err = {name: grad_rel_error(grads[name], grads["sdpa"]) for name in diff}
    nb = diff["nbflash"]
    floor = diff.get("sdpa_math")
    agree = nb["finite"] and nb["max_last"] <= tol
    verdict = "AGREE" if agree else ("FAIL (non-finite loss)" if not nb["finite"] else "DISAGREE")
    grad_tol = GRAD_TOLERANCE[args.dtype]
    grad_ok = grad_err["nbflash"] <= grad_tol

    result = dict(
        environment=env,
        config=dataclasses.asdict(cfg),
        dtype=args.dtype,
        sdpa_backend=sdpa_backend(cfg, device, args.dtype),
        ideal_loss=ideal_loss(cfg),
        tolerance=tol,
        last_steps=last,
        verdict=verdict,
        agree=agree,
        grad0_tolerance=grad_tol,
        grad0_ok=grad_ok,
        grad0_rel_error_vs_sdpa=grad_err,
        diff=diff,
        runs=runs,
    )
    os.makedirs(args.out, exist_ok=True)
    stem = f"train_check-{env['device'].replace(' ', '-')}-{env['date']}"
    stem += ("" if args.dtype == "float32" else f"-{args.dtype}") + ("-smoke" if args.smoke else "")
    json_path, png_path = os.path.join(args.out, stem + ".json"), os.path.join(args.out, stem + ".png")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    plot(png_path, result)

    log("")
    log(
        f"{'run':10s} {'final loss':>10s} {'last-50 mean':>12s} {'chain':>7s} {'copy':>7s} "
        f"{'wall s':>8s} {'1st step s':>10s} {'ms/step':>8s}"
    )
    for name, rec in runs.items():
        log(
            f"{name:10s} {rec['loss'][-1]:10.4f} {statistics.fmean(rec['loss'][-last:]):12.4f} "
            f"{rec['chain_loss'][-1]:7.3f} {rec['copy_loss'][-1]:7.3f} {rec['wall_s']:8.2f} "
            f"{rec['first_step_s']:10.2f} {rec['median_step_ms']:8.2f}"
        )
    log(
        f"(initial loss ≈ ln V = {math.log(cfg.vocab):.3f}; ideal ≈ {result['ideal_loss']:.3f}: chain ln "
        f"{cfg.branching} = {math.log(cfg.branching):.3f}, copy 0; SDPA backend {result['sdpa_backend']})"
    )
    for name, d in diff.items():
        what = "nbflash − sdpa" if name == "nbflash" else "sdpa_math − sdpa (noise floor)"
        log(
            f"|Δloss| {what}: step 0 {d['step0']:.2e}, max {d['max']:.2e} (step {d['max_step']}), "
            f"last {last} max {d['max_last']:.2e} mean {d['mean_last']:.2e}; "
            f"step-0 gradient rel. error {grad_err[name]:.2e}"
        )
    log(
        f"verdict: {verdict}: max |Δloss| over the last {last} steps {nb['max_last']:.2e} "
        f"{'<=' if agree else '>'} tolerance {tol:g} ({args.dtype})"
    )
    if floor is not None and floor["max_last"] > tol:
        log(
            f"note: the noise floor itself ({floor['max_last']:.2e}) exceeds the tolerance: too tight for this "
            "configuration; judge nbflash against the floor"
        )
    elif floor is not None and nb["max_last"] > 3 * floor["max_last"] and agree:
        log(f"note: within tolerance, but {nb['max_last'] / floor['max_last']:.1f}× the noise floor")
    if floor is not None and nb["finite"] and nb["max"] > 10 * floor["max"]:
        log(
            f"note: nbflash's largest |Δloss| ({nb['max']:.2e}, step {nb['max_step']}) is "
            f"{nb['max'] / max(floor['max'], 1e-30):.0f}× the floor's: look at the figure"
        )
    log(
        f"step-0 gradients: {'OK' if grad_ok else 'OFF'}: relative error {grad_err['nbflash']:.2e} "
        f"{'<=' if grad_ok else '>'} {grad_tol:g} ({args.dtype})"
    )
    log(f"wrote {json_path}\nwrote {png_path}")
    return 0 if agree and grad_ok else 1


if __name__ == "__main__":
    sys.exit(main())
