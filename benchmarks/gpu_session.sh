#!/usr/bin/env bash
# One device session: tensor-core and fp32 comparisons, launch overhead, GPU tests, compute-sanitizer.
# Usage on the GPU machine:  NBFLASH_COMMIT=<sha> bash benchmarks/gpu_session.sh OUT_DIR [SEQLENS]
# (the device copy of the tree has no .git: NBFLASH_COMMIT puts the commit into the results)
# About 15 minutes in all; each step has its own time limit, so one slow step cannot eat the rest.
out=${1:-benchmarks/results}
seqlens=${2:-2048,8192}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/tc_sweep.py --out "$out" 2>&1 | grep -v '^{' | tee "$out/tc-forward.txt"
timeout 300 python3 benchmarks/tc_backward.py --out "$out" 2>&1 | grep -v '^{' | tee "$out/tc-backward.txt"
timeout 150 python3 benchmarks/overhead.py --out "$out" --skip-subprocess 2>&1 | tail -25
timeout 120 python3 benchmarks/forward_sweep.py --no-check --backward --seqlens "$seqlens" \
  --out "$out" 2>&1 | grep -v '^{' | tee "$out/compare.txt"
timeout 240 python3 -m pytest tests/test_forward.py tests/test_backward.py tests/test_torch.py tests/test_gpu.py \
  tests/test_intrinsics.py tests/test_forward_tc.py tests/test_backward_tc.py tests/test_launch.py \
  -q -p no:cacheprovider -n 8 -k "not compile and not sm90" > "$out/pytest-gpu.txt" 2>&1
tail -25 "$out/pytest-gpu.txt"
# Under the sanitizer every kernel compiles and runs many times slower: give it minutes (60 s timed out).
for tool in memcheck racecheck; do
  timeout 240 compute-sanitizer --report-api-errors no --tool $tool python3 benchmarks/sanitize.py > "$out/sanitizer-$tool.txt" 2>&1
  tail -3 "$out/sanitizer-$tool.txt"
done
