"""Run a script with the simulator off, in a subprocess: how the tests compile real kernels with no GPU.

The test process itself runs in Numba's CUDA simulator (CI has no GPU), where
kernels are never type-checked or compiled; NVVM and ptxas (through
nvJitLink) need the real numba-cuda, so each offline check runs its script
in a fresh interpreter with ``NUMBA_ENABLE_CUDASIM=0`` and the repository on
``sys.path``.  The script prints one JSON object per line for the test.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def offline_json_rows(script: str, *args: str, timeout: int = 900) -> list[dict]:
    """``script``'s JSON lines, run as ``python -c script *args`` with the simulator off (skipped without
    nvJitLink); its stderr is the failure message if it exits non-zero."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


# The wgmma kernels' sm_90a checks run in this many tests (and subprocesses), so that pytest-xdist spreads the
# compiles over its workers: a warp-specialised kernel takes 1-2 minutes on one of CI's cores (Numba's typing and
# lowering most of it), and the whole forward list in one process ran past half an hour there.
OFFLINE_PARTS = 4


def part_of(targets, parts: int = OFFLINE_PARTS) -> list[int]:
    """The part (of ``parts``) each of ``targets`` (``compile_targets()``'s ``(name, cfg, ...)`` rows) is compiled
    in.  A kernel with ``poly_exp2`` shares its part with the same kernel without it, which a test compares it
    with; the other kernels go round the parts in order."""
    def group(row):
        name, cfg = row[:2]
        return name, dataclasses.replace(cfg, poly_exp2=0) if hasattr(cfg, "poly_exp2") else cfg

    groups = list(dict.fromkeys(map(group, targets)))
    return [groups.index(group(row)) % parts for row in targets]


def find_nvdisasm():
    """nvdisasm from $NVDISASM, the PATH, or the ``nvidia-cuda-nvdisasm`` wheel; None if absent."""
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    if shutil.which("nvdisasm"):
        return shutil.which("nvdisasm")
    for base in sys.path:
        for path in glob.glob(os.path.join(base, "nvidia", "cu*", "bin", "nvdisasm")):
            if os.access(path, os.X_OK):
                return path
    return None
