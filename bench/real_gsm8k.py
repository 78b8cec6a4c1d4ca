"""GSM8K with a real model (issue #32): GRPO (or PPO with a critic, DAPO, LoRA) from the original
files, held-out greedy accuracy on a fixed subset of the test split before training and every N
steps, under verl's strict extraction (val-core/openai/gsm8k/acc: '#### N') and a lenient
math-verify check (val-aux/openai/gsm8k/lenient/mean@1: the answer however it is written), so that
learning the format and learning to solve are told apart; against wall-clock, with tokens/s/GPU.

    # the GPU machine, once bench/real_model.py has written /tmp/qwen (math-verify's wheels carried):
    PYTHONPATH=. python bench/real_gsm8k.py --model /tmp/qwen --data .gsm8k-raw --out /tmp/gsm8k --steps 60
    # this CPU, a smoke run of the whole path with the embedded model:
    PYTHONPATH=. python bench/real_gsm8k.py --model default --steps 2 --test-size 4 --prompts 2 --samples 2 \\
        --response 32 --test-freq 1

Variants: --algo ppo (gsm8k_ppo: GAE with a critic), --algo dapo (DAPO's clip-higher, token-mean loss,
dynamic sampling, overlong buffer), --lora-rank 32; ppo and dapo update 4 times a step by default
(--updates-per-step), grpo once (TRL's side). More settings: --set key=value.
--framework trl runs the same GRPO in TRL's GRPOTrainer instead (bench/vs_trl/gsm8k_trl.py, in
--trl-python's environment: `make trl-venv`), with the same held-out evaluation and output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REWARD = '''"""verl's strict GSM8K score trains (with --reward dense, half of it and half the lenient check);
the lenient math-verify check rides along (val-aux). `acc` and `pred` (held-out mean/best/maj@N) are
VAL_SCORE's."""
from hybridflow.rewards.scorers import compute_score as builtin


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    strict = builtin("openai/gsm8k", solution_str, ground_truth)
    lenient = builtin("gsm8k_math_verify", solution_str, ground_truth)
    score = STRICT_SHARE * strict["score"] + (1 - STRICT_SHARE) * lenient["score"]
    held_out = strict if "VAL_SCORE" == "strict" else {"acc": lenient["score"], "pred": lenient["pred"]}
    return {"score": score, "acc": held_out["acc"], "pred": held_out["pred"], "lenient": lenient["score"]}
'''
DAPO = [
    "actor.clip_ratio_low=0.2",
    "actor.clip_ratio_high=0.28",
    "actor.loss_agg_mode=token-mean",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.max_generation_rounds=4",
    "reward.overlong_buffer.enable=true",
    "reward.overlong_buffer.buffer_tokens=128",
]


def hybridflow(*args: str) -> None:
    """`hybridflow ARGS`; its failure (its own one-line error above) ends this script with its code."""
    code = subprocess.run([sys.executable, "-m", "hybridflow.cli", *args]).returncode
    if code:
        raise SystemExit(code)


def prepare_data(raw: Path, out: Path, test_size: int) -> tuple[Path, Path]:
    """verl's schema and instruction (`hybridflow data preprocess gsm8k`), and the first `test_size`
    test problems: the same held-out subset in every run."""
    import pandas as pd

    train, test = out / "train.parquet", out / "test.parquet"
    for split, path in (("train", train), ("test", test)):
        if path.is_file():  # prepared already (a carried copy, or an earlier run)
            continue
        source = next(
            (raw / f"{split}{ext}" for ext in (".parquet", ".jsonl") if (raw / f"{split}{ext}").is_file()),
            None,
        )
        if source is None:
            raise SystemExit(f"{raw} has no {split}.parquet or {split}.jsonl (the original GSM8K files)")
        hybridflow(
            "data", "preprocess", "gsm8k", "--input", str(source), "--out", str(path), "--split", split
        )
    subset = out / f"test_first{test_size}.parquet"
    pd.read_parquet(test).head(test_size).to_parquet(subset)
    return train, subset


def run_trl(args, train: Path, held_out: Path) -> Path:
    """The same GRPO in TRL's GRPOTrainer, on the same prompts as jsonl; its run directory."""
    import pandas as pd

    run_dir = args.out / "trl-grpo"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "default":  # the embedded model as the transformers directory hybridflow keeps of it
        from hybridflow.models.default import default_model_dir

        model = str(default_model_dir())
    for parquet in (train, held_out):
        pd.read_parquet(parquet).to_json(run_dir / f"{parquet.stem}.jsonl", orient="records", lines=True)
    subprocess.run(
        [args.trl_python, str(Path(__file__).parent / "vs_trl" / "gsm8k_trl.py"), "--model", model,
         "--train", str(run_dir / f"{train.stem}.jsonl"), "--test", str(run_dir / f"{held_out.stem}.jsonl"),
         "--out", str(run_dir), "--steps", str(args.steps), "--test-freq", str(args.test_freq),
         "--prompts", str(args.prompts), "--samples", str(args.samples), "--response", str(args.response),
         "--lr", str(args.lr), "--budget-s", str(args.budget_s)],
        check=True,
    )  # fmt: skip
    return run_dir


def curve(run_dir: Path) -> tuple[list[dict], float | None]:
    """Per validation: the step, wall-clock seconds of training so far, strict and lenient accuracy."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    elapsed, points, throughput = 0.0, [], []
    for r in sorted(rows, key=lambda r: r["step"]):
        elapsed += r.get("timing_s/step", 0.0)
        if "perf/throughput" in r:
            throughput.append(r["perf/throughput"])
        strict = next(
            (v for k, v in r.items() if k.startswith("val-core/") and k.endswith("/acc/mean@1")), None
        )
        if strict is not None:
            lenient = next((v for k, v in r.items() if k.startswith("val-aux/") and "/lenient/" in k), None)
            points.append(
                {"step": r["step"], "train_s": round(elapsed, 1), "strict": strict, "lenient": lenient}
            )
    return points, (sum(throughput) / len(throughput) if throughput else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="default", help="an HF directory (bench/real_model.py), a .gguf, 'default'"
    )
    ap.add_argument(
        "--data", type=Path, default=Path("../shared/data/gsm8k"), help="the original GSM8K files"
    )
    ap.add_argument("--out", type=Path, default=Path("/tmp/real_gsm8k"))
    ap.add_argument("--algo", choices=["grpo", "ppo", "dapo"], default="grpo")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--test-size", type=int, default=200, help="held-out problems: the test split's first N")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--response", type=int, default=512, help="max response tokens")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument(
        "--reward", choices=["strict", "dense"], default="strict",
        help="strict: verl's '#### N' score trains (0 until the format is found: when the first formatted "
        "sample comes is luck, which decides a short run's time to accuracy); dense: half that, half the "
        "lenient math-verify check (signal from the first step; what comparisons of modes should use)",
    )  # fmt: skip
    ap.add_argument(
        "--val-score", choices=["strict", "lenient"], default="strict",
        help="what val-core's acc mean/best/maj@N (the curve's 'strict') holds: verl's '#### N' score or the "
        "lenient check (with --set rollout.val_samples_per_prompt=16 rollout.val_temperature=1: how many "
        "problems the model can solve at all, whatever the format)",
    )  # fmt: skip
    ap.add_argument(
        "--updates-per-step",
        type=int,
        default=0,
        help="optimizer updates per step (mini-batches of the step's responses); 0: 1 for grpo (as TRL's "
        "side), 4 for ppo and dapo (clip-higher binds only from a step's second update on)",
    )
    ap.add_argument("--set", action="append", default=[], help="more overrides, key=value")
    ap.add_argument("--framework", choices=["hybridflow", "trl"], default="hybridflow")
    ap.add_argument("--budget-s", type=float, default=0, help="TRL: stop after this many training seconds")
    ap.add_argument("--trl-python", default=".venv-trl/bin/python", help="TRL's environment (make trl-venv)")
    args = ap.parse_args()
    if args.updates_per_step < 0 or args.budget_s < 0:
        raise SystemExit("--updates-per-step and --budget-s take 0 (the default) or a positive number")
    args.out.mkdir(parents=True, exist_ok=True)
    train, held_out = prepare_data(args.data, args.out, args.test_size)
    if args.framework == "trl":
        if args.algo != "grpo" or args.lora_rank or args.set:
            raise SystemExit("--framework trl runs GRPO as given (no --algo, --lora-rank or --set)")
        run_trl(args, train, held_out)
        return
    updates = args.updates_per_step or (1 if args.algo == "grpo" else 4)
    if (args.prompts * args.samples) % updates:
        raise SystemExit(
            f"--updates-per-step {updates} does not divide {args.prompts} x {args.samples} responses"
        )
    reward = args.out / "reward.py"
    reward.write_text(
        REWARD.replace("STRICT_SHARE", "1.0" if args.reward == "strict" else "0.5").replace(
            "VAL_SCORE", args.val_score
        )
    )
    run_dir = args.out / f"{args.algo}{f'-lora{args.lora_rank}' if args.lora_rank else ''}"
    overrides = [
        f"model.path={args.model}",
        f"data.train_files=[{train}]",
        f"data.val_files=[{held_out}]",
        f"data.max_val_prompts={args.test_size}",
        f"data.prompts_per_step={args.prompts}",
        f"data.max_response_tokens={args.response}",
        f"rollout.samples_per_prompt={args.samples}",
        f"actor.sequences_per_update={args.prompts * args.samples // updates}",
        f"actor.optim.lr={args.lr}",
        f"reward.custom_function_path={reward}",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
        "trainer.progress=false",
        f"trainer.run_dir={run_dir}",
        *(DAPO if args.algo == "dapo" else []),
        *([f"model.lora_rank={args.lora_rank}"] if args.lora_rank else []),
        *args.set,
    ]
    recipe = "gsm8k_ppo" if args.algo == "ppo" else "gsm8k_grpo"
    start = time.perf_counter()
    hybridflow("train", recipe, "--overwrite", *overrides)
    points, throughput = curve(run_dir)
    summary = {
        "model": args.model,
        "algo": args.algo,
        "reward": args.reward,
        "lora_rank": args.lora_rank,
        "wall_s": round(time.perf_counter() - start, 1),
        "tokens_per_s_per_gpu": throughput,
        "held_out": points,
    }
    (run_dir / "gsm8k_curve.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
