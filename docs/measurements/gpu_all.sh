#!/usr/bin/env bash
# Every GPU check in one go, on any CUDA machine, from the repository root:
#   bash docs/measurements/gpu_all.sh OUTDIR            # every part
#   GPU_PARTS="replay real tests" bash docs/measurements/gpu_all.sh OUTDIR   # some parts
# Parts (each has its own time limit in seconds, overridable, and writes its log under OUTDIR; a part
# that fails does not stop the others):
#   costs   (issues 17, 27) gpu_costs.py on random Llama-2-7B and 13B shapes in bfloat16, eager and
#           with CUDA graphs of the branches: step costs, the bandwidth floor (a 1 GiB copy) and each
#           forward as a multiple of it, drafts with fp8 and int8 weights (framework.kernels.lowbit);
#   e2e     (issue 17) gpu_e2e.py: end-to-end speculative decoding on the 7B shape made redundant
#           where the draft skips (a controlled acceptance, --scale), eager and with CUDA graphs;
#   replay  (issue 26, item 4) gpu_e2e.py --trace: the acceptance traces recorded on SmolLM2-135M and
#           Qwen2.5-Coder-0.5B (docs/measurements/traces/) replayed on the 7B and 13B shapes with
#           graphs: measured speedup next to the cost model's prediction, timed captures (must be 0);
#   real    (issues 26, 38) the benchmark on a real model in bfloat16 (GPU_REAL_MODES: graphs = one
#           graph per forward, exact = the same with --exact on, branch = one graph per branch,
#           eager = vanilla and two methods), on the built-in suite (one prompt per category, 128 tokens): acceptance,
#           mismatches against plain decoding (with the logit margins) and speed; needs the model's
#           GGUF on the machine: GPU_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf (see below);
#   tests   the gpu-marked tests: every preset on a tiny model in fp32 and bf16, eager and graphs;
#           no graph recorded inside timed decodes (issue 26, item 2); a model split between cuda:0
#           and cpu decodes like the unsplit model in fp32 (issue 26, item 5);
#   compile (issue 17) HF generate with a static cache (which transformers compiles) against our loop
#           with CUDA graphs on the 7B shape (last: the compilation takes minutes);
#   engine  (issue 38) gpu_engine_probe.py: our engine's step, half draft and 8-token verification
#           with one graph per forward (plain and exact mode) against one graph per branch, the
#           compiled forward's exactness and a compiled 7B step (parts GPU_ENGINE_PARTS).
# The default model's GGUF (93 MB) is over one device call's 64 MiB: split it here
#   (split -b 48M SmolLM2-135M-Instruct.Q4_1.gguf .gguf/part-), carry one part per call into a folder
#   that persists while the machine stays warm (cp .gguf/part-* /tmp/gguf/), and in the last call
#   cat /tmp/gguf/part-* > /tmp/smollm2.gguf; GPU_GGUF=/tmp/smollm2.gguf. Transformers reads GGUF
#   through the pure-Python `gguf` package: carry its wheel if the machine lacks it. The H100 image
#   of 2026-11-27 also lacked `datasets` (calibration prompts and the benchmark read prompts
#   through it): carry the wheels of datasets, dill and multiprocess too (a few MB; see the device
#   tool's notes on wheels), installed with --no-deps into a folder on PYTHONPATH.
# The real part's first mode converts the GGUF (~35 s) and ranks the draft vocabulary (~65 s on an
#   H100, cached for the second mode) before it decodes: give it its 300 s.
# Knobs (tests run the script on a CPU with them): GPU_REPLAY_SHAPES, GPU_REPLAY_TURNS,
# GPU_REPLAY_EXTRA (more gpu_e2e.py flags), GPU_REAL_MODEL (instead of GPU_GGUF), GPU_REAL_MODES,
# GPU_REAL_METHODS, GPU_REAL_EXTRA (more bench.py flags; later flags win).
set -u
out=${1:?usage: gpu_all.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
parts=${GPU_PARTS:-engine costs e2e replay real tests compile}
tokens=${GPU_NEW_TOKENS:-64}
reps=${GPU_REPS:-3}
want() { [[ " $parts " == *" $1 "* ]]; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -n 1
  python -c "from importlib.metadata import version; print('gguf', version('gguf'))" 2>&1 | tail -n 1
  echo "parts: $parts"
} | tee "$out/env.txt"

if want engine; then
  timeout "${GPU_ENGINE_TIMEOUT:-240}" python docs/measurements/gpu_engine_probe.py --out "$out/engine" \
    --budget "${GPU_ENGINE_BUDGET:-200}" --parts "${GPU_ENGINE_PARTS:-engine,compiled_exact,7b_compiled}" \
    >"$out/engine.log" 2>&1
  echo "engine: rc $?"
  cut -c1-900 "$out/engine/probe.jsonl" 2>/dev/null
fi

if want costs; then
  timeout "${GPU_7B_TIMEOUT:-160}" python docs/measurements/gpu_costs.py --shape llama2-7b \
    --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-7b.json" >"$out/llama2-7b.md" 2>&1
  echo "llama2-7b: rc $?"
  timeout "${GPU_13B_TIMEOUT:-180}" python docs/measurements/gpu_costs.py --shape llama2-13b \
    --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-13b.json" >"$out/llama2-13b.md" 2>&1
  echo "llama2-13b: rc $?"
  for f in llama2-7b llama2-13b; do
    echo "== $f"
    sed -n '/^# Eager against/,$p' "$out/$f.md"
    sed -n '/^## Bandwidth floor/,/^## Targets (issue 17)/p' "$out/$f.md" | head -n 24
    grep -E "NOT met|: met|Error|failed" "$out/$f.md" | tail -n 24
  done
fi

if want e2e; then
  timeout "${GPU_E2E_TIMEOUT:-120}" python docs/measurements/gpu_e2e.py --shape llama2-7b \
    --new-tokens "$tokens" --reps "$reps" --json "$out/e2e-7b.json" >"$out/e2e-7b.md" 2>&1
  echo "e2e llama2-7b: rc $?"
  tail -n 4 "$out/e2e-7b.md"
fi

if want replay; then
  for shape in ${GPU_REPLAY_SHAPES:-llama2-7b llama2-13b}; do
    # shellcheck disable=SC2086 # GPU_REPLAY_EXTRA: extra flags, word-split on purpose
    timeout "${GPU_REPLAY_TIMEOUT:-150}" python docs/measurements/gpu_e2e.py --shape "$shape" --graphs on \
      --reps 1 --trace-turns "${GPU_REPLAY_TURNS:-4}" --trace docs/measurements/traces/smollm2-135m.json \
      --trace docs/measurements/traces/qwen2.5-coder-0.5b.json --json "$out/replay-$shape.json" \
      ${GPU_REPLAY_EXTRA:-} >"$out/replay-$shape.md" 2>&1
    echo "replay $shape: rc $?"
    grep -E "^\| |Error" "$out/replay-$shape.md" | tail -n 14
  done
fi

if want real; then
  model=${GPU_REAL_MODEL:-${GPU_GGUF:-}}
  if [ -z "$model" ] || { [ -z "${GPU_REAL_MODEL:-}" ] && [ ! -f "$model" ]; }; then
    echo "real: skipped (GPU_GGUF is not a file: '${GPU_GGUF:-}')"
  else
    methods=${GPU_REAL_METHODS:-vanilla,hf_generate,static_confidence,selfsd_safe,swift,clasp,hybrid,prompt_lookup}
    # Self-SD's offline search ran once on the CPU (fp32, same prompts); its skip set is reused here.
    skipset=docs/measurements/traces/smollm2-135m-selfsd-skipset.json
    # modes: graphs (one graph per forward), branch (one per branch), exact (graphs, --exact on),
    # eager (vanilla and two methods only: eager decoding is slow, issue 38 item 6)
    for mode in ${GPU_REAL_MODES:-graphs exact branch eager}; do
      flags=(--cuda-graphs --cuda-graph-route forward)
      mmethods=$methods
      case $mode in
        branch) flags=(--cuda-graphs --cuda-graph-route branch) ;;
        exact) flags=(--cuda-graphs --cuda-graph-route forward --exact on) ;;
        eager) flags=(--no-cuda-graphs); mmethods=${GPU_EAGER_METHODS:-vanilla,static_confidence,hybrid} ;;
      esac
      preset=()
      [[ ",$mmethods," == *",selfsd_safe,"* ]] && preset=(--preset-args "selfsd_safe=--selector.skip_set $skipset")
      # shellcheck disable=SC2086 # GPU_REAL_EXTRA: extra flags, word-split on purpose
      timeout "${GPU_REAL_TIMEOUT:-300}" python experiments/bench.py --model "$model" --dtype bfloat16 \
        "${flags[@]}" --methods "$mmethods" "${preset[@]}" --limit 1 --max-new-tokens 128 --repeats 1 --no-plots --logger none --out "$out/real-$mode" ${GPU_REAL_EXTRA:-} \
        >"$out/real-$mode.log" 2>&1
      echo "real $mode: rc $?"
      grep -E "^\| |^- " "$out/real-$mode/bench.md" 2>/dev/null | head -n 14
    done
  fi
fi

if want tests; then
  timeout "${GPU_TEST_TIMEOUT:-100}" python -m pytest -q -m gpu tests/integration/test_gpu.py -n 8 \
    -p no:cacheprovider --junitxml="$out/gpu_tests.xml" >"$out/gpu_tests.log" 2>&1
  echo "gpu tests: rc $?"
  grep -E "passed|failed|FAILED|Error" "$out/gpu_tests.log" | tail -n 30
fi

if want compile; then
  timeout "${GPU_COMPILE_TIMEOUT:-110}" python docs/measurements/gpu_costs.py --shape llama2-7b --speed-only \
    --graphs on --hf-compile --new-tokens "$tokens" --reps "$reps" --json "$out/llama2-7b-compile.json" \
    >"$out/llama2-7b-compile.md" 2>&1
  echo "llama2-7b HF compile: rc $?"
  grep -v "^W1" "$out/llama2-7b-compile.md" | tail -n 8
fi
