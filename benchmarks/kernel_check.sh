#!/usr/bin/env bash
# Kernel tuning on a GPU machine, in one call: which selected-branch path wins at which length
# (tiled vs gathered) and the range kernels' launch parameters, at training-like batches.
# Run from the repository root after `bash benchmarks/gpu_check.sh`; extra arguments go to the bench.
set -o pipefail
OUT=${OUT:-/tmp/nsa-kernel-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m nsa bench attention --shapes m7c --lengths 2048,8192 --batch 16 --no-fla --sweep 2048,8192 \
  --out "$OUT" "$@" 2>&1 | tee "$OUT/sweep.log"
