#!/usr/bin/env bash
# Time a change against the code before it, in one GPU call: runs a command on the working tree ("after"),
# then with the files saved under BEFORE_DIR swapped in ("before"), then puts the working tree back.
# BEFORE_DIR mirrors repository paths, e.g. made here with
#   mkdir -p ab/nsa/ops/triton && git show HEAD:nsa/ops/triton/decode.py > ab/nsa/ops/triton/decode.py
# (an untracked folder travels to the device machine with the tree). In the command, {} stands for the
# output folder of each side ($OUT/after, $OUT/before). Run from the repository root:
#   bash benchmarks/ab_check.sh ab -- nsa bench decode --compile --contexts 65536 --batches 1,16 --out {}
set -o pipefail
if [[ $# -lt 3 || $2 != -- || ! -d $1 ]]; then
  echo "usage: bash benchmarks/ab_check.sh BEFORE_DIR -- COMMAND ... ({} = the side's output folder)" >&2
  exit 2
fi
before=$1; shift 2
OUT=${OUT:-/tmp/nsa-ab-check}
source benchmarks/gpu_env.sh
mapfile -t files < <(cd "$before" && find . -type f | sed 's|^\./||')
if [[ ${#files[@]} -eq 0 ]]; then echo "ab_check: no files under $before" >&2; exit 2; fi
for f in "${files[@]}"; do
  [[ -f $f ]] || { echo "ab_check: $before/$f has no counterpart $f in the tree" >&2; exit 2; }
done
keep=$(mktemp -d)
restore() { for f in "${files[@]}"; do cp "$keep/$f" "$f"; done; }
for f in "${files[@]}"; do mkdir -p "$keep/$(dirname "$f")"; cp "$f" "$keep/$f"; done
trap restore EXIT
run_side() {  # side name
  local dir="$OUT/$1" args=()
  mkdir -p "$dir"
  for a in "${cmd[@]}"; do args+=("${a//\{\}/$dir}"); done
  echo "== $1: ${args[*]}"
  # Each side compiles into a cache of its own: torch.compile's caches are keyed by the traced graph, not by our
  # source, so the second side would load graphs traced with the first side's fake kernels (shapes that the
  # change may have altered: "expected size 10240==16384" when the inverse index grew).
  TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) "${args[@]}" 2>&1 | tee "$dir/log.txt"
}
cmd=("$@")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
run_side after
for f in "${files[@]}"; do cp "$before/$f" "$f"; done
run_side before
