#!/usr/bin/env bash
# Every GPU check of issue 17 in one go, on any CUDA machine, from the repository root:
#   bash docs/measurements/gpu_all.sh OUTDIR
# 1. docs/measurements/gpu_costs.py on random Llama-2-7B and 13B shapes in bfloat16, eagerly and
#    with CUDA graphs of the branches;
# 2. docs/measurements/gpu_e2e.py: end-to-end speculative decoding on the 7B shape made redundant
#    where the draft skips (a controlled acceptance), eager and with CUDA graphs;
# 3. the gpu-marked tests (every preset on a tiny model: fp32 and bf16, eager and CUDA graphs);
# 4. HF generate with a static cache (which transformers compiles) against our loop with CUDA
#    graphs on the 7B shape (last: the compilation takes minutes).
# Each part has its own time limit (seconds, overridable) and writes its log under OUTDIR; a part
# that fails does not stop the others.
set -u
out=${1:?usage: gpu_all.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
tokens=${GPU_NEW_TOKENS:-64}
reps=${GPU_REPS:-3}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -n 1
} | tee "$out/env.txt"
timeout "${GPU_7B_TIMEOUT:-120}" python docs/measurements/gpu_costs.py --shape llama2-7b \
  --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-7b.json" >"$out/llama2-7b.md" 2>&1
echo "llama2-7b: rc $?"
timeout "${GPU_13B_TIMEOUT:-130}" python docs/measurements/gpu_costs.py --shape llama2-13b \
  --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-13b.json" >"$out/llama2-13b.md" 2>&1
echo "llama2-13b: rc $?"
for f in llama2-7b llama2-13b; do
  echo "== $f"
  sed -n '/^# Eager against/,$p' "$out/$f.md"
  grep -E "NOT met|: met|Error|failed" "$out/$f.md" | tail -n 16
done
timeout "${GPU_E2E_TIMEOUT:-120}" python docs/measurements/gpu_e2e.py --shape llama2-7b \
  --new-tokens "$tokens" --reps "$reps" --json "$out/e2e-7b.json" >"$out/e2e-7b.md" 2>&1
echo "e2e llama2-7b: rc $?"
tail -n 4 "$out/e2e-7b.md"
timeout "${GPU_TEST_TIMEOUT:-100}" python -m pytest -q -m gpu tests/integration/test_gpu.py -n 8 \
  -p no:cacheprovider --junitxml="$out/gpu_tests.xml" >"$out/gpu_tests.log" 2>&1
echo "gpu tests: rc $?"
grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -n 30
timeout "${GPU_COMPILE_TIMEOUT:-110}" python docs/measurements/gpu_costs.py --shape llama2-7b --speed-only \
  --graphs on --hf-compile --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-7b-compile.json" >"$out/llama2-7b-compile.md" 2>&1
echo "llama2-7b HF compile: rc $?"
grep -v "^W1" "$out/llama2-7b-compile.md" | tail -n 8
