"""Numba's on-disk kernel cache (``nbflash/_device.py``, ``_KernelCache``): never two configurations confused.

The CPU tests need no GPU and no simulator: each runs nbflash in a fresh
process with ``NUMBA_ENABLE_CUDASIM=0`` (as ``tests/test_compile.py`` does),
creates the kernels of every configuration the API can pick, and computes
their cache index keys with a stand-in for the GPU's code generator (which
only contributes the CUDA runtime version and the compute capability).  They
check that

* different configurations get different keys — except the two step-0/2'
  backward kernels, which never read the padded head dim and so share one
  compiled kernel across configurations that differ in it alone;
* the same configuration gets the same key in two processes (with different
  hash seeds), so a second process can hit;
* entries saved by one process load in another, each under its own key, also
  when eight processes save at the same time (``pytest -n 8``);
* ``NBFLASH_DISK_CACHE=0`` turns the cache off, and ``NUMBA_CACHE_DIR`` moves it.

The GPU test (skipped without one) runs the real kernels: process 1 fills an
empty cache directory, process 2 runs the same cases in the opposite order
from it; both check every output against the float64 reference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import nbflash

FAMILIES = ["nbflash.forward", "nbflash.forward_tc", "nbflash.backward", "nbflash.backward_tc"]

# Shared by the scripts below: a code generator and a target context that need no GPU, and a stand-in for
# a compiled kernel whose payload names its configuration.
FAKES = r"""
import dataclasses, hashlib, importlib, json, sys

class Codegen:
    def magic_tuple(self):
        return ((13, 0), (9, 0))  # (CUDA runtime version, compute capability) on a GPU

class Context:
    def refresh(self):
        pass

    def codegen(self):
        return Codegen()

class FakeKernel:
    codegen = Codegen()

    def __init__(self, tag):
        self.tag = tag

    def _reduce_states(self):
        return dict(cooperative=False, name=self.tag, signature=None, codelibrary=None, debug=False,
                    lineinfo=False, call_helper=None, extensions=[])

def targets(module):
    return importlib.import_module(module).compile_targets()

def key_hash(kern, sig):
    return hashlib.sha256(repr(kern._cache._index_key(tuple(sig), Codegen())).encode()).hexdigest()
"""

KEYS = FAKES + r"""
for module in sys.argv[1:]:
    for name, cfg, kern, sig, _ in targets(module):
        assert type(kern._cache).__name__ == "_KernelCache", type(kern._cache)
        print(json.dumps(dict(module=module, kernel=name, config=repr(cfg), key=key_hash(kern, sig),
                              cache_path=kern._cache.cache_path)))
from nbflash import forward
cfg = forward.choose_config(64, "float32", simulator=False)
assert cfg.min_blocks
for c in (cfg, dataclasses.replace(cfg, min_blocks=0)):  # the same closure; launch bounds differ
    kern = forward.forward_kernel(c)
    print(json.dumps(dict(module="min_blocks", kernel="flash_forward", config=repr(c),
                          key=key_hash(kern, forward.kernel_signature(c)))))
"""

# argv: "save" (every n-th target from the i-th, after waiting for the wall-clock time t) or "load", then the
# modules; each entry is tagged with its kernel name and configuration.
SAVE_LOAD = FAKES + r"""
import time
mode, i, n, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
found = []
todo = [target for module in sys.argv[5:] for target in targets(module)]
while time.time() < t:  # start with the other processes
    pass
for name, cfg, kern, sig, _ in todo[i::n]:
    tag = f"{name} {cfg!r}"
    if mode == "save":
        kern._cache.save_overload(tuple(sig), FakeKernel(tag))
    else:
        got = kern._cache.load_overload(tuple(sig), Context())
        found.append([tag, None if got is None else got.entry_name])
print(json.dumps(found))
"""


def _run(script: str, *args: str, env: dict | None = None, seed: str = "0") -> subprocess.CompletedProcess:
    env = dict(env or os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONHASHSEED=seed)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True)


def _env(tmp_path, **extra) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **extra)
    if "NBFLASH_DISK_CACHE" not in extra:
        env.pop("NBFLASH_DISK_CACHE", None)
    return env


def _keys(tmp_path, seed: str) -> list[dict]:
    p = _run(KEYS, *FAMILIES, env=_env(tmp_path), seed=seed)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """The keys of every target, computed in two processes with different hash seeds."""
    tmp = tmp_path_factory.mktemp("keys")
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda seed: _keys(tmp, seed), ("1", "2")))


def _without_head_dim_pad(config: str) -> str:
    return re.sub(r"head_dim_pad=\d+", "head_dim_pad=*", config)


def test_every_family_is_cached_under_numba_cache_dir(keys, tmp_path_factory):
    rows = keys[0]
    assert {r["module"] for r in rows} >= set(FAMILIES)
    root = str(tmp_path_factory.getbasetemp())
    assert all(r["cache_path"].startswith(root) for r in rows if "cache_path" in r)


def test_different_configurations_get_different_keys(keys):
    by_key: dict[str, list[dict]] = {}
    for r in (r for r in keys[0] if r["module"] in FAMILIES):
        by_key.setdefault(r["key"], []).append(r)
    for group in by_key.values():
        if len(group) == 1:
            continue
        # The one sharing allowed: step 0 / step 2' kernels loop over the run-time head dim and never read
        # the padded one, so configurations that differ only in head_dim_pad compile to the same code.
        kernels = {r["kernel"] for r in group}
        assert len(kernels) == 1 and kernels <= {"flash_backward_preprocess", "flash_backward_dq_convert"}, group
        assert len({_without_head_dim_pad(r["config"]) for r in group}) == 1, group
    # Launch bounds are a target option, not a closure constant: they must still split the key.
    min_blocks = [r["key"] for r in keys[0] if r["module"] == "min_blocks"]
    assert len(min_blocks) == 2 and min_blocks[0] != min_blocks[1]
    # Every family has configurations to tell apart.
    for family in FAMILIES:
        family_keys = [r["key"] for r in keys[0] if r["module"] == family]
        assert len(set(family_keys)) > 1, family


def test_same_configuration_same_key_in_another_process(keys):
    first, second = keys
    assert [(r["kernel"], r["config"], r["key"]) for r in first] == [
        (r["kernel"], r["config"], r["key"]) for r in second
    ]


def _save_load(env, savers: int) -> list[list[str]]:
    """``savers`` processes save disjoint slices of every target at the same instant; a new process loads all."""
    start = str(time.time() + 8)  # after every saver has imported nbflash and made its kernels

    def save(i):
        return _run(SAVE_LOAD, "save", str(i), str(savers), start, *FAMILIES, env=env, seed=str(i))

    with ThreadPoolExecutor(savers) as pool:
        saves = list(pool.map(save, range(savers)))
    assert all(p.returncode == 0 for p in saves), [p.stderr[-2000:] for p in saves if p.returncode]
    p = _run(SAVE_LOAD, "load", "0", "1", "0", *FAMILIES, env=env, seed="99")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def _check_entries(found: list[list[str]]) -> None:
    """Every target hits its own entry (the shared step-0/2' kernels: that of a twin configuration)."""
    assert found
    wrong = []
    for tag, got in found:
        name, config = tag.split(" ", 1)
        if got is None:
            wrong.append((tag, got))
        elif name in ("flash_backward_preprocess", "flash_backward_dq_convert"):
            got_name, got_config = got.split(" ", 1)
            if got_name != name or _without_head_dim_pad(got_config) != _without_head_dim_pad(config):
                wrong.append((tag, got))
        elif got != tag:
            wrong.append((tag, got))
    assert not wrong, f"{len(wrong)} of {len(found)} entries missing or foreign: {wrong[:3]}"


def test_entries_saved_by_one_process_load_in_another(tmp_path):
    _check_entries(_save_load(_env(tmp_path), savers=1))


def test_concurrent_processes_never_mix_entries(tmp_path):
    """Eight processes save different configurations of the same kernels at once (pytest -n 8).

    Numba's own cache keeps all configurations of a kernel in one index file, rewritten without a lock:
    this loses entries and points some keys at another configuration's data file.
    """
    _check_entries(_save_load(_env(tmp_path), savers=8))


OFF = r"""
import json
from nbflash import _device, forward, forward_tc
kernels = [forward.forward_kernel(forward.choose_config(64, "float32", simulator=False)),
           forward_tc.forward_tc_kernel(forward_tc.choose_config(64, "float16", simulator=False))]
print(json.dumps(dict(enabled=_device.disk_cache_enabled(), caches=[type(k._cache).__name__ for k in kernels])))
"""


# Fingerprints of every target, then one kernel of each forward family compiled to PTX, then the fingerprints again.
KEYS_AFTER_COMPILE = FAKES + r"""
from nbflash import _device, forward, forward_tc
every = [(f"{name} {cfg!r}", kern) for module in sys.argv[1:] for name, cfg, kern, _, _ in targets(module)]
before = {tag: _device.kernel_fingerprint(kern) for tag, kern in every}
for mod, cfg in ((forward, forward.choose_config(64, "float16", simulator=False)),
                 (forward_tc, forward_tc.choose_config(16, "bfloat16", simulator=False))):
    _device.compile_ptx_offline(getattr(mod, "forward_kernel" if mod is forward else "forward_tc_kernel")(cfg).py_func,
                                mod.kernel_signature(cfg), cc=(9, 0), fastmath=True)
print(json.dumps(sorted(tag for tag, kern in every if _device.kernel_fingerprint(kern) != before[tag])))
"""


def test_key_does_not_change_when_kernels_compile(tmp_path):
    """Compiling fills caches inside the objects a key is made of (Numba types, llvmlite types): the key must not
    see them, or a kernel compiled after others (a warm process runs in another order) misses its entry."""
    p = _run(KEYS_AFTER_COMPILE, *FAMILIES, env=_env(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("value,enabled", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_environment_variable_turns_the_cache_off(tmp_path, value, enabled):
    extra = {} if value is None else {"NBFLASH_DISK_CACHE": value}
    p = _run(OFF, env=_env(tmp_path, **extra))
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.splitlines()[-1])
    assert got["enabled"] is enabled
    assert set(got["caches"]) == {"_KernelCache" if enabled else "NullCache"}


def test_never_in_the_simulator():
    if not nbflash.SIMULATOR:
        pytest.skip("this process runs on a GPU")
    from nbflash import _device

    assert not _device.disk_cache_enabled()


# ----------------------------------------------------------------------------
# On a GPU: the real kernels, cold and warm
# ----------------------------------------------------------------------------

GPU_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import cupy as cp
import numpy as np
import nbflash
from nbflash._device import disk_cache_stats
from nbflash.reference import attention_backward_ref, attention_ref

# Pairs that differ only in the tile configuration (same dtype, so the same kernel signatures).
CASES = [("simt", "float32", 64), ("simt", "float32", 128), ("tensor_core", "float16", 64),
         ("tensor_core", "float16", 128)]
TOL = {"float32": 1e-3, "float16": 2e-2}  # max error / max |reference|; a confused kernel is off by O(1)
order = CASES if sys.argv[1] == "forward" else CASES[::-1]
rows = []
for backend, dtype, d in order:
    rng = np.random.default_rng(d)
    q, k, v, do = (rng.standard_normal((1, 2, 300, d)).astype(dtype) for _ in range(4))
    t = time.perf_counter()
    dev = [cp.asarray(x) for x in (q, k, v, do)]
    o, lse = nbflash.attention(*dev[:3], causal=True, return_lse=True, backend=backend)
    grads = nbflash.attention_backward(dev[3], *dev[:3], o, lse, causal=True, backend=backend)
    cp.cuda.runtime.deviceSynchronize()
    seconds = time.perf_counter() - t
    want = (attention_ref(q, k, v, causal=True)[0], *attention_backward_ref(do, q, k, v, causal=True))
    errors = [float(np.abs(cp.asnumpy(g).astype(np.float64) - w).max() / np.abs(w).max())
              for g, w in zip((o, *grads), want)]
    rows.append(dict(backend=backend, dtype=dtype, head_dim=d, seconds=seconds, errors=errors,
                     ok=all(e <= TOL[dtype] for e in errors)))
print(json.dumps(dict(rows=rows, total_s=time.perf_counter() - t0, **disk_cache_stats())))
"""


@pytest.mark.gpu
def test_gpu_second_process_loads_from_disk(tmp_path):
    env = _env(tmp_path)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    runs = []
    for order in ("forward", "reverse"):
        p = subprocess.run([sys.executable, "-c", GPU_SCRIPT, order], env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.splitlines()[-1]))
    cold, warm = runs
    print(json.dumps(runs, indent=1))
    for run in runs:
        assert all(r["ok"] for r in run["rows"]), run["rows"]
    assert list(tmp_path.rglob("*.nbi")), "nothing was written under NUMBA_CACHE_DIR"
    # The cold process compiled (its shared step-0/2' kernels may already hit), the warm one compiled nothing.
    assert cold["misses"] > 0
    assert warm["misses"] == 0 and warm["hits"] == cold["hits"] + cold["misses"], warm["missed"]
    # Faster to the first result, and to all of them.
    assert warm["rows"][0]["seconds"] < cold["rows"][0]["seconds"]
    assert sum(r["seconds"] for r in warm["rows"]) < sum(r["seconds"] for r in cold["rows"])
