#!/usr/bin/env bash
# One call on a GPU machine: the kernel tests at real shapes, then `nsa bench attention`.
# Run from the repository root; extra arguments go to `nsa bench attention`.
# --full-tests (first) adds the tiny-shape kernel tests (several minutes of compiling on the device).
# Wheels in .whl/ (e.g. fla-core, for the comparison) are installed to /tmp/site first.
set -o pipefail
OUT=${OUT:-/tmp/nsa-gpu-check}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
tests="tests/test_triton_gpu.py tests/test_triton_decode.py"
if [[ ${1:-} == --full-tests ]]; then
  tests="$tests tests/test_triton_kernels.py"
  shift
fi
python3 -m pytest -q $tests 2>&1 | tee "$OUT/gpu_tests.log"
python3 -m nsa bench attention --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
