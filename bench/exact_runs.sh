#!/usr/bin/env bash
# #61's device runs, back to back and detached, on one GPU: the batch-invariant kernels' smoke check,
# two exact GRPO runs per mode compared to the bit (0.5B shape), one exact run of the 1.5B shape, the
# training forward+backward against the ordinary kernels, then (once bench/real_model.py has written
# /tmp/qwen and touched /tmp/qwen.ready) the real model's GSM8K GRPO run with exact log-probs. Each step
# writes /tmp/res/NAME.json or NAME.log; /tmp/res/done says when each started and ended.
#   PYTHONPATH=/tmp/site:$PWD:$PWD/bench setsid nohup bash bench/exact_runs.sh > /tmp/res/driver.log 2>&1 &
# GSM8K_ARGS replaces the real run's settings (default: the collapsing run of docs/benchmarks.md at lr 3e-6).
set -u
mkdir -p /tmp/res
step() {
  name=$1; shift
  echo "$name start $(date +%s)" >> /tmp/res/done
  "$@" > "/tmp/res/$name.log" 2>&1
  echo "$name rc=$? $(date +%s)" >> /tmp/res/done
}
step smoke python3 bench/exact_logprobs.py --out /tmp/res/smoke.json --sections smoke
step repeat python3 bench/repeatable_runs.py --out /tmp/res/repeat.json --steps 10 --exact
step repeat_1.5b python3 bench/repeatable_runs.py --out /tmp/res/repeat_1.5b.json --steps 10 --exact \
  --shape 1.5b --runs 1 --modes synchronous
step training python3 bench/exact_logprobs.py --out /tmp/res/training.json --sections training
for _ in $(seq 120); do [ -f /tmp/qwen.ready ] && break; sleep 5; done  # (10 minutes at most)
[ -f /tmp/qwen.ready ] || { echo "no /tmp/qwen.ready after 10 minutes" >> /tmp/res/done; exit 1; }
step gsm8k python3 bench/real_gsm8k.py --model /tmp/qwen --data /tmp/.gsm8k --out /tmp/res/gsm8k \
  ${GSM8K_ARGS:---steps 100 --test-freq 10 --test-size 200 --prompts 32 --samples 8 --response 512 --lr 3e-6} \
  --set rollout.exact_logprobs=true
