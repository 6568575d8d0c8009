source benchmarks/gpu_env.sh
for side in unfilled filled; do
python3 - $side $OUT/$side > $OUT/$side.txt 2>&1 <<'PY'
import contextlib, sys
if sys.argv[1] == "filled":  # the NaN fill of deterministic mode kept for NSA's buffers too (the committed code)
    import nsa.ops.triton.attention as a
    a.unfilled = contextlib.nullcontext
from nsa.cli import main
sys.exit(main(["bench", "train", "m7c", "data.tokenizer=byte", "model.vocab_size=50304", "parallel.compile=true",
               "train.deterministic=true", "--seq-lens", "2048,32768", "--steps", "8", "--warmup", "3",
               "--attention", "nsa", "--out", sys.argv[2]]))
PY
tail -4 $OUT/$side.txt | head -3
done
timeout 280 python3 -m pytest -q -p no:logging -p no:cacheprovider tests/test_triton_gpu.py tests/test_train.py tests/test_triton_kernels.py -k "deterministic or unfilled" 2>&1 | tail -2
