"""Where a persistent block of the Hopper forward spends its time, item by item (a diagnostic, not a benchmark).

The kernels carry no timers.  ``benchmarks/trace_forward.diff`` adds them (a patch, applied to a copy of the tree it
came with, never committed; it and ``trace_dkdv.diff`` both add the timer intrinsics, so apply one at a time): the
forward kernel gets one more argument, an int64 array with a row per work item, which ``launch_forward_wgmma``
allocates and keeps as ``forward_wgmma.LAST_TRACE`` (only that launcher passes it: ``nbflash.attention`` does not
run on the patched tree).  In the ws consumers' item loop, thread 0 (warpgroup 0) writes ``%clock64`` at an item's
start, after its Q_i has landed and at its end, ``%globaltimer`` at its start and end, ``%smid``, the block and the
item's position among the block's items; the last consumer warpgroup's first thread writes ``%clock64`` at the
item's start and end too, and the producer's first thread once it has issued the item's first K/V tile (three timer
intrinsics the patch adds to ``nbflash.intrinsics``)::

    git worktree add /tmp/trace HEAD && cd /tmp/trace && git apply benchmarks/trace_forward.diff
    python benchmarks/trace_forward.py --out OUT          # on an sm_90 GPU: trace, save the rows, summarise
    python benchmarks/trace_forward.py --summarize OUT    # the summary again from the saved rows (no GPU)

Traced (bf16, D = 64, batch·N = 16k, heads·D = 2048, non-causal at N = 2k, 4k and 16k, causal at 2k): the 192 × 128
three-consumer kernel persistent and with one block per item, and the 128 × 192 two-consumer kernel persistent, each
launched five times and the last launch kept. Per run (medians over items, µs at the clock rate the stamps imply):
an item's time from start to end, for a block's first item and for its later ones; the wait for Q_i; the gap from
one item's end to the next item's start in the same block; how far the last consumer warpgroup ends after warpgroup
0; how long before an item's start the producer had issued its first K/V tile. Session 36 found the persistent
three-consumer kernel 10–20 % slower at 2k–4k keys than with one block per item, still 10 % with a quarter of the
items per block; this says whether its later items run slower than its first.

Rows go to ``<out>/trace-<tag>-<N>-<causal>.npy``, the summary to ``<out>/trace-forward-summary.json``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.trace_dkdv import run  # noqa: E402

#: The row's columns (``%clock64`` unless said): thread 0 of the consumers, then the last consumer warpgroup's.
COLUMNS = {
    "start_ns": 0,  # %globaltimer at the item's start
    "start": 1,  # the item's start (before its Q_i wait)
    "q_landed": 2,  # its Q_i's mbarrier passed
    "end": 3,  # after its last product (and, without the seam, after O is written)
    "end_ns": 4,  # %globaltimer at its end
    "smid": 5,
    "block": 6,
    "position": 7,  # the block's items with key tiles before this one
    "last_wg_start": 8,  # the last consumer warpgroup's first thread: the item's start ...
    "last_wg_end": 9,  # ... and its end
    "tiles": 10,  # the item's key tiles
    "producer_k0": 11,  # the producer's first thread, once it has issued the item's K_0
}
C = COLUMNS


def summarize(t: np.ndarray) -> dict:
    """Medians over the items of one traced launch (µs)."""
    t = t[t[:, C["start"]] != 0]
    first = t[:, C["position"]] == 0
    item = (t[:, C["end"]] - t[:, C["start"]]).astype(np.float64)
    ns = (t[:, C["end_ns"]] - t[:, C["start_ns"]]).astype(np.float64)
    cycles = (t[:, C["end"]] - t[:, C["start"]]).astype(np.float64)
    ghz = float(np.median(cycles[ns > 0] / ns[ns > 0]))  # clock64 ticks per ns

    def us(x):
        return float(np.median(x)) / ghz / 1e3 if len(x) else None

    gaps = []
    for blk in np.unique(t[:, C["block"]]):
        rows = t[t[:, C["block"]] == blk]
        rows = rows[np.argsort(rows[:, C["position"]])]
        gaps += list(rows[1:, C["start"]] - rows[:-1, C["end"]])
    span_ns = float(t[:, C["end_ns"]].max() - t[:, C["start_ns"]].min())
    t0 = t[:, C["start_ns"]].min()
    blocks, counts = np.unique(t[:, C["block"]], return_counts=True)
    ends = np.array([t[t[:, C["block"]] == blk, C["end_ns"]].max() - t0 for blk in blocks], np.float64) / 1e3
    per_tile = item / np.maximum(t[:, C["tiles"]], 1)
    return {
        "items": int(len(t)), "blocks": int(len(np.unique(t[:, C["block"]]))), "clock_ghz": ghz,
        "tiles_median": float(np.median(t[:, C["tiles"]])),
        "item_us_first": us(item[first]), "item_us_later": us(item[~first]),
        "tile_us_first": us(item[first] / np.maximum(t[first, C["tiles"]], 1)),
        "tile_us_later": us(item[~first] / np.maximum(t[~first, C["tiles"]], 1)),
        "q_wait_us": us(t[:, C["q_landed"]] - t[:, C["start"]]),
        "gap_us": us(np.asarray(gaps, np.float64)),
        "last_wg_end_after_wg0_us": us(t[:, C["last_wg_end"]] - t[:, C["end"]]),
        # > 0: the producer had issued the item's first K/V tile that long before the consumers started the item
        "producer_lead_us": us(t[:, C["start"]] - t[:, C["producer_k0"]]),
        "launch_span_us": span_ns / 1e3,
        # when each block finished (µs from the launch's first start): a persistent grid ends with its slowest block
        "block_end_us": [float(np.percentile(ends, p)) for p in (0, 50, 100)],
        "items_per_block": [int(x) for x in (np.min(counts), np.max(counts))],
        # items whose time per key tile is over 12 % above the median: the slow mode (bimodal, see the docstring)
        "slow_item_fraction": float(np.mean(per_tile > 1.12 * np.median(per_tile))),
        # ... and the blocks with most of their items in it (persistent: a block stays in its mode)
        "slow_blocks": int(sum(np.mean(per_tile[t[:, C["block"]] == blk] > 1.12 * np.median(per_tile)) > 0.5
                               for blk in np.unique(t[:, C["block"]]))),
    }


def trace(out: str) -> None:
    """Run and trace every case on the GPU (a tree with ``trace_forward.diff`` applied)."""
    import cupy as cp

    from nbflash import forward_wgmma as W

    if not hasattr(W, "LAST_TRACE"):
        sys.exit("this tree's forward kernel has no timers: apply benchmarks/trace_forward.diff first")
    base = W.WGConfig(192, 128, 64, "bfloat16", "ws-overlap", stages=3, copies="tma", setmaxnreg=True)
    cases = {"wg192x128-p": dataclasses.replace(base, persistent=True), "wg192x128-np": base,
             "wg128x192-p": dataclasses.replace(base, block_m=128, block_n=192, persistent=True),
             "wg192x128-pd": dataclasses.replace(base, persistent=True, dynamic=True)}
    d = 64
    for n, causal in ((2048, False), (4096, False), (16384, False), (2048, True)):
        b, h = 16384 // n, 2048 // d
        rng = cp.random.default_rng(0)
        # bfloat16 bits: the high halves of float32 normals
        q, k, v = ((rng.standard_normal((b, h, n, d), dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)
                   for _ in range(3))
        o, lse = cp.empty_like(q), cp.empty((b, h, n), cp.float32)
        for name, cfg in cases.items():
            for _ in range(5):
                W.launch_forward_wgmma(cfg, q, k, v, o, lse, 1 / math.sqrt(d), causal)
            cp.cuda.Device().synchronize()
            np.save(os.path.join(out, f"trace-{name}-{n}-{int(causal)}.npy"), cp.asnumpy(W.LAST_TRACE))
            print(f"{name} N{n} causal={causal}: {cfg}", flush=True)


def _key(name: str) -> str:
    tag, n, causal = re.findall(r"trace-(wg.+)-(\d+)-(\d)\.npy", name)[0]
    return f"{tag} N{n} causal={bool(int(causal))}"


def main() -> None:
    run(__doc__, trace, summarize, "trace-wg*-*-*.npy", _key, "trace-forward-summary.json")


if __name__ == "__main__":
    main()
