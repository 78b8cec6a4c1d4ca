"""Synchronous vs one_step vs streaming training (issue #30): wall-clock, where each side waited,
the reward and held-out accuracy, for the same recipe and seed. Each mode runs in its own
`hybridflow train` process.

    python bench/async_modes.py                                  # the demo recipe on this CPU
    python bench/async_modes.py --recipe gsm8k_grpo --set model.path=/tmp/qwen   # a GPU run
    python bench/async_modes.py --workload heavy_tail --shape 0.5b   # random weights, long-tailed lengths

The heavy-tail workload is bench/vs_trl's: a random Qwen2.5-shaped model whose generation config
names 500 random ids (--stop-tokens) as EOS besides the tokenizer's (geometric lengths, mean ~290, capped at
--response), random-letter prompts, the share of 'a' in the response as the reward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
LETTER_A = """def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str.count("a") / max(len(solution_str), 1)
"""


def tiny_model_dir(out: Path, stop_tokens: int) -> str:
    """The tests' 2-layer random Qwen2 with the byte tokenizer, `stop_tokens` of its byte ids (never
    'a') as EOS besides the tokenizer's: on a CPU its decode step costs about the same at 1 sequence
    as at 64 (the step's fixed work dominates), as a small model's does on a GPU."""
    import random

    from hybridflow.models import byte_tokenizer, save_hf, tiny_model

    path = out / f"model-tiny-stops{stop_tokens}"
    if not (path / "config.json").is_file():
        model, tokenizer = tiny_model("qwen2", seed=0), byte_tokenizer()
        ids = random.Random(0).sample([i for i in range(128, 256)], stop_tokens)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *sorted(ids)]
        save_hf(model, tokenizer, path, overwrite=True)
    return str(path)


def heavy_tail_overrides(args) -> list[str]:
    sys.path.insert(0, str(ROOT / "bench" / "vs_trl"))
    from run import model_dir, prompts_file

    args.out.mkdir(parents=True, exist_ok=True)
    if args.shape == "tiny":
        model = tiny_model_dir(args.out, args.stop_tokens)
    else:
        model = model_dir(args.out, args.shape, stop_tokens=args.stop_tokens)
    reward = args.out / "letter_a.py"
    reward.write_text(LETTER_A)
    return [
        f"model.path={model}",
        f"data.train_files=[{prompts_file(args.out, 'letter_a', args.prompts * args.steps)}]",
        "data.val_files=[]",
        f"data.prompts_per_step={args.prompts}",
        "data.max_prompt_tokens=512",
        f"data.max_response_tokens={args.response}",
        "rollout.samples_per_prompt=8",
        f"rollout.max_batch_sequences={args.prompts * 8 * 2}",  # room for a step's groups and the next's
        "algorithm.adv_estimator=grpo",
        "actor.loss_agg_mode=token-mean",
        f"actor.max_tokens_per_microbatch={16 * (512 + args.response)}",
        f"actor.optim.lr={args.lr}",
        "actor.optim.lr_scheduler=constant",
        "actor.optim.warmup_steps=0",
        f"reward.custom_function_path={reward}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    ]


def first_time_reaching(
    times: list[float], scores: list[float], target: float, window: int = 3
) -> float | None:
    """Wall-clock seconds at the end of the first step where the mean score of the last `window`
    steps reaches `target` (None: never)."""
    for i in range(len(scores)):
        last = scores[max(0, i - window + 1) : i + 1]
        if len(last) == window and sum(last) / window >= target:
            return times[i]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="demo_arithmetic_grpo")
    ap.add_argument("--workload", choices=["recipe", "heavy_tail"], default="recipe")
    ap.add_argument(
        "--shape", default="0.5b", help="heavy_tail: 0.5b or 1.5b (random weights), or tiny (for a CPU)"
    )
    ap.add_argument("--steps", type=int, default=12, help="heavy_tail: training steps")
    ap.add_argument("--prompts", type=int, default=64, help="heavy_tail: prompts per step (x 8 samples)")
    ap.add_argument("--response", type=int, default=1024, help="heavy_tail: max response tokens")
    ap.add_argument(
        "--stop-tokens", type=int, default=500, help="heavy_tail: random EOS ids (fewer: longer responses)"
    )
    ap.add_argument("--lr", type=float, default=1e-5, help="heavy_tail: learning rate")
    ap.add_argument(
        "--modes",
        default="off,one_step,streaming",
        help="off, one_step, streaming (its engine pausing for the trainer), streaming_beside (generating "
        "beside the trainer's phases: rollout.pause_for_training=false); a streaming mode with _keep appended "
        "keeps the K/V of sequences in flight across updates (rollout.keep_kv_on_weight_update=true)",
    )
    ap.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness for streaming")
    ap.add_argument("--out", type=Path, default=Path("/tmp/async_modes"))
    ap.add_argument("--set", action="append", default=[], help="more overrides, key=value")
    args = ap.parse_args()
    workload = heavy_tail_overrides(args) if args.workload == "heavy_tail" else []
    recipe = [] if args.workload == "heavy_tail" else [args.recipe]
    report = {}
    for mode in args.modes.split(","):
        run_dir = args.out / mode
        base = mode.removesuffix("_keep").removesuffix("_beside")
        overrides = [
            *workload,
            f"trainer.async_mode={base}",
            *(["rollout.pause_for_training=false"] if "_beside" in mode else []),
            *(["rollout.keep_kv_on_weight_update=true"] if mode.endswith("_keep") else []),
            f"trainer.run_dir={run_dir}",
            "trainer.progress=false",
            *args.set,
        ]
        if mode.startswith("streaming"):
            overrides.append(f"rollout.max_staleness={args.staleness}")
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "hybridflow.cli", "train", *recipe, "--overwrite", *overrides],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"{mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["step"] > 0 and "timing_s/step" in r]
        val = {
            r["step"]: v for r in rows for k, v in r.items() if k.startswith("val-core/") and "/mean@" in k
        }

        def mean(key, steps=steps):
            return round(sum(r.get(key, 0.0) for r in steps) / len(steps), 3)

        elapsed, total = [], 0.0
        for r in steps:
            total += r["timing_s/step"]
            elapsed.append(round(total, 2))
        report[mode] = {
            "wall_s": round(wall, 1),
            "steps_s": round(total, 1),
            "step_s_mean": mean("timing_s/step"),
            "step_s_after_first": round((total - steps[0]["timing_s/step"]) / max(len(steps) - 1, 1), 3),
            "gen_wait_s_mean": mean("timing_s/gen"),  # the trainer waiting for its batch
            "update_actor_s_mean": mean("timing_s/update_actor"),
            "generation_idle_s_mean": mean("async/generation_idle_s"),
            "staleness_mean": mean("async/staleness_mean"),
            "partial_sequences_mean": mean("async/partial_sequences"),
            "recomputed_tokens_mean": mean("async/recomputed_tokens"),  # K/V prefilled again a step
            "response_length_mean": mean("response_length/mean"),
            "throughput_tokens_s": mean("perf/throughput"),
            "probs_diff_max": max(r.get("training/rollout_probs_diff_max", 0.0) for r in steps),
            "score_mean_per_step": [round(r["critic/score/mean"], 4) for r in steps],
            "step_s_per_step": [round(r["timing_s/step"], 2) for r in steps],
            "elapsed_s_per_step": elapsed,
            "held_out": val,
        }
        print(json.dumps({mode: report[mode]}), flush=True)
    if "off" in report:  # wall-clock (step times summed) to 90% of the synchronous run's final reward
        sync = report["off"]["score_mean_per_step"]
        target = sum(sync[-3:]) / len(sync[-3:]) * 0.9
        report["time_to_reward"] = {"target": round(target, 4)} | {
            mode: first_time_reaching(r["elapsed_s_per_step"], r["score_mean_per_step"], target)
            for mode, r in report.items()
            if mode != "time_to_reward"
        }
    print(json.dumps(report, indent=1))
    (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
