#!/usr/bin/env bash
# usage: bash benchmarks/retrieval_grid.sh OUT_DIR [--seeds N] [--reruns R] [--attention nsa,dense] [--gpus 0,1,...]
#            [--dry-run] [-- recipes.sh options]
#
# The retrieval recipe over a grid of seeds and reruns, then `nsa compare` of every run: the distribution that
# docs/evaluation.md states (never one run). Run (attention, seed S, rerun k) is
#   bash benchmarks/recipes.sh retrieval OUT_DIR/ATTENTION-S-rK --attention ATTENTION --first-seed S [options]
# on one GPU (CUDA_VISIBLE_DEVICES); the GPUs take the runs in turn, one at a time each. Reruns of a seed differ
# only by the GPU's float atomics, which is what they measure.
# Options:
#   --seeds N        seeds 1337 .. 1337+N-1 (default 3)
#   --reruns R       runs of each seed (default 2)
#   --attention L    the models, comma-separated (default nsa,dense)
#   --gpus LIST      the GPUs to use (default: every GPU nvidia-smi lists)
#   --dry-run        print which GPU runs what, and run nothing
#   -- ...           options for recipes.sh, e.g. --eval-samples 32 -- model.nsa.gate=softmax
# Each run's output goes to OUT_DIR/ATTENTION-S-rK.log; the comparison to OUT_DIR/compare. Running the command
# again resumes every run where it stopped (recipes.sh resumes) and compares again.
set -euo pipefail
usage="usage: bash benchmarks/retrieval_grid.sh OUT_DIR [--seeds N] [--reruns R] [--attention nsa,dense] [--gpus 0,1,...] [--dry-run] [-- recipes.sh options]"
fail() { echo "retrieval_grid.sh: $*" >&2; exit 2; }
if [[ $# -lt 1 || $1 == -* ]]; then echo "$usage" >&2; exit 2; fi
out_arg=$1
shift
seeds=3 reruns=2 attention=nsa,dense gpus="" dry=0 passed=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --seeds|--reruns|--attention|--gpus)
      [[ $# -ge 2 ]] || fail "$1 needs a value"
      case $1 in
        --seeds) [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "--seeds takes a positive number (got '$2')"; seeds=$2 ;;
        --reruns) [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "--reruns takes a positive number (got '$2')"; reruns=$2 ;;
        --attention) [[ $2 =~ ^(nsa|dense)(,(nsa|dense))*$ ]] || fail "--attention takes nsa, dense or nsa,dense (got '$2')"
                     attention=$2 ;;
        --gpus) [[ $2 =~ ^[0-9]+(,[0-9]+)*$ ]] || fail "--gpus takes GPU indices, e.g. 0,1,2,3 (got '$2')"; gpus=$2 ;;
      esac
      shift 2 ;;
    --dry-run) dry=1; shift ;;
    --) shift; passed=("$@"); break ;;
    *) fail "unknown option '$1'; $usage" ;;
  esac
done
if [[ -z $gpus ]]; then
  count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  ((count > 0)) || fail "no CUDA GPU found (nvidia-smi lists none); run this on a GPU machine or give --gpus"
  gpus=$(seq -s, 0 $((count - 1)))
fi
IFS=, read -ra gpu_list <<< "$gpus"
IFS=, read -ra models <<< "$attention"

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "$out_arg")
((dry)) || mkdir -p "$out"
jobs=()  # ATTENTION SEED RERUN
for ((s = 0; s < seeds; s++)); do
  for ((k = 1; k <= reruns; k++)); do
    for model in "${models[@]}"; do jobs+=("$model $((1337 + s)) $k"); done
  done
done

run_jobs() {  # GPU INDEX-IN-LIST: the jobs i with i % (number of GPUs) == INDEX, one after another
  local gpu=$1 slot=$2 i model seed k name
  for ((i = slot; i < ${#jobs[@]}; i += ${#gpu_list[@]})); do
    read -r model seed k <<< "${jobs[i]}"
    name=$model-$seed-r$k
    if ((dry)); then
      echo "GPU $gpu: $model seed $seed rerun $k -> $out/$name"
      continue
    fi
    echo "== GPU $gpu: $name"
    CUDA_VISIBLE_DEVICES=$gpu bash "$root/benchmarks/recipes.sh" retrieval "$out/$name" --attention "$model" \
      --first-seed "$seed" "${passed[@]}" > "$out/$name.log" 2>&1 || echo "== $name failed: see $out/$name.log"
  done
}

for slot in "${!gpu_list[@]}"; do
  if ((dry)); then run_jobs "${gpu_list[slot]}" "$slot"; else run_jobs "${gpu_list[slot]}" "$slot" & fi
done
wait
((dry)) && exit 0
cd "$root"
runs=("$out"/*-r*/retrieval-*)
[[ -d ${runs[0]} ]] || fail "no run finished; see the logs in $out"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 -m nsa compare "${runs[@]}" --out "$out/compare"
echo "== done: $out/compare/compare.md"
