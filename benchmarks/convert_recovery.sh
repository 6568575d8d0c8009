#!/usr/bin/env bash
# usage: bash benchmarks/convert_recovery.sh OUT_DIR [--steps N] [-- key=value ...]
#
# How fast a dense model converted to NSA gets back to the dense model's loss (docs/convert.md#loss-recovery),
# on a machine without downloads:
#   1. OUT_DIR/teacher: the dense model of configs/recipes/learn.yaml (byte tokens of the embedded corpus);
#   2. exported as a Hugging Face LlamaForCausalLM (OUT_DIR/teacher-hf) and converted by `nsa convert`
#      (OUT_DIR/converted, the default NSA settings: M7C's blocks, MLP phi, gate MLP);
#   3. OUT_DIR/nsa-from-dense: the converted model trained N more steps (default 200) at the convert recipe's
#      learning rate (1e-4, 20 warm-up steps), validated every 20 steps;
#   4. OUT_DIR/dense-continued: the dense teacher trained the same steps at the same rate, the reference;
#   5. `nsa eval --tasks none` of the converted model before training, and `nsa compare` of the two runs.
# Overrides after -- go to every `nsa train` (e.g. train.device=cpu and a smaller model for a dry run).
set -euo pipefail
usage="usage: bash benchmarks/convert_recovery.sh OUT_DIR [--steps N] [-- key=value ...]"
if [[ $# -lt 1 || $1 == -* ]]; then echo "$usage" >&2; exit 2; fi
out=$1 steps=200 overrides=()
shift
while [[ $# -gt 0 ]]; do
  case $1 in
    --steps) [[ ${2:-} =~ ^[1-9][0-9]*$ ]] || { echo "convert_recovery.sh: --steps takes a positive number" >&2; exit 2; }
             steps=$2; shift 2 ;;
    --) shift; overrides=("$@"); break ;;
    *) echo "convert_recovery.sh: unknown option '$1'; $usage" >&2; exit 2 ;;
  esac
done
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"
nsa() { python3 -m nsa "$@"; }
data=(data.source=embedded data.tokenizer=byte data.val_fraction=0.05)
# The continued runs: the same batches, rate and validation for both models.
continued=("${data[@]}" train.out_dir="$out" train.steps="$steps" train.seq_len=2048 train.batch_size=16
           train.grad_accum=1 train.lr=1e-4 train.warmup_steps=20 train.eval_every=20 train.eval_batches=8
           train.sample_tokens=0 train.progress=false checkpoint.every="$steps" checkpoint.keep=1
           parallel.activation_checkpointing=false)

nsa train configs/recipes/learn.yaml model.attention=dense train.run_name=teacher train.out_dir="$out" "${overrides[@]}"
rm -rf "$out/teacher-hf" "$out/converted"
nsa export "$out/teacher" "$out/teacher-hf" --format hf
nsa convert "$out/teacher-hf" "$out/converted"
nsa eval "$out/converted" --tasks none "${data[@]}" --out "$out/converted-eval"
nsa train "$out/converted/train.yaml" train.run_name=nsa-from-dense "${continued[@]}" "${overrides[@]}"
nsa train configs/recipes/learn.yaml model.attention=dense model.init_from="$out/teacher" \
  train.run_name=dense-continued "${continued[@]}" "${overrides[@]}"
nsa compare "$out/nsa-from-dense" "$out/dense-continued" --out "$out/compare"
