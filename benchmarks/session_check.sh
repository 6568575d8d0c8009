#!/usr/bin/env bash
# One GPU call for a kernel change: the real-shape bf16 kernel tests, the attention table at a few lengths,
# the stage breakdown and a sweep of the named launch parameters. Run from the repository root:
#   bash benchmarks/session_check.sh LENGTHS SWEEP_LENGTHS SWEEP_PARAMS   (e.g. 2048,8192,65536 65536 select_block_t)
# Wheels in .whl/ (fla-core, for the comparison) are installed to /tmp/site first.
set -o pipefail
OUT=${OUT:-/tmp/nsa-session-check}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 240 python3 -m pytest -q -x tests/test_triton_gpu.py -k bf16_kernels 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
timeout 150 python3 -m nsa bench attention --lengths "$1" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -16
timeout 150 python3 -m nsa bench attention --shapes m7c,paper --lengths 65536 --no-fla --forward-only \
  --components 65536 --sweep "$2" --sweep-params "$3" --out "$OUT/sweep" 2>&1 | tee "$OUT/sweep.log" | tail -45
