#!/usr/bin/env bash
# usage: bash benchmarks/two_gpus.sh OUT_DIR PART...    (PART: scale, small, graphs, runs)
#
# M7C training on one GPU and on two of one host (DDP and FSDP2), the commands behind docs/performance.md's
# "Two GPUs" tables. Synthetic tokens with the byte vocabulary padded to 50,304 rows, sequences of 2,048 tokens,
# compiled (CUDA graphs off unless a part says otherwise), NSA attention:
#   scale   32 sequences per GPU with activation checkpointing: one GPU, then DDP and FSDP2 (median of 6 steps)
#   small   8 sequences per GPU without activation checkpointing: one GPU, DDP, FSDP2 and FSDP2 with each of
#           fsdp_reshard_after_forward=false and fsdp_reduce_dtype=bfloat16, then one profiled DDP step
#   graphs  8 sequences per GPU with CUDA graphs on and off, one GPU and DDP
#   runs    1,000-step runs on GPT-2 tokens of the embedded corpus under DDP and under FSDP2 (evaluation and a
#           checkpoint every 250 steps), then `nsa report` of each; the token shards are made first in
#           OUT_DIR/kjv-gpt2 if absent
# Each measurement writes its tables to OUT_DIR/<name>/ and its output to OUT_DIR/<name>.log.
set -euo pipefail
usage="usage: bash benchmarks/two_gpus.sh OUT_DIR PART...    (PART: scale, small, graphs, runs)"
if [[ $# -lt 2 || $1 == -* ]]; then echo "$usage" >&2; exit 2; fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
shift
for part in "$@"; do
  case $part in
    scale|small|graphs|runs) ;;
    *) echo "two_gpus.sh: unknown part '$part'; $usage" >&2; exit 2 ;;
  esac
done
if ! nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; then
  echo "two_gpus.sh: no CUDA GPU found (nvidia-smi failed); run this on a machine with two GPUs" >&2
  exit 2
fi
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

model=(m7c data.tokenizer=byte model.vocab_size=50304 parallel.compile=true parallel.cudagraphs=false
       --seq-lens 2048 --attention nsa)
small=("${model[@]}" --batch-tokens 16384 --steps 10 --warmup 3)

one() {  # NAME, then `nsa bench train` arguments: on one GPU
  local name=$1; shift
  python3 -m nsa bench train "$@" --out "$out/$name" 2>&1 | tee "$out/$name.log"
}

two() {  # NAME, then `nsa bench train` arguments: on two GPUs
  local name=$1; shift
  torchrun --standalone --nproc_per_node=2 -m nsa bench train "$@" --out "$out/$name" 2>&1 | tee "$out/$name.log"
}

for part in "$@"; do
  case $part in
    scale)
      scale=("${model[@]}" parallel.activation_checkpointing=true --steps 6 --warmup 3)
      one scale-1gpu "${scale[@]}"
      two scale-ddp "${scale[@]}" parallel.mode=ddp
      two scale-fsdp "${scale[@]}" parallel.mode=fsdp
      ;;
    small)
      one small-1gpu "${small[@]}"
      two small-ddp "${small[@]}" parallel.mode=ddp
      two small-fsdp "${small[@]}" parallel.mode=fsdp
      two small-fsdp-no-reshard "${small[@]}" parallel.mode=fsdp parallel.fsdp_reshard_after_forward=false
      two small-fsdp-bf16-reduce "${small[@]}" parallel.mode=fsdp parallel.fsdp_reduce_dtype=bfloat16
      two small-ddp-profile "${small[@]}" parallel.mode=ddp --profile
      ;;
    graphs)
      for graphs in true false; do
        one "graphs-$graphs-1gpu" "${small[@]}" parallel.cudagraphs=$graphs
        two "graphs-$graphs-ddp" "${small[@]}" parallel.mode=ddp parallel.cudagraphs=$graphs
      done
      ;;
    runs)
      [[ -f $out/kjv-gpt2/meta.json ]] || python3 -m nsa prepare configs/m7c.yaml --out "$out/kjv-gpt2"
      for mode in ddp fsdp; do
        torchrun --standalone --nproc_per_node=2 -m nsa train configs/m7c.yaml data.source=shards \
          data.path="$out/kjv-gpt2" train.steps=1000 train.warmup_steps=100 train.eval_every=250 train.log_every=50 \
          train.progress=false train.sample_tokens=0 checkpoint.every=250 parallel.mode=$mode \
          parallel.compile=true parallel.cudagraphs=false train.out_dir="$out/runs" train.run_name="m7c-$mode-1000" \
          2>&1 | tee "$out/run-$mode.log"
        python3 -m nsa report "$out/runs/m7c-$mode-1000" --out "$out/report-$mode"
      done
      ;;
  esac
done
