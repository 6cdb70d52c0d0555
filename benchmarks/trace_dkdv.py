"""Where a block of the Hopper dK/dV kernel spends its time: per-block timestamps (a diagnostic, not a benchmark).

The kernels carry no timers.  ``benchmarks/trace_dkdv.diff`` adds them (a patch, applied to a copy of the tree
it came with, never committed): the dK/dV kernel gets one more argument, an int64 array with a row per block,
which ``launch_backward_wgmma`` allocates and keeps as ``backward_wgmma.LAST_TRACE``; thread 0 (a consumer)
writes ``%clock64`` at the block's phases, and ``%globaltimer`` and ``%smid`` at its start and end (three timer
intrinsics the patch adds to ``nbflash.intrinsics``)::

    git worktree add /tmp/trace HEAD && cd /tmp/trace && git apply benchmarks/trace_dkdv.diff
    python benchmarks/trace_dkdv.py --out OUT          # on an sm_90 GPU: trace, save the rows, summarise
    python benchmarks/trace_dkdv.py --summarize OUT    # the summary again from the saved rows (no GPU)

Column 13 (``stores_start``) has moved with the kernel.  In ``trace-dkdv-H100-2026-12-06-s32.json`` (the patch's
first form, on 5ccb99e) it was not stamped: that summary's ``reduction_wait_us`` and ``stores_us`` are ``null``.
In ``trace-dkdv-H100-2026-12-06-s33.json``, ``default`` (2af8c43, the last step still two 16-bit stores per pair)
stamped it after the wait for the last dQ reduction's read, so ``before_stores_us`` holds that wait;
``staged`` (2af8c43 with ``staged_out``, now the kernel's only last step) and this tree stamp it before the
consumers' barrier, so ``before_stores_us`` holds only the waits for the last products, and ``stores_us`` the
barrier, the staged stores and, after them, the wait for the reduction's read.

For D = 128 and 64, bf16, N = 1k and 4k, causal and not, at batch·N = 16k, heads·D = 2048: the backward's
default configuration for the shape (atomic dQ where it takes it), run five times, the last one traced.  Per
shape (medians over the blocks, µs at the clock the stamps imply): the wait for K_j, V_j and for the first query
tile, the first tile, a steady tile, the last tile, the last step (dK, dV written; from the loop's end to thread
0's last store, and after it the wait for the last dQ reduction's read), split at column 13, and the gap between
one block's end and the next block's start on the same multiprocessor.
Rows go to ``<out>/trace-<D>-<N>-<causal>.npy``, the summary to ``<out>/trace-dkdv-summary.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import numpy as np

#: The row's columns (``%clock64`` unless said): thread 0 of the consumers.
COLUMNS = {
    "start_ns": 0,  # %globaltimer at the block's start
    "kv_landed": 1,  # K_j, V_j's mbarrier passed
    "tile0_landed": 2,  # the first query tile's mbarrier passed
    "loop_end": 3,  # after the last query tile (its dQ added)
    "stores_end": 4,  # after its last dK, dV store
    "producer_issued": 5,  # the producer's first thread, after issuing its last tile
    "smid": 6,
    "tiles": 7,  # query tiles of the block
    "tile0_end": 8,  # the end of the first query tile
    "last_tile_start": 9,  # before the last query tile's wait
    "start": 10,  # %clock64 at the block's start
    "end_ns": 11,  # %globaltimer after its last store
    "wg1_stores_end": 12,  # thread 128 (warpgroup 1) after its last store
    "stores_start": 13,  # before the last step's barrier (the docstring has where older trees stamped it)
}


def summarize(t: np.ndarray) -> dict:
    """Medians over the blocks of one traced launch (rows of :data:`COLUMNS`), in µs."""
    col = {name: t[:, i] for name, i in COLUMNS.items()}
    ghz = float(np.median((col["stores_end"] - col["start"]) / np.maximum(col["end_ns"] - col["start_ns"], 1)))

    def us(cycles):
        return float(np.nanmedian(cycles / ghz / 1e3))

    stamped = bool(np.any(col["stores_start"]))  # the patch's first form left this column zero
    tiles = col["tiles"].astype(float)
    steady = np.where(tiles > 2, (col["last_tile_start"] - col["tile0_end"]) / np.maximum(tiles - 2, 1), np.nan)
    gaps = []  # one block's end to the next block's start on the same multiprocessor
    for sm in np.unique(col["smid"]):
        idx = np.where(col["smid"] == sm)[0]
        order = idx[np.argsort(col["start_ns"][idx])]
        gaps += list((col["start_ns"][order[1:]] - col["end_ns"][order[:-1]]) / 1e3)
    return {
        "blocks": len(t),
        "blocks_per_sm": len(t) / len(np.unique(col["smid"])),
        "clock_ghz": ghz,
        "launch_us": float((col["end_ns"].max() - col["start_ns"].min()) / 1e3),
        "block_us": us(col["stores_end"] - col["start"]),
        "tiles": float(np.median(tiles)),
        "kv_wait_us": us(col["kv_landed"] - col["start"]),
        "tile0_wait_us": us(col["tile0_landed"] - col["start"]),
        "tile0_us": us(col["tile0_end"] - col["tile0_landed"]),
        "steady_tile_us": us(steady),
        "last_tile_us": us(col["loop_end"] - col["last_tile_start"]),
        "last_step_us": us(col["stores_end"] - col["loop_end"]),
        "before_stores_us": us(col["stores_start"] - col["loop_end"]) if stamped else None,
        "stores_us": us(col["stores_end"] - col["stores_start"]) if stamped else None,
        "wg1_stores_after_wg0_us": us(col["wg1_stores_end"] - col["stores_end"]),
        "producer_done_us": us(col["producer_issued"] - col["start"]),
        "sm_gap_us": float(np.median(gaps)) if gaps else None,
        "sm_gap_us_p90": float(np.percentile(gaps, 90)) if gaps else None,
    }


def trace(out: str) -> None:
    """Run and trace every shape on the GPU (a tree with ``trace_dkdv.diff`` applied)."""
    import cupy as cp

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nbflash import api
    from nbflash import backward_wgmma as W

    if not hasattr(W, "LAST_TRACE"):
        sys.exit("this tree's dK/dV kernel has no timers: apply benchmarks/trace_dkdv.diff first")
    for d in (128, 64):
        for n in (1024, 4096):
            for causal in (False, True):
                b, h = 16384 // n, 2048 // d
                rng = cp.random.default_rng(0)
                # bfloat16 bits: the high halves of float32 normals
                q, k, v, do = ((rng.standard_normal((b, h, n, d), dtype=cp.float32).view(cp.uint32) >> 16)
                               .astype(cp.uint16) for _ in range(4))
                o, lse = api.forward_arrays(q, k, v, causal=causal, bf16_bits=True, backend="wgmma")
                cfg = W.config_for(d, "bfloat16", do, q, k, v, o, causal)
                dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
                for _ in range(5):
                    W.launch_backward_wgmma(cfg, do, q, k, v, o, lse, dq, dk, dv, d**-0.5, causal, empty=cp.zeros,
                                            deterministic=not W.takes_atomic(cfg))
                cp.cuda.Device().synchronize()
                np.save(os.path.join(out, f"trace-{d}-{n}-{int(causal)}.npy"), cp.asnumpy(W.LAST_TRACE))
                print(f"D{d} N{n} causal={causal}: {cfg}", flush=True)


def run(doc: str, trace_fn, summarize_fn, pattern: str, key_of, summary_name: str) -> None:
    """The command line of this script and of ``trace_forward.py``: ``--out`` traces on the GPU (``trace_fn``), then
    both summarise the rows saved as ``pattern`` (``summarize_fn`` per file, keyed by ``key_of(file name)``) into
    ``summary_name``; ``--summarize`` only summarises."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", help="trace on the GPU, then summarise: rows and summary go here")
    ap.add_argument("--summarize", help="only summarise the rows saved here")
    args = ap.parse_args()
    where = args.summarize or args.out
    if not where:
        ap.error("give --out (trace) or --summarize (rows already saved)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        trace_fn(args.out)
    summary = {}
    for path in sorted(glob.glob(os.path.join(where, pattern))):
        key = key_of(os.path.basename(path))
        row = summarize_fn(np.load(path))
        summary[key] = row
        print(key, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
    with open(os.path.join(where, summary_name), "w") as f:
        json.dump(summary, f, indent=1)


def _key(name: str) -> str:
    d, n, causal = map(int, re.findall(r"trace-(\d+)-(\d+)-(\d)\.npy", name)[0])
    return f"D{d} N{n} causal={bool(causal)}"


def main() -> None:
    run(__doc__, trace, summarize, "trace-[0-9]*-*-*.npy", _key, "trace-dkdv-summary.json")


if __name__ == "__main__":
    main()
