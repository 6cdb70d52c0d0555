#!/usr/bin/env bash
# The Hopper picks beside SDPA's cuDNN and flash backends, each checked against float64 first: what issue 7's
# targets are measured by.  Two steps, each under ten minutes on an H100 / H200 with 16 cores (run them as two
# device calls: STEP=forward, then STEP=backward; the second loads the forward's kernels from the disk cache
# when the machine has kept its files).
# Usage on the GPU machine:  NBFLASH_COMMIT=<sha> NUMBA_CACHE_DIR=<dir> STEP=forward bash benchmarks/hopper_picks.sh OUT
#
# forward: the tiles config_for picks at D = 64 and 128 (tc_sweep.py tags; `wg-default` is only the short-key
#   pick): 128 x 128 ws-overlap persistent (D = 128; D = 64 below 2k keys), 128 x 128 one block per item (D = 128,
#   non-causal from 16k keys), 192 x 128 three consumers with the dynamic scheduler (D = 64 non-causal from 2k),
#   128 x 192 with the seam step (D = 64 causal, 2k to 8k) and without (from 8k); bf16 and fp16, N = 512 ... 16k.
# backward: the wgmma backward's picks (D = 128: ws dK/dV with bulk dQ; D = 64: the same with dQ's product
#   under dV's and dK's), by their atomic route only, the default (tc_backward.cfg_routes: bulk_dq changes
#   nothing else).
out=${1:?results folder}
seqlens=${SEQLENS:-512,1024,2048,4096,8192,16384}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
case ${STEP:-forward} in
  forward)
    timeout 560 python3 benchmarks/tc_sweep.py --dims 64,128 --dtypes bf16,fp16 --seqlens "$seqlens" --jobs 16 \
      --configs wg128x128-wso3-tma-r-p,wg128x128-wso3-tma-r,wg192x128-wso3-tma-r-pd,wg128x192-wso3-tma-r-p-seam,wg128x192-wso3-tma-r-p \
      --out "$out" --suffix="${SUFFIX:--picks}" 2>&1 | grep -v '^{' ;;
  backward)
    timeout 560 python3 benchmarks/tc_backward.py --dims 64,128 --dtypes bf16,fp16 --seqlens "$seqlens" --jobs 16 \
      --configs wg128x64s23wb@128,wg128x64s23wbo@64 --atomic --only --no-simt \
      --out "$out" --suffix="${SUFFIX:--picks}" 2>&1 | grep -v '^{' ;;
  *) echo "STEP must be forward or backward" >&2; exit 2 ;;
esac
