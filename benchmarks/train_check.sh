#!/usr/bin/env bash
# Training checks on a machine with two GPUs (e.g. the device kind nvidia-h200-x2), in one call:
#   1. `nsa bench train`: M7C tokens/s, MFU and peak memory, NSA vs dense, one GPU, seq 2048/8k/32k;
#   2. the same at seq 2048 on one GPU and on two (DDP, FSDP2), activation checkpointing on;
#   3. 1000-step M7C runs on two GPUs under DDP and under FSDP2, on real text.
# Before the call, on a machine with the packages:  nsa prepare configs/m7c.yaml --out data/kjv-gpt2
# (GPT-2 tokens of the embedded corpus, ~2 MB) and carry data/ with the call. Run from the repository root.
set -o pipefail
OUT=${OUT:-/tmp/nsa-train-check}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
BYTES="data.tokenizer=byte model.vocab_size=50304"  # synthetic tokens: the vocabulary only sets the size
nvidia-smi --query-gpu=name,memory.total --format=csv

python3 -m nsa bench train m7c $BYTES --out "$OUT/one" 2>&1 | tee "$OUT/bench_1gpu.log"
python3 -m nsa bench train m7c $BYTES parallel.activation_checkpointing=true --seq-lens 2048 \
  --out "$OUT/one_ac" 2>&1 | tee "$OUT/bench_1gpu_ac.log"
for mode in ddp fsdp; do
  torchrun --standalone --nproc_per_node=2 -m nsa bench train m7c $BYTES parallel.mode=$mode \
    parallel.activation_checkpointing=true --seq-lens 2048 --out "$OUT/$mode" 2>&1 | tee "$OUT/bench_2gpu_$mode.log"
done

for mode in ddp fsdp; do
  torchrun --standalone --nproc_per_node=2 -m nsa train configs/m7c.yaml data.source=shards data.path=data/kjv-gpt2 \
    train.steps=1000 train.warmup_steps=100 train.eval_every=250 train.log_every=50 train.progress=false \
    checkpoint.every=250 parallel.mode=$mode parallel.activation_checkpointing=true \
    train.out_dir="$OUT/runs" train.run_name=m7c-$mode-1000 2>&1 | tee "$OUT/run_$mode.log" | grep -E "step|error|done"
done
