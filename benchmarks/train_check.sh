#!/usr/bin/env bash
# Training checks on a machine with two GPUs (the device kind nvidia-h200-x2). Phases, given as arguments (several per call):
#   tests: the GPU kernel tests (tests/test_triton_gpu.py);
#   bench: `nsa bench train` (M7C tokens/s, MFU, peak memory, NSA vs dense, one GPU,
#          seq 2048/8k/32k, torch.compile on), then the `scale` phase;
#   scale: seq 2048 with activation checkpointing on one GPU and on two (DDP, FSDP2), one after another;
#   small: seq 2048 at 8 sequences per GPU without activation checkpointing (the 1000-step runs' size) on one GPU
#          and on two (DDP, FSDP2 and its two faster settings), then one profiled DDP step (rank 0's kernels);
#   graphs: seq 2048 at 8 sequences per GPU, parallel.cudagraphs on and off, one GPU and DDP, alternating;
#   health: the cost of the NSA health statistics (`nsa bench train`, NSA at seq 2048, one GPU);
#   runs:  1000-step M7C runs on two GPUs under DDP and under FSDP2, on real text, then `nsa report`.
# Before `runs`, on a machine with the packages:  nsa prepare configs/m7c.yaml --out data/kjv-gpt2
# (GPT-2 tokens of the embedded corpus, ~2 MB), copy the GPT-2 ranks file to data/gpt2.tiktoken (the GPU
# machine has no network and no openai-whisper), and carry data/ with the call. Run from the repository root.
set -o pipefail
phases=${*:?usage: train_check.sh [tests] [bench] [scale] [small] [graphs] [health] [runs]}; phase=${phases// /-}
OUT=${OUT:-/tmp/nsa-train-check}
W=/tmp/nsa-train-check-work  # everything lands here; $OUT gets the logs plus one tarball (few files travel back)
mkdir -p "$OUT" "$W"
trap 'tar czf "$OUT/$phase.tgz" -C "$W" --exclude="*.distcp" --exclude="rank*.pt" . ; cp "$W"/*.log "$OUT"/ 2>/dev/null' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
BYTES="data.tokenizer=byte model.vocab_size=50304"  # synthetic tokens: the vocabulary only sets the size
FAST="parallel.compile=true parallel.cudagraphs=false"  # as measured since the 21st session; the graphs phase and RUN_OVERRIDES turn graphs on
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

if [[ " $phases " == *" tests "* ]]; then
  python3 -m pytest -q -x tests/test_triton_gpu.py 2>&1 | tail -5 | tee "$W/gpu_tests.log"
fi

if [[ " $phases " == *" bench "* ]]; then
  python3 -m nsa bench train m7c $BYTES $FAST --steps 6 --warmup 3 --out "$W/one" 2>&1 | tee "$W/bench_1gpu.log"
fi

if [[ " $phases " == *" bench "* || " $phases " == *" scale "* ]]; then
  python3 -m nsa bench train m7c $BYTES $FAST parallel.activation_checkpointing=true --seq-lens 2048 \
    --attention nsa --steps 6 --warmup 3 --out "$W/one_ac" 2>&1 | tee "$W/bench_1gpu_ac.log"
  for mode in ddp fsdp; do
    torchrun --standalone --nproc_per_node=2 -m nsa bench train m7c $BYTES $FAST parallel.mode=$mode \
      parallel.activation_checkpointing=true --seq-lens 2048 --attention nsa --steps 6 --warmup 3 \
      --out "$W/$mode" 2>&1 | tee "$W/bench_2gpu_$mode.log"
  done
fi

if [[ " $phases " == *" small "* ]]; then  # where two GPUs scale less well (RESULTS, twenty-first session)
  SMALL="m7c $BYTES $FAST --seq-lens 2048 --attention nsa --batch-tokens 16384 --steps 10 --warmup 3"
  python3 -m nsa bench train $SMALL --out "$W/small_one" 2>&1 | tee "$W/small_1gpu.log"
  for setting in ddp fsdp fsdp_reshard_after_forward=false fsdp_reduce_dtype=bfloat16; do
    mode=${setting%%_*}; extra=(); [[ $setting == *=* ]] && extra=("parallel.$setting")
    torchrun --standalone --nproc_per_node=2 -m nsa bench train $SMALL parallel.mode=$mode "${extra[@]}" \
      --out "$W/small_${setting%%=*}" 2>&1 | tee "$W/small_2gpu_${setting%%=*}.log"
  done
  torchrun --standalone --nproc_per_node=2 -m nsa bench train $SMALL parallel.mode=ddp --profile \
    --out "$W/small_ddp_profile" 2>&1 | tee "$W/small_ddp_profile.log"
fi

if [[ " $phases " == *" graphs "* ]]; then  # the host's launches at 8 sequences per GPU, with and without graphs
  SMALL="m7c $BYTES $FAST --seq-lens 2048 --attention nsa --batch-tokens 16384 --steps 10 --warmup 3"
  for graphs in true false; do
    python3 -m nsa bench train $SMALL parallel.cudagraphs=$graphs --out "$W/graphs_${graphs}_one" 2>&1 \
      | tee "$W/graphs_${graphs}_1gpu.log"
    torchrun --standalone --nproc_per_node=2 -m nsa bench train $SMALL parallel.mode=ddp parallel.cudagraphs=$graphs \
      --out "$W/graphs_${graphs}_ddp" 2>&1 | tee "$W/graphs_${graphs}_ddp.log"
  done
fi

if [[ " $phases " == *" health "* ]]; then  # the cost of the NSA health statistics at M7C scale
  python3 -m nsa bench train m7c $BYTES $FAST --attention nsa --seq-lens 2048 --steps 6 --warmup 3 \
    --out "$W/health" 2>&1 | tee "$W/bench_health.log"
fi

if [[ " $phases " == *" runs "* ]]; then
  # MODES=fsdp runs one of them (each takes ~4 minutes); RUN_OVERRIDES adds config overrides to both, e.g.
  # MODES=ddp RUN_OVERRIDES=parallel.cudagraphs=true (the twenty-second session's graphs run)
  for mode in ${MODES:-ddp fsdp}; do
    timeout "${RUN_LIMIT_S:-1200}" torchrun --standalone --nproc_per_node=2 -m nsa train configs/m7c.yaml data.source=shards data.path=data/kjv-gpt2 \
      train.steps=1000 train.warmup_steps=100 train.eval_every=250 train.log_every=50 train.progress=false \
      checkpoint.every=250 parallel.mode=$mode $FAST data.tokenizer_path=data/gpt2.tiktoken train.out_dir="$W/runs" train.run_name=m7c-$mode-1000 train.sample_tokens=0 ${RUN_OVERRIDES:-} \
      2>&1 | tee "$W/run_$mode.log" | grep -E "step (1|250|500|750|1000)/|val|error|warning|done|nsa train|rank"
    python3 -m nsa report "$W/runs/m7c-$mode-1000" --out "$W/report_$mode" | tail -1
  done
fi
