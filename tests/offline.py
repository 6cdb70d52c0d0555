"""Run a script with the simulator off, in a subprocess: how the tests compile real kernels with no GPU.

The test process itself runs in Numba's CUDA simulator (CI has no GPU), where
kernels are never type-checked or compiled; NVVM and ptxas (through
nvJitLink) need the real numba-cuda, so each offline check runs its script
in a fresh interpreter with ``NUMBA_ENABLE_CUDASIM=0`` and the repository on
``sys.path``.  The script prints one JSON object per line for the test.
"""

from __future__ import annotations

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
