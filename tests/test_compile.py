"""Every kernel configuration the API can pick compiles for the GPU (sm_90) — checked without a GPU.

The simulator runs kernels as plain Python and never type-checks them, so a
kernel can pass every simulator test and still fail to compile.  Here each
configuration is compiled to PTX by NVVM (the CUDA toolkit wheels that
``numba-cuda[cu13]`` installs; no driver needed), in fresh processes with the
simulator off, and the PTX is checked for register arrays spilled to local
memory (``ld.local``/``st.local``), which would make the kernel slow.

The kernels of one family (the same kernel, tile shape, thread layout and
types) differ only in their padded head dim, a constant of the unrolled
loops.  By default each family is compiled at its smallest and largest
padded head dim (the shortest and the longest register arrays) and at its
smallest one that is not a power of two (loop counts that are not): 182 of
the 452 kernels (all of them took about 15 minutes of both of CI's two
cores).  ``NBFLASH_PTX_ALL=1`` compiles every one.
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
import dataclasses, json, os, re, sys, time
from nbflash._device import SIMULATOR, compile_ptx_offline
assert not SIMULATOR
import importlib
module_name, part, parts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
targets = importlib.import_module(module_name).compile_targets()
if not os.environ.get("NBFLASH_PTX_ALL"):
    def family(target):
        name, cfg = target[:2]
        return name, tuple(getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "head_dim_pad")
    pads = {}
    for target in targets:
        pads.setdefault(family(target), []).append(target[1].head_dim_pad)
    keep = {f: {min(p), max(p), *[d for d in sorted(p) if d & (d - 1)][:1]} for f, p in pads.items()}
    targets = [t for t in targets if t[1].head_dim_pad in keep[family(t)]]
targets = targets[part::parts]
print(json.dumps(dict(targets=len(targets))), flush=True)
for name, cfg, kern, sig, fastmath in targets:
    t = time.perf_counter()
    ptx = compile_ptx_offline(kern.py_func, sig, cc=(9, 0), fastmath=fastmath)
    print(json.dumps(dict(kernel=name, config=repr(cfg), seconds=round(time.perf_counter() - t, 2),
                          local=len(re.findall(r"\b(?:ld|st)\.local", ptx)),
                          entry=".entry" in ptx)), flush=True)
"""


def _compile_all(module):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")

    def run(part):
        return subprocess.run([sys.executable, "-c", SCRIPT, module, str(part), str(WORKERS)], env=env,
                              capture_output=True, text=True)

    with ThreadPoolExecutor(WORKERS) as pool:
        procs = list(pool.map(run, range(WORKERS)))
    rows, expected = [], 0
    for p in procs:
        assert p.returncode == 0, p.stderr[-3000:]
        lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        expected += lines[0]["targets"]
        rows += lines[1:]
    assert len(rows) == expected > 0, f"compiled {len(rows)} of {expected} targets"
    return rows


@pytest.mark.offline
@pytest.mark.parametrize("module", ["nbflash.forward", "nbflash.backward"])
def test_every_configuration_compiles_to_ptx(module):
    pytest.importorskip("numba.cuda")
    rows = _compile_all(module)
    bad = [r for r in rows if not r["entry"] or r["local"]]
    assert not bad, bad
