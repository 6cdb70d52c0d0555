"""Every kernel configuration the API can pick compiles for the GPU (sm_90) — checked without a GPU.

The simulator runs kernels as plain Python and never type-checks them, so a
kernel can pass every simulator test and still fail to compile.  Here each
configuration is compiled to PTX by NVVM (the CUDA toolkit wheels that
``numba-cuda[cu13]`` installs; no driver needed), in fresh processes with the
simulator off, and the PTX is checked for register arrays spilled to local
memory (``ld.local``/``st.local``), which would make the kernel slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

WORKERS = 2

SCRIPT = r"""
import json, re, sys, time
from nbflash._device import SIMULATOR, compile_ptx_offline
assert not SIMULATOR
import importlib
module_name, start, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mod = importlib.import_module(module_name)
for i, (name, cfg, kern, sig, fastmath) in enumerate(mod.compile_targets()):
    if not start <= i < stop:
        continue
    t = time.perf_counter()
    ptx = compile_ptx_offline(kern.py_func, sig, cc=(9, 0), fastmath=fastmath)
    print(json.dumps(dict(kernel=name, config=repr(cfg), seconds=round(time.perf_counter() - t, 2),
                          local=len(re.findall(r"\b(?:ld|st)\.local", ptx)),
                          entry=".entry" in ptx)), flush=True)
"""


def _count(module):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", f"import {module} as m; print(len(m.compile_targets()))"],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _compile_all(module):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    n = _count(module)
    chunks = [(i * n // WORKERS, (i + 1) * n // WORKERS) for i in range(WORKERS)]

    def run(chunk):
        return subprocess.run([sys.executable, "-c", SCRIPT, module, str(chunk[0]), str(chunk[1])], env=env,
                              capture_output=True, text=True)

    with ThreadPoolExecutor(WORKERS) as pool:
        procs = list(pool.map(run, chunks))
    rows = []
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
        rows += [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == n, f"compiled {len(rows)} of {n} targets"
    return rows


@pytest.mark.parametrize("module", ["nbflash.forward", "nbflash.backward"])
def test_every_configuration_compiles_to_ptx(module):
    pytest.importorskip("numba.cuda")
    rows = _compile_all(module)
    bad = [r for r in rows if not r["entry"] or r["local"]]
    assert not bad, bad
