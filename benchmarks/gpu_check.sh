#!/usr/bin/env bash
# usage: bash benchmarks/gpu_check.sh OUT_DIR [LENGTHS [nsa bench attention options...]]
#
# On a machine with a CUDA GPU: the GPU tests at real shapes, then `nsa bench attention` for both shapes
# (M7C 12/2/64 and the paper's 64/4/128) at LENGTHS (comma-separated; default 2k to 128k), the command behind
# docs/performance.md's attention tables. A failing test stops the script before any timing. OUT_DIR receives
# gpu.txt (the device), gpu_tests.log, bench.log and the benchmark's attention.csv, .json and .png.
# Options after LENGTHS go to the benchmark, e.g. `--graphs --no-fla` for GPU time alone.
set -euo pipefail
if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: bash benchmarks/gpu_check.sh OUT_DIR [LENGTHS [nsa bench attention options...]]" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$1"
out=$(cd "$1" && pwd)
lengths=${2:-2048,4096,8192,16384,32768,65536,131072}
shift $(( $# < 2 ? $# : 2 ))
if [[ ! $lengths =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  echo "gpu_check.sh: LENGTHS is a comma-separated list of token counts, e.g. 2048,65536 (got '$lengths')" >&2
  exit 2
fi
if ! nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1; then
  echo "gpu_check.sh: no CUDA GPU found (nvidia-smi failed); run this on a GPU machine" >&2
  exit 2
fi
cat "$out/gpu.txt"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Every test that needs a GPU: the kernel files whole, and the GPU-only tests of the others (the Hugging Face one
# where transformers is installed: a test id in a module skipped whole would stop pytest before any test).
hf_test=()
if python3 -c "import transformers" 2> /dev/null; then
  hf_test=(
    "tests/hf/test_hf.py::test_greedy_generate_on_the_gpu_decodes_like_the_full_forward"
  )
fi
python3 -m pytest -q -p no:cacheprovider -rfEs \
  tests/ops/test_triton_gpu.py tests/ops/test_triton_decode.py tests/ops/test_triton_phi.py \
  tests/model/test_packed_documents.py tests/train/test_document_masking.py \
  "tests/model/test_model.py::test_a_pinned_dense_kernel_runs_on_the_gpu_forward_and_backward" \
  "tests/train/test_train.py::test_cuda_graph_steps_give_the_compiled_steps_losses" \
  "tests/train/test_train.py::test_deterministic_runs_repeat_and_resume_bit_for_bit" \
  "tests/data/test_data_sources.py::test_prefetch_pins_batches_for_a_gpu_so_the_copy_is_queued" \
  "tests/data/test_document_boundaries.py::test_the_boundaries_are_pinned_with_the_batch_for_a_gpu" \
  "tests/inference/test_decode.py::test_packed_prompts_decode_like_each_alone_on_the_gpu_in_bf16" \
  "tests/inference/test_decode.py::test_the_compiled_decode_step_gives_the_eager_steps_logits" \
  "tests/inference/test_decode.py::test_the_dense_models_split_decode_kernel_generates_the_full_forwards_argmax" \
  "tests/inference/test_decode.py::test_a_decode_step_fuses_the_input_maps_and_phi_into_few_matmuls" \
  "${hf_test[@]}" 2>&1 | tee "$out/gpu_tests.log"
python3 -m nsa bench attention --shapes m7c,paper --lengths "$lengths" --out "$out" "$@" 2>&1 | tee "$out/bench.log"
