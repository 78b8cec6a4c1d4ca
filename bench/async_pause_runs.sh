#!/usr/bin/env bash
# #30 on one H200: synchronous against streaming with the engine pausing for the trainer (the default
# since 2026-12-04) and against streaming beside the trainer (rollout.pause_for_training=false, the
# 1.08x of docs/benchmarks.md), each also keeping the K/V of the sequences in flight across updates
# (rollout.keep_kv_on_weight_update: no prefill of them after each update), on bench/vs_trl's
# long-tailed random workload (0.5B shape, 32 prompts x 8, up to 4,096 tokens, 125 random EOS ids: mean
# ~1,160). Two device calls of < 600 s with the omegaconf wheels carried
# (`../shared/tools/device-wheels`, carry [".whl"]); the second finds the model the first made in /tmp
# while the machine stays warm:
#   RUNS="off pause2 pause2keep pause3" timeout 585 bash bench/async_pause_runs.sh
#   RUNS="beside2 beside2keep pause3keep pause1" timeout 585 bash bench/async_pause_runs.sh
# (and, owed: RUNS="off pause2b768 pause2keepb768" in a third)
# Each run's report line is printed as it ends and its metrics.jsonl copied to $OUT/NAME/, so a run cut
# by the call's limit still returns the ones before it. RUNS picks a subset (default: all, in order).
# Figures of 2026-12-05 (pausing at staleness 3: 1.52x a steady step) in docs/benchmarks.md.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/omegaconf*.whl .whl/antlr4*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
# micro-batches of 8 full sequences (async_modes' default is 16): the update then leaves room for the
# whole KV pool (512 x 4,608 tokens) beside it, as keeping the K/V across updates needs (`hybridflow plan
# --gpu-memory-gib 140`: update_actor 94 GiB with the pool, against a pool capped to 0.9M tokens at 16);
# every run gets the same, so that they differ in the mode alone
HT="--workload heavy_tail --shape 0.5b --steps 8 --prompts 32 --response 4096 --stop-tokens 125
    --set actor.max_tokens_per_microbatch=36864"
BYPASS="--set algorithm.rollout_correction.bypass_mode=true"  # pi_old = the sampler's: nothing recomputed
run() {
  name=$1; shift
  case " ${RUNS:-all} " in *" all "*|*" $name "*) ;; *) return ;; esac
  # the random model (~2 GB) is written under --out: /tmp, not $OUT; made once, shared by the runs
  mkdir -p "/tmp/ht_$name" && [ -d /tmp/ht_model ] && ln -sfn /tmp/ht_model "/tmp/ht_$name/model-0.5b-stops125"
  python3 bench/async_modes.py $HT --out "/tmp/ht_$name" "$@" 2>&1 | grep -E '^\{"|failed|Error'
  [ -d /tmp/ht_model ] || mv "/tmp/ht_$name/model-0.5b-stops125" /tmp/ht_model
  ln -sfn /tmp/ht_model "/tmp/ht_$name/model-0.5b-stops125"
  mkdir -p "${OUT:-/tmp/out}/$name"
  for d in /tmp/ht_"$name"/*/; do
    [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "${OUT:-/tmp/out}/$name/$(basename "$d").jsonl"
  done
}
# a window of generation lasts at least (longest response) / (staleness + 1) engine steps: the step's
# longest sample started max_staleness windows earlier; at 3, four steps' groups (1,024 sequences) run at once
run off --modes off
run pause2 --modes streaming --staleness 2 $BYPASS
run pause2keep --modes streaming_keep --staleness 2 $BYPASS
run pause3 --modes streaming --staleness 3 $BYPASS --set rollout.max_batch_sequences=1024
run beside2 --modes streaming_beside --staleness 2 $BYPASS
run beside2keep --modes streaming_beside_keep --staleness 2 $BYPASS
run pause3keep --modes streaming_keep --staleness 3 $BYPASS --set rollout.max_batch_sequences=1024
run pause1 --modes streaming --staleness 1 $BYPASS
# (2026-12-05: the staleness-2 runs above hold 512 of the 768 sequences their staleness admits, the
# third step's groups waiting for room; these give the engine all of them)
run pause2b768 --modes streaming --staleness 2 $BYPASS --set rollout.max_batch_sequences=768
run pause2keepb768 --modes streaming_keep --staleness 2 $BYPASS --set rollout.max_batch_sequences=768
