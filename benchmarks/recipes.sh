#!/usr/bin/env bash
# usage: bash benchmarks/recipes.sh {learn|retrieval} OUT_DIR [--seeds N] [--attention nsa,dense]
#            [--stages SEQxBATCH[+LENGTH...]:STEPS,...] [--extend STEPS] [--eval-lengths L,...] [--eval-samples N]
#            [--eval-tasks passkey,kv,multikey] [--from-stage K:key=value ...] [--through-stage K]
#            [-- key=value ...]
#
# One recipe of configs/recipes/ from start to end, every run in OUT_DIR (docs/evaluation.md, "The recipes"):
#   learn      configs/recipes/learn.yaml with NSA and with dense attention (same data, seed and tokens), then
#              `nsa eval --tasks none` of each (validation loss) and `nsa compare` of all into OUT_DIR/compare
#   retrieval  configs/recipes/retrieval.yaml (passkey retrieval up to 64k tokens) with NSA and with dense
#              attention, each as one run through the curriculum of --stages, then --extend more steps at the
#              last stage's shape (the finished run resumed with train.steps raised); then `nsa eval --tasks
#              passkey` of each (4k-64k tokens x depths 0-100%) and `nsa compare` of all into OUT_DIR/compare
# Runs are named RECIPE-ATTENTION-SEED (e.g. OUT_DIR/retrieval-nsa-1337). Running the command again resumes each
# run from its latest checkpoint and skips the stages it has finished.
# Options:
#   --seeds N           N runs of each model, train.seed 1337, 1338, ... (default 1)
#   --first-seed S      the first of those seeds (default 1337): e.g. one seed per GPU, each its own command
#   --attention LIST    the models, comma-separated (default nsa,dense)
#   --stages SPEC       the retrieval curriculum: each stage SEQxBATCH (tokens x sequences), +LENGTH for each
#                       length drawn per step besides SEQ (data.retrieval.mix_lengths), :STEPS
#                       (default 256x256:400,1024x64:400,4096x16:300,8192x8:300,
#                        16384x4+32768+65536+65536+65536+65536:1000,
#                        16384x4+4096+8192+32768+65536+65536+65536+65536+65536+65536:600)
#   --extend STEPS      retrieval steps after the curriculum (default 300; 0: none)
#   --eval-lengths L,.. and --eval-samples N: the retrieval evaluation's grid (nsa eval's --lengths, --samples)
#   --eval-tasks LIST   the retrieval tasks evaluated (nsa eval's --tasks; default passkey; kv and multikey need
#                       runs trained on them too, e.g. -- data.retrieval.task=mixed or =multikey)
#   --from-stage K:key=value   (repeatable) an override for the retrieval curriculum's stage K (1 for the
#                       first) and every later stage and the extension, e.g. --from-stage 4:model.nsa.gate_floor=0.02
#                       (only keys a resume applies: `nsa train` refuses a changed model shape or data stream)
#   --through-stage K   train the retrieval curriculum's stages 1 to K only, at the whole curriculum's rates (the
#                       schedule still spans every stage), and no --extend: a cheap look at how runs cross one
#                       stage's switch (evaluate at its lengths with --eval-lengths); rerunning without it goes on
#   -- key=value ...    overrides for every `nsa train` (e.g. train.device=cpu or a smaller model); the stages
#                       set the retrieval runs' train.seq_len, train.batch_size, train.steps and mix_lengths
# Training runs eagerly (parallel.compile=false, as the recipes' results were measured; the retrieval stages'
# many lengths would each compile): override with -- parallel.compile=true.
set -euo pipefail
usage="usage: bash benchmarks/recipes.sh {learn|retrieval} OUT_DIR [--seeds N] [--first-seed S] [--attention nsa,dense] [--stages SPEC] [--extend STEPS] [--eval-lengths L,...] [--eval-samples N] [--eval-tasks passkey,kv,multikey] [--from-stage K:key=value ...] [--through-stage K] [-- key=value ...]"
fail() { echo "recipes.sh: $*" >&2; exit 2; }
if [[ $# -lt 2 || ! $1 =~ ^(learn|retrieval)$ || $2 == -* ]]; then echo "$usage" >&2; exit 2; fi
recipe=$1 out_arg=$2
shift 2
seeds=1 first_seed=1337 attention=nsa,dense extend=300 eval_args=() eval_tasks=passkey overrides=()
through=0 late_stage=() late_override=()  # --from-stage: the first stage (1-based) of each override, and the override
# 64k four (then six) times in the mixed stages' draws: configs/recipes/retrieval.yaml says why.
stages=256x256:400,1024x64:400,4096x16:300,8192x8:300,16384x4+32768+65536+65536+65536+65536:1000
stages+=,16384x4+4096+8192+32768+65536+65536+65536+65536+65536+65536:600
while [[ $# -gt 0 ]]; do
  case $1 in
    --seeds|--first-seed|--attention|--stages|--extend|--eval-lengths|--eval-samples|--eval-tasks|--from-stage|--through-stage)
      [[ $# -ge 2 ]] || fail "$1 needs a value"
      case $1 in
        --seeds) [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "--seeds takes a positive number (got '$2')"; seeds=$2 ;;
        --first-seed) [[ $2 =~ ^[0-9]+$ ]] || fail "--first-seed takes a number (got '$2')"; first_seed=$2 ;;
        --attention) [[ $2 =~ ^(nsa|dense)(,(nsa|dense))*$ ]] || fail "--attention takes nsa, dense or nsa,dense (got '$2')"
                     attention=$2 ;;
        --stages) stages=$2 ;;
        --extend) [[ $2 =~ ^[0-9]+$ ]] || fail "--extend takes a number of steps (got '$2')"; extend=$2 ;;
        --eval-lengths) eval_args+=(--lengths "$2") ;;
        --eval-samples) eval_args+=(--samples "$2") ;;
        --eval-tasks) [[ $2 =~ ^(passkey|kv|multikey)(,(passkey|kv|multikey))*$ ]] ||
                        fail "--eval-tasks takes passkey, kv, multikey or a list of them, e.g. passkey,multikey (got '$2')"
                      eval_tasks=$2 ;;
        --from-stage) [[ $2 =~ ^([1-9][0-9]*):([^=]+=.*)$ ]] ||
                        fail "--from-stage takes K:key=value, e.g. 4:model.nsa.gate_floor=0.02 (got '$2')"
                      late_stage+=("${BASH_REMATCH[1]}") late_override+=("${BASH_REMATCH[2]}") ;;
        --through-stage) [[ $2 =~ ^[1-9][0-9]*$ ]] || fail "--through-stage takes a stage number, 1 for the first (got '$2')"
                         through=$2 ;;
      esac
      shift 2 ;;
    --) shift; overrides=("$@"); break ;;
    *) fail "unknown option '$1'; $usage" ;;
  esac
done
for item in "${overrides[@]}"; do
  [[ $item == *=* ]] || fail "after -- come key=value overrides (got '$item')"
done

# Stage i trains at stage_seq[i] x stage_batch[i], drawing the lengths stage_mix[i] too, up to step stage_end[i];
# all stages share one learning-rate schedule of `total` steps.
total=0 stage_seq=() stage_batch=() stage_mix=() stage_end=()
IFS=, read -ra stage_list <<< "$stages"
for stage in "${stage_list[@]}"; do
  [[ $stage =~ ^([0-9]+)x([0-9]+)((\+[0-9]+)*):([0-9]+)$ ]] ||
    fail "--stages takes SEQxBATCH[+LENGTH...]:STEPS,... e.g. 1024x64:400,16384x4+65536:1000 (got '$stage')"
  total=$((total + BASH_REMATCH[5]))
  mix=${BASH_REMATCH[3]#+}
  stage_seq+=("${BASH_REMATCH[1]}") stage_batch+=("${BASH_REMATCH[2]}") stage_mix+=("[${mix//+/,}]")
  stage_end+=("$total")
done
((${#stage_end[@]})) || fail "--stages is empty"
[[ $recipe == retrieval || ${#late_stage[@]} -eq 0 ]] || fail "--from-stage is for the retrieval recipe's stages"
[[ $recipe == retrieval || $through -eq 0 ]] || fail "--through-stage is for the retrieval recipe's stages"
((through <= ${#stage_end[@]})) || fail "--through-stage $through: the curriculum has ${#stage_end[@]} stages"
for k in "${late_stage[@]}"; do
  ((k <= ${#stage_end[@]})) || fail "--from-stage $k: the curriculum has ${#stage_end[@]} stages"
done

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out_arg"
out=$(cd "$out_arg" && pwd)
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
config=configs/recipes/$recipe.yaml

train() {  # RUN, then overrides after the user's
  local run=$1; shift
  echo "== train $run"
  python3 -m nsa train "$config" train.out_dir="$out" train.run_name="$run" parallel.compile=false \
    "${overrides[@]}" "$@"
}

latest_step() {  # RUN: the step of its latest complete checkpoint, 0 without one
  local last
  last=$(ls -d "$out/$1"/checkpoints/step_* 2>/dev/null | sort | tail -1 || true)
  if [[ -n $last && -f $last/COMPLETE.json ]]; then echo $((10#${last##*step_})); else echo 0; fi
}

stage_overrides() {  # STAGE (1-based): the --from-stage overrides that apply to it
  local j
  for j in "${!late_stage[@]}"; do ((late_stage[j] <= $1)) && echo "${late_override[j]}"; done
  return 0
}

retrieval_run() {  # RUN, then the run's overrides: the curriculum (through --through-stage), then --extend
  local run=$1 i done_steps end last=$((${#stage_end[@]} - 1)) late; shift
  for i in "${!stage_end[@]}"; do
    ((through == 0 || i < through)) || return 0
    done_steps=$(latest_step "$run") end=${stage_end[i]}
    ((done_steps >= end)) && continue
    mapfile -t late < <(stage_overrides $((i + 1)))
    train "$run" "$@" train.steps=$total train.seq_len="${stage_seq[i]}" train.batch_size="${stage_batch[i]}" \
      data.retrieval.mix_lengths="${stage_mix[i]}" train.stop_after=$((end - done_steps)) "${late[@]}"
  done
  done_steps=$(latest_step "$run")
  if ((extend > 0 && done_steps < total + extend)); then
    mapfile -t late < <(stage_overrides $((last + 1)))
    train "$run" "$@" train.steps=$((total + extend)) train.seq_len="${stage_seq[last]}" \
      train.batch_size="${stage_batch[last]}" data.retrieval.mix_lengths="${stage_mix[last]}" "${late[@]}"
  fi
}

runs=()
IFS=, read -ra models <<< "$attention"
for ((s = 0; s < seeds; s++)); do
  for model in "${models[@]}"; do
    run=$recipe-$model-$((first_seed + s))
    if [[ $recipe == learn ]]; then
      train "$run" model.attention="$model" train.seed=$((first_seed + s))
    else
      retrieval_run "$run" model.attention="$model" train.seed=$((first_seed + s))
    fi
    runs+=("$out/$run")
  done
done
for run in "${runs[@]}"; do
  echo "== eval $(basename "$run")"
  if [[ $recipe == learn ]]; then
    python3 -m nsa eval "$run" --no-progress --tasks none
  else
    python3 -m nsa eval "$run" --no-progress --tasks "$eval_tasks" "${eval_args[@]}"
  fi
done
python3 -m nsa compare "${runs[@]}" --out "$out/compare"
echo "== done: $out/compare/compare.md"
