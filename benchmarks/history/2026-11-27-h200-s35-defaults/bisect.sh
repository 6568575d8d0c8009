# host time of one nsa_attention call (M7C 2k x 1) at several trees, one machine
source benchmarks/gpu_env.sh
for t in HEAD ${TREES}; do
  if [[ $t == HEAD ]]; then p=$PWD; else p=$PWD/.old/$t; fi
  echo "== $t"
  PYTHONPATH=$p timeout 55 python3 benchmarks/host_profile.py --length 2048 --calls 40 --rows 1 2>&1 | grep -E "host time per call|Error" | head -3
done
