#!/usr/bin/env bash
# GPU step times of bench/vs_trl's hybridflow side at an earlier tree and at this one, alternating in one
# device call (the same card, the same random model): #59's check that the one road costs nothing.
#   git archive REV hybridflow bench | tar -x -C .bench_old      # here, once (.bench_old is ignored)
#   device run, carry [".whl", ".bench_old"]:  bash bench/vs_trl/before_after.sh
# RUNS: NAME:TREE pairs run in that order (default: before:.bench_old after:. before2:.bench_old after2:.).
# .whl holds omegaconf's and antlr4's wheels (bench/async_pause_runs.sh). Workload: 0.5B shape (random
# weights), 64 prompts x 8 samples x 256 tokens, model.compile=true, STEPS steps (the first left out).
# Each run's summary line is printed and its steps.jsonl copied to $OUT/NAME.jsonl.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/omegaconf*.whl .whl/antlr4*.whl
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
ARGS=(--reward letter_a --prompts 64 --samples 8 --response 256 --steps "${STEPS:-6}" --micro 64
      --sides hybridflow --hybridflow model.compile=true)
model=0.5b  # made by the first run, then read from its directory by the others
for run in ${RUNS:-before:.bench_old after:. before2:.bench_old after2:.}; do
  name=${run%%:*} tree=${run#*:}
  PYTHONPATH=/tmp/site:$tree python3 "$tree/bench/vs_trl/run.py" "/tmp/vt_$name" --model "$model" "${ARGS[@]}" 2>&1 | grep -E '^hybridflow |failed|Error'
  [ "$model" = 0.5b ] && model=/tmp/vt_$name/model-0.5b
  cp "/tmp/vt_$name/hybridflow/steps.jsonl" "${OUT:-/tmp/out}/$name.jsonl" 2>/dev/null
done
