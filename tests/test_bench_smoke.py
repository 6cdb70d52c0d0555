"""benchmarks/bench.py --smoke: the whole benchmark pipeline, in the simulator, end to end.

It runs the script as a user would (a subprocess) and checks what it leaves behind: the JSON and
CSV with nbflash rows that passed their float64 check and carry finite times, and the PNG plots.
The backward passes are required as soon as ``nbflash.attention_backward`` exists.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
for _module in ("tabulate", "tqdm", "matplotlib"):  # the benchmark's extra, `pip install -e ".[bench]"`
    pytest.importorskip(_module)

import nbflash  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(BENCH), "--smoke", "--out", str(out)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def _expected_passes() -> set[str]:
    return {"forward", "backward", "fwd+bwd"} if hasattr(nbflash, "attention_backward") else {"forward"}


@pytest.mark.slow
def test_json_has_checked_finite_nbflash_rows(smoke):
    out, _ = smoke
    [path] = out.glob("*.json")
    result = json.loads(path.read_text())
    assert result["environment"]["device"] == "simulator"
    rows = [r for r in result["results"] if r["provider"].startswith("nbflash")]
    assert {r["pass"] for r in rows} >= _expected_passes()
    assert {r["dtype"] for r in rows} == {"fp32", "bf16"}  # both routes: array API and the torch bridge
    assert {r["provider"] for r in rows if r["status"] == "ok"} >= {"nbflash-tc", "nbflash-simt"}
    for r in rows:
        if r["pass"] not in _expected_passes():
            continue
        if r["provider"] == "nbflash-tc" and r["dtype"] == "fp32":  # tensor cores: fp16/bf16 only, and say so
            assert r["status"] == "unsupported" and "float16 and bfloat16" in r["reason"], r
            continue
        assert r["status"] == "ok", r
        assert r["check_ratio"] <= 1.0, r
        for key in ("ms", "tflops", "peak_mem_bytes"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
    # the references ran too, and the unsupported combination says why
    assert any(r["provider"] == "sdpa-math" and r["status"] == "ok" for r in result["results"])
    naive_bf16 = [r for r in result["results"] if r["provider"] == "naive" and r["dtype"] == "bf16"]
    assert naive_bf16 and all(r["status"] == "unsupported" and r["reason"] for r in naive_bf16)
    assert any(r["provider"] == "nbflash-simt" and r["status"] == "ok" for r in result["host_overhead"])


@pytest.mark.slow
def test_csv_and_plots(smoke):
    out, proc = smoke
    [path] = out.glob("*.csv")
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["provider"] == "nbflash-simt"]
    assert {r["pass"] for r in rows} >= _expected_passes()
    assert all(math.isfinite(float(r["tflops"])) and float(r["ms"]) > 0 for r in rows if r["status"] == "ok")
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert any(name.endswith("-speed-forward.png") for name in pngs), pngs
    assert any(name.endswith("-memory.png") for name in pngs), pngs
    if "backward" in _expected_passes():
        assert any(name.endswith("-speed-backward.png") for name in pngs), pngs
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "TFLOP/s" in proc.stdout and "nbflash-simt" in proc.stdout  # the terminal table
