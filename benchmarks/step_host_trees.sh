#!/usr/bin/env bash
# benchmarks/step_host.py at this tree and at older ones, one GPU call, each in its own process:
#   TREES="cd7ac93 7f46ab6" PROFILE_TREES="cd7ac93" bash benchmarks/step_host_trees.sh
# An older tree REV is a folder .old/REV holding its nsa/ and configs/ (git archive REV nsa configs | tar -x -C
# .old/REV); carry .old to the device. PHI_TORCH=1 adds this tree with phi's MLP as PyTorch operations.
set -o pipefail
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/nsa-step-host}
mkdir -p "$OUT"
run() {  # name, then step_host.py's arguments
  local name=$1; shift
  echo "== $name (PYTHONPATH=$PYTHONPATH)"
  timeout "${RUN_LIMIT_S:-200}" python3 benchmarks/step_host.py "$@" > "$OUT/$name.txt" 2>&1
  grep -E "^step |warm-up|waits for|^  +[0-9]+  |profiler:|Error" "$OUT/$name.txt" | head -12
}
nvidia-smi --query-gpu=name --format=csv,noheader
run head ${PROFILE_HEAD:+--profile}
for t in ${TREES:-}; do
  flag=""; [[ " ${PROFILE_TREES:-} " == *" $t "* ]] && flag=--profile
  PYTHONPATH=$PWD/.old/$t run "$t" $flag
done
[[ -n ${PHI_TORCH:-} ]] && run head_phi_torch --phi-torch
true
