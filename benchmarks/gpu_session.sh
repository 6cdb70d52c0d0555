#!/usr/bin/env bash
# One device session: the fp32 comparison (forward and backward), GPU tests, and compute-sanitizer.
# Usage on the GPU machine:  NBFLASH_COMMIT=<sha> bash benchmarks/gpu_session.sh OUT_DIR [SEQLENS]
# (the device copy of the tree has no .git: NBFLASH_COMMIT puts the commit into the results)
out=${1:-benchmarks/results}
seqlens=${2:-2048,8192}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/forward_sweep.py --no-check --backward --seqlens "$seqlens" \
  --out "$out" 2>&1 | grep -v '^{' | tee "$out/compare.txt"
timeout 200 python3 -m pytest tests/test_forward.py tests/test_backward.py tests/test_torch.py tests/test_gpu.py \
  tests/test_intrinsics.py tests/test_forward_tc.py \
  -q -p no:cacheprovider -n 8 -k "not compile and not sm90" > "$out/pytest-gpu.txt" 2>&1
tail -25 "$out/pytest-gpu.txt"
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --report-api-errors no --tool $tool python3 benchmarks/sanitize.py > "$out/sanitizer-$tool.txt" 2>&1
  tail -3 "$out/sanitizer-$tool.txt"
done
