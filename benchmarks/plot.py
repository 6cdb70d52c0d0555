"""Plots from a ``bench.py`` JSON, in the style of FlashAttention's README: speed and memory against sequence length.

    python benchmarks/plot.py benchmarks/results/NVIDIA-H200-2026-12-01.json [--out DIR]

Writes next to the JSON (or into ``--out``):

* ``<stem>-speed-<pass>.png`` for each pass (forward, backward, fwd-bwd): TFLOP/s against N, one
  subplot per (dtype, head dim, causal), one line per provider.  Providers that did not run in a
  subplot are listed at its foot with the reason's kind (unsupported, oom, failed-check, error).
* ``<stem>-memory.png``: peak extra memory against N, log scale, one subplot per (pass, dtype, head
  dim), non-causal (causal allocates the same), one line per provider.

Needs only matplotlib: a committed JSON can be plotted on any machine.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator  # noqa: E402

PASS_ORDER = ("forward", "backward", "fwd+bwd")
DTYPE_ORDER = ("fp16", "bf16", "fp32")


def _seqlen_label(n: float, _pos: Any = None) -> str:
    n = int(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _bytes_label(x: float, _pos: Any = None) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.3g} B"


def _styles(providers: list[str]) -> dict[str, dict[str, Any]]:
    """A fixed colour per provider (registry order), nbflash drawn heavier."""
    colours = plt.get_cmap("tab10").colors
    return {
        name: dict(color=colours[i % len(colours)], marker="o", markersize=4,
                   linewidth=2.6 if name.startswith("nbflash") else 1.4)
        for i, name in enumerate(providers)
    }


def _subtitle(env: dict[str, Any]) -> str:
    commit = (env.get("commit") or "?")[:10] + (" (dirty)" if env.get("commit_dirty") else "")
    return f"{env.get('device', '?')} · commit {commit} · {env.get('date', '')}"


def _shape_note(result: dict[str, Any]) -> str:
    s = result.get("settings", {})
    b = f"batch {s['batch']}" if s.get("batch") else f"batch·N = {s.get('tokens', '?')}"
    h = f"heads {s['heads']}" if s.get("heads") else f"heads·D = {s.get('hidden', '?')}"
    return f"{b}, {h}"


def _not_run(rows: list[dict[str, Any]], width: int = 70) -> str:
    """``status: provider, … (N, …)`` for the providers with rows that did not run, wrapped to ``width``.

    Providers with the same status at the same sequence lengths share one entry; "every N" when a
    provider missed every length of the panel.
    """
    every = sorted({r["seqlen"] for r in rows})
    missing: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if r["status"] != "ok":
            missing.setdefault((r["provider"], r["status"]), []).append(r["seqlen"])
    groups: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    for (provider, status), ns in missing.items():
        groups.setdefault((status, tuple(sorted(set(ns)))), []).append(provider)
    parts = []
    for (status, ns), providers in groups.items():
        where = "every N" if list(ns) == every else ", ".join(_seqlen_label(n) for n in ns)
        parts.append(f"{status}: {', '.join(providers)} ({where})")
    return textwrap.fill("not run: " + "; ".join(parts), width) if parts else ""


def _axis_seqlen(ax: plt.Axes, seqlens: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(seqlens))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(_seqlen_label))
    ax.set_xlabel("sequence length N")
    ax.grid(True, alpha=0.3)


def _grid(n_panels: int, n_cols: int) -> tuple[plt.Figure, list[plt.Axes]]:
    n_rows = -(-n_panels // n_cols)
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(4.6 * n_cols, 3.6 * n_rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _sorted_keys(rows: list[dict[str, Any]], fields: tuple[str, ...]) -> list[tuple]:
    order = {"pass": PASS_ORDER, "dtype": DTYPE_ORDER}
    keys = {tuple(r[f] for f in fields) for r in rows}
    return sorted(keys, key=lambda k: [order[f].index(v) if f in order and v in order[f] else v
                                       for f, v in zip(fields, k, strict=True)])


def plot_speed(result: dict[str, Any], pass_name: str, path: Path) -> Path | None:
    """TFLOP/s against N for one pass: one subplot per (dtype, head dim, causal), a line per provider."""
    rows = [r for r in result["results"] if r["pass"] == pass_name]
    if not rows:
        return None
    styles = _styles(result["providers"])
    panels = _sorted_keys(rows, ("dtype", "head_dim", "causal"))
    fig, axes = _grid(len(panels), min(4, len(panels)))
    for ax, (dtype, d, causal) in zip(axes, panels, strict=True):
        sub = [r for r in rows if (r["dtype"], r["head_dim"], r["causal"]) == (dtype, d, causal)]
        for provider in result["providers"]:
            pts = sorted((r["seqlen"], r["tflops"]) for r in sub if r["provider"] == provider and r["status"] == "ok")
            if pts:
                ax.plot(*zip(*pts, strict=True), label=provider, **styles[provider])
        _axis_seqlen(ax, sorted({r["seqlen"] for r in sub}))
        ax.set_ylim(bottom=0)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dtype}, head dim {d}, {'causal' if causal else 'non-causal'}", fontsize=10)
        note = _not_run(sub)
        if note:  # under the axis; kept out of tight_layout, which would shrink the axes to make room
            ax.text(0.0, -0.24, note, transform=ax.transAxes, fontsize=6.5, color="0.35", va="top").set_in_layout(False)
        ax.legend(fontsize=7, loc="best")
    flops = {"forward": "4·B·H·N²·D", "backward": "2.5 × 4·B·H·N²·D", "fwd+bwd": "3.5 × 4·B·H·N²·D"}[pass_name]
    fig.suptitle(f"Attention {pass_name} speed\n{_subtitle(result['environment'])}\n"
                 f"{_shape_note(result)}; TFLOP/s = {flops} / time (causal: half)", fontsize=11)
    fig.tight_layout(h_pad=4.0)
    fig.subplots_adjust(bottom=fig.subplotpars.bottom + 0.35 / fig.get_figheight())  # room for the last row's notes
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(result: dict[str, Any], path: Path) -> Path | None:
    """Peak extra memory against N (log scale), non-causal: one subplot per (pass, dtype, head dim)."""
    rows = [r for r in result["results"] if not r["causal"]]
    if not any(r["status"] == "ok" for r in rows):
        return None
    styles = _styles(result["providers"])
    panels = _sorted_keys(rows, ("pass", "dtype", "head_dim"))
    n_cols = max(1, len({(r["dtype"], r["head_dim"]) for r in rows}))
    fig, axes = _grid(len(panels), min(n_cols, 6))
    for ax, (pass_name, dtype, d) in zip(axes, panels, strict=True):
        sub = [r for r in rows if (r["pass"], r["dtype"], r["head_dim"]) == (pass_name, dtype, d)]
        for provider in result["providers"]:
            pts = sorted((r["seqlen"], max(r["peak_mem_bytes"], 1)) for r in sub
                         if r["provider"] == provider and r["status"] == "ok")
            if pts:
                ax.plot(*zip(*pts, strict=True), label=provider, **styles[provider])
        _axis_seqlen(ax, sorted({r["seqlen"] for r in sub}))
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_locator(LogLocator(base=2, numticks=8))
        ax.yaxis.set_major_formatter(FuncFormatter(_bytes_label))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("peak extra memory")
        ax.set_title(f"{pass_name}, {dtype}, head dim {d}", fontsize=10)
        ax.legend(fontsize=7, loc="best")
    sim = " (simulator: output bytes only)" if result["environment"].get("device") == "simulator" else ""
    fig.suptitle(f"Peak extra memory per call{sim}, non-causal\n{_subtitle(result['environment'])}\n"
                 f"{_shape_note(result)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(json_path: Path | str, out_dir: Path | str | None = None) -> list[Path]:
    """Every plot for the results in ``json_path``; returns the files written."""
    json_path = Path(json_path)
    result = json.loads(json_path.read_text())
    out = Path(out_dir) if out_dir else json_path.parent
    out.mkdir(parents=True, exist_ok=True)
    written = [plot_speed(result, p, out / f"{json_path.stem}-speed-{p.replace('+', '-')}.png") for p in PASS_ORDER]
    written.append(plot_memory(result, out / f"{json_path.stem}-memory.png"))
    return [p for p in written if p is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="a results JSON written by benchmarks/bench.py")
    ap.add_argument("--out", type=Path, help="folder for the PNGs (default: the JSON's folder)")
    args = ap.parse_args()
    for path in write_plots(args.json, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
