#!/usr/bin/env bash
# The configs/m7c.yaml step size (8 x 2048 tokens on one GPU), where the host's launches set the pace: NSA at this
# tree without and with parallel.cudagraphs, then (with OLD_TREE, a folder holding an older tree's nsa/ and configs/,
# e.g. made with `git archive REV nsa configs | tar -x -C .old`) the same plain row at that tree, then the host time
# of one attention call at both trees. One GPU call; each side compiles into its own cache. Run from the repo root:
#   OLD_TREE=.old bash benchmarks/small_batch_check.sh
set -o pipefail
source benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/nsa-small-check}
mkdir -p "$OUT"
ARGS=(m7c data.tokenizer=byte model.vocab_size=50304 parallel.compile=true parallel.cudagraphs=false --seq-lens 2048 --attention nsa
      --batch-tokens 16384 --steps 12 --warmup 3)
bench() {  # name, then extra overrides
  local name=$1; shift
  echo "== $name (PYTHONPATH=$PYTHONPATH)"
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python3 -m nsa bench train "${ARGS[@]}" "$@" --out "$OUT/$name" 2>&1 \
    | tail -4 | tee "$OUT/$name.log"
}
host() {  # name
  echo "== host time of one call, $1"
  python3 benchmarks/host_profile.py --length 2048 --calls 40 --rows 40 > "$OUT/host_$1.log" 2>&1
  grep -E "host time|GPU is done|Error" "$OUT/host_$1.log"
}
nvidia-smi --query-gpu=name --format=csv,noheader
bench head
bench head_graphs parallel.cudagraphs=true
host head
if [[ -n ${OLD_TREE:-} ]]; then
  old=$(cd "$OLD_TREE" && pwd)
  PYTHONPATH=$old:$PWD/benchmarks bench old
  PYTHONPATH=$old host old
fi
