#!/usr/bin/env bash
# The device runs owed to #61 (exact log-probs) and #62 (speculative rollout, the decode step), back to
# back and detached on one GPU, so that a lease's calls can carry the real model's pieces meanwhile. In
# order: the batch-invariant kernels' smoke check; the fused engine's tokens against the trainer's
# modules, the decode step's time (profiled); exact training
# forward+backward against the ordinary kernels, and under the profiler; the actor's update alone on
# bench/vs_trl's workload, exact (BASE's tree first) and ordinary; two exact GRPO runs per mode
# compared to the bit (0.5B shape); the exact engine's tokens/s and decode step; speculative decoding
# on a random 0.5B shape (greedy: the verifying step's check; temperature 1: text with nothing to
# reuse); then, once bench/real_model.py has written /tmp/qwen and touched /tmp/qwen.ready,
# speculative decoding on the real model's GSM8K responses (adaptive, and speculating whenever a draft
# exists), a 30-step GRPO run of the real model plain and speculating, then once bench/vllm_wheels.sh's
# wheel is installed in /tmp/vllm-site, vLLM 0.26 on the same workload (plain and its n-gram
# speculation), the exact 1.5B shape, and when RUNS names it, the real model's GSM8K GRPO run with exact
# log-probs (~14 minutes; measured 2026-12-06). Each run writes /tmp/res/NAME.json or NAME.log;
# /tmp/res/done says when each started and ended. A poll begins `[ -f /tmp/res/done ] || exit 3` (a
# machine lost between calls comes back bare) and brings /tmp/res back as one archive.
#   PYTHONPATH=/tmp/site:$PWD:$PWD/bench setsid nohup bash bench/device_runs.sh > /tmp/res/driver.log 2>&1 &
# (setsid for every job meant to outlive its call, the model's build too: the device tool kills the
# call's session when the call ends)
# RUNS picks the runs (default: all but gsm8k, in this order); REPEAT_ARGS replaces the exact pair's
# settings; GSM8K_ARGS replaces the real run's
# settings (default: the collapsing run of docs/benchmarks.md at lr 3e-6); DATA is the GSM8K folder;
# BASE, a folder with another commit's hybridflow/ and bench/ (`git archive 652f617 hybridflow bench |
# tar -x -C .base`, carried), runs that tree's decode step, exact pair and exact engine first
# (decode_base, repeat_base, engine_exact_base, decode_exact_base): a before / after in one lease
# (BASE_RUNS=1: one run a mode there, its step time only; BASE_REPEAT_ARGS replaces its settings).
set -u
mkdir -p /tmp/res
DATA=${DATA:-/tmp/.gsm8k}
step() {
  name=$1; shift
  case " ${RUNS:-all} " in *" $name "*) ;; *" all "*) [ "$name" != gsm8k ] || return ;; *) return ;; esac
  echo "$name start $(date +%s)" >> /tmp/res/done
  "$@" > "/tmp/res/$name.log" 2>&1
  echo "$name rc=$? $(date +%s)" >> /tmp/res/done
}
step smoke python3 bench/exact_logprobs.py --out /tmp/res/smoke.json --sections smoke
# the decode step at small batch (#62's bar: 0.5B at batch 1 <= 0.5 ms on the H200, 7B <= 1.2x its
# weight reads): the fused engine against the trainer's modules, then the step's time (with BASE,
# that tree's first)
step decode_parity python3 bench/decode_parity.py --shape 0.5b
DECODE_ARGS="--shape 0.5b --batch 1 --batch 16 --batch 64"
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_base python3 bench/decode_profile.py $DECODE_ARGS)
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_7b_base python3 bench/decode_profile.py --shape 7b --batch 1)
fi
step decode python3 bench/decode_profile.py $DECODE_ARGS
step decode_7b python3 bench/decode_profile.py --shape 7b --batch 1
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_7b_exact_base python3 bench/decode_profile.py \
    --shape 7b --batch 1 --exact)
fi
step decode_7b_exact python3 bench/decode_profile.py --shape 7b --batch 1 --exact
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step training_base python3 bench/exact_logprobs.py \
    --out /tmp/res/training_base.json --sections training)
fi
step training python3 bench/exact_logprobs.py --out /tmp/res/training.json --sections training,profile
# the exact engine at 1,024 sequences: its step against the ordinary one, and its matmul's tiles (#61)
step matmul python3 bench/exact_matmul.py --out /tmp/res/matmul.json
step matmul_small python3 bench/exact_matmul.py --out /tmp/res/matmul_small.json --rows 128 --rows 256 --shapes 0.5b,1.5b
# and in a step's tail, where the pointer form's narrow tiles split every chunk
step matmul_tail python3 bench/exact_matmul.py --out /tmp/res/matmul_tail.json --rows 1 --rows 16 --rows 64 \
  --shapes 0.5b,1.5b,7b
# the library's own tiles from one row to a GRPO step's 256: its rule against split and looped
step matmul_forms python3 bench/exact_matmul.py --out /tmp/res/matmul_forms.json --rows 1 --rows 16 --rows 64 \
  --rows 128 --rows 256 --shapes 0.5b,1.5b,7b --default-tiles
# (with BASE, another commit's tree just before each: the host's share of a step, before / after)
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_1024_base python3 bench/decode_profile.py \
    --shape 0.5b --batch 1024 --runs 4)
fi
step decode_1024 python3 bench/decode_profile.py --shape 0.5b --batch 1024 --runs 4
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_exact_1024_base python3 bench/decode_profile.py \
    --shape 0.5b --batch 1024 --runs 4 --exact)
fi
step decode_exact_1024 python3 bench/decode_profile.py --shape 0.5b --batch 1024 --runs 4 --exact
# the host's work per decode run at 1,024 sequences, by function (what the GPU waits on between runs)
step host_1024 python3 bench/decode_profile.py --shape 0.5b --batch 1024 --runs 4 --host-profile
step host_exact_1024 python3 bench/decode_profile.py --shape 0.5b --batch 1024 --runs 4 --host-profile --exact
# the actor's update alone on bench/vs_trl's workload (512 sequences, 200-token prompts shared by 8,
# 256-token responses): the exact kernels (with BASE, that tree's first, this script) and the ordinary,
# each then under the profiler (its top 30 kernels)
ACTOR="--shape 0.5b --variants 29184 --repeats 3 --parity-tokens 256"
if [ -n "${BASE:-}" ]; then
  here=$PWD
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step actor_exact_base python3 "$here/bench/actor_update.py" \
    $ACTOR --exact)
fi
step actor_exact python3 bench/actor_update.py $ACTOR --exact --profile --rows 30
step actor_ordinary python3 bench/actor_update.py $ACTOR --profile --rows 30
# the same on the exact GRPO step's own workload (bench/repeatable_runs.py: 16 prompts x 8, ~16-token
# prompts, 256-token responses, a 259-entry vocabulary), where the exact update measured 0.652 s against
# 0.471 (2026-12-07) while the one above is the faster
GRPO_ACTOR="--shape 0.5b --sequences 128 --prompt 16 --response 256 --vocab 259 --variants 8192 --repeats 3 --parity-tokens 256"
step actor_grpo_exact python3 bench/actor_update.py $GRPO_ACTOR --exact --profile --rows 30
step actor_grpo python3 bench/actor_update.py $GRPO_ACTOR --profile --rows 30
# the host's microseconds a call of each exact op against its ordinary counterpart (what an update
# that waits on the host spends them on)
step host python3 bench/exact_host.py --out /tmp/res/host.json
if [ -n "${BASE:-}" ]; then  # another commit's tree: its exact pair first, for a before / after in one lease
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step repeat_base python3 bench/repeatable_runs.py \
    --out /tmp/res/repeat_base.json ${BASE_REPEAT_ARGS:---steps 10 --exact --runs "${BASE_RUNS:-2}"})
fi
step repeat python3 bench/repeatable_runs.py --out /tmp/res/repeat.json ${REPEAT_ARGS:---steps 10 --exact --baseline}
# the deterministic settings alone (ordinary kernels): their share of the exact run's step
step repeat_deterministic python3 bench/repeatable_runs.py --out /tmp/res/repeat_deterministic.json --steps 6 \
  --deterministic --runs 1 --modes synchronous
if [ -n "${BASE:-}" ]; then  # (a tree from before decode_profile.py --exact fails these two)
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step engine_exact_base python3 bench/exact_logprobs.py \
    --out /tmp/res/engine_exact_base.json --sections engine)
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_exact_base python3 bench/decode_profile.py \
    --shape 0.5b --batch 1 --batch 64 --batch 128 --batch 256 --exact)
fi
step engine_exact python3 bench/exact_logprobs.py --out /tmp/res/engine_exact.json --sections engine
step decode_exact python3 bench/decode_profile.py --shape 0.5b --batch 1 --batch 64 --batch 128 --batch 256 --exact
# the middle batches where the exact engine trails most (a GRPO step's 128-256 sequences), ordinary
# beside it, and the real model's shape at its run's 256 sequences and in its tail (16, 64): its GSM8K
# run decodes 5.25 ms a step exact against 3.00 (2026-12-07), most steps in the tail
step decode_mid python3 bench/decode_profile.py --shape 0.5b --batch 128 --batch 256
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step decode_1.5b_exact_base python3 bench/decode_profile.py \
    --shape 1.5b --batch 16 --batch 64 --batch 256 --exact)
fi
step decode_1.5b_exact python3 bench/decode_profile.py --shape 1.5b --batch 16 --batch 64 --batch 256 --exact
step decode_1.5b python3 bench/decode_profile.py --shape 1.5b --batch 16 --batch 64 --batch 256
# #61's engine bar as its issue words it: bench/rollout.py on the 0.5B and 7B shapes at 1,024 sequences
# and at batch 1, the exact engine against the ordinary one (rollout_SHAPE[_b1][_exact]); _fp32: the
# ordinary engine beside the same fp32 master as the exact one's (its own bf16 copy, the KV pool what
# the master leaves: a 7B's 28 GiB master cost the exact run 42% of its pages, 2026-12-07)
for shape in 0.5b 7b; do
  for variant in "" _exact _fp32; do
    case $variant in _exact) extra="--exact --master fp32" ;; _fp32) extra="--master fp32" ;; *) extra="" ;; esac
    for size in "" _b1; do  # (with BASE, that tree's run first: rollout_SHAPE[_b1][_exact]_base)
      case $size in _b1) prompts="--prompts 1 --n 1" ;; *) prompts="--prompts 128 --n 8" ;; esac
      if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step "rollout_$shape$size${variant}_base" \
          python3 bench/rollout.py --shape $shape $prompts --response 256 --hf-sequences 0 $extra)
      fi
      step "rollout_$shape$size$variant" python3 bench/rollout.py --shape $shape $prompts --response 256 \
        --hf-sequences 0 $extra
    done
  done
done
# #61's step bar as its issue words it: bench/vs_trl's hybridflow side (0.5B shape, 8 prompts x 8 x 256
# tokens, letter_a), ordinary as the summary table's rows run it (model.compile=true), then exact (which
# refuses compile: torch.compile rounds its own way), then ordinary without compile
VS_TRL="--model 0.5b --reward letter_a --prompts 8 --samples 8 --response 256 --steps 6 --sides hybridflow"
step vs_trl python3 bench/vs_trl/run.py /tmp/res/vs_trl $VS_TRL --hybridflow model.compile=true
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH="/tmp/site:$BASE:$BASE/bench" step vs_trl_exact_base python3 bench/vs_trl/run.py \
    /tmp/res/vs_trl_exact_base $VS_TRL --hybridflow rollout.exact_logprobs=true)
fi
step vs_trl_exact python3 bench/vs_trl/run.py /tmp/res/vs_trl_exact $VS_TRL --hybridflow rollout.exact_logprobs=true
step vs_trl_eager python3 bench/vs_trl/run.py /tmp/res/vs_trl_eager $VS_TRL
rm -rf /tmp/res/vs_trl*/model-* /tmp/res/vs_trl*/hybridflow/run
SHAPE_SPEC="--shape 0.5b --device cuda --prompts 32 --tokens 256 --repeats 3"
step spec_greedy python3 bench/speculative.py $SHAPE_SPEC --temperature 0 \
  --workloads random_prompts,random_one_sequence --out /tmp/res/spec_greedy.json
step spec_random python3 bench/speculative.py $SHAPE_SPEC --temperature 1 \
  --workloads random_prompts,random_one_sequence --out /tmp/res/spec_random.json
# the rest needs the real model: wait for it only where RUNS names such a run
case " ${RUNS:-all} " in *" all "*|*" spec_real"*|*" gsm8k"*|*" vllm_"*|*" repeat_1.5b "*) ;; *) exit 0 ;; esac
for _ in $(seq 120); do [ -f /tmp/qwen.ready ] && break; sleep 5; done  # (10 minutes at most)
[ -f /tmp/qwen.ready ] || { echo "no /tmp/qwen.ready after 10 minutes" >> /tmp/res/done; exit 1; }
REAL_SPEC="--model /tmp/qwen --device cuda --data $DATA --tokens 512 --repeats 3"
step spec_real python3 bench/speculative.py $REAL_SPEC --prompts 32 --workloads gsm8k,gsm8k_one_sequence \
  --out /tmp/res/spec_real.json
step spec_real4 python3 bench/speculative.py $REAL_SPEC --prompts 4 --workloads gsm8k \
  --out /tmp/res/spec_real4.json
step spec_real4_always python3 bench/speculative.py $REAL_SPEC --prompts 4 --workloads gsm8k --always \
  --out /tmp/res/spec_real4_always.json
# speculation in training (#62): the same short GRPO run plain and speculating (the policy's entropy
# falls within 30 steps at lr 3e-6, and siblings' drafts are kept more as it does)
SPEC_GRPO="--steps 30 --test-freq 10 --test-size 100 --prompts 32 --samples 8 --response 512 --lr 3e-6"
step gsm8k_plain python3 bench/real_gsm8k.py --model /tmp/qwen --data "$DATA" --out /tmp/res/gsm8k_plain $SPEC_GRPO
step gsm8k_spec python3 bench/real_gsm8k.py --model /tmp/qwen --data "$DATA" --out /tmp/res/gsm8k_spec $SPEC_GRPO \
  --set rollout.speculative.num_speculative_tokens=4
rm -rf /tmp/res/gsm8k_*/*/checkpoints
if [ -f /tmp/vllm-site/vllm/__init__.py ]; then  # (installed by the calls that carried the pieces)
  for method in plain ngram; do
    PYTHONPATH=/tmp/vllm-site:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 step "vllm_$method" \
      python3 bench/speculative.py $REAL_SPEC --prompts 32 --workloads gsm8k,random_prompts --backend vllm \
      --vllm-method $method --out "/tmp/res/vllm_$method.json"
  done
fi
step gsm8k python3 bench/real_gsm8k.py --model /tmp/qwen --data "$DATA" --out /tmp/res/gsm8k \
  ${GSM8K_ARGS:---steps 100 --test-freq 10 --test-size 200 --prompts 32 --samples 8 --response 512 --lr 3e-6} \
  --set rollout.exact_logprobs=true
rm -rf /tmp/res/gsm8k/*/checkpoints
step repeat_1.5b python3 bench/repeatable_runs.py --out /tmp/res/repeat_1.5b.json --steps 10 --exact \
  --shape 1.5b --runs 1 --modes synchronous
