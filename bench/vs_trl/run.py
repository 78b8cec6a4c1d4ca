"""GRPO in hybridflow and in TRL's GRPOTrainer: same model, prompts, samples, lengths, learning rate
and steps, one after the other on the same machine; a table of per-step speed and both reward curves.

    PYTHONPATH=. python bench/vs_trl/run.py OUT                                   # this CPU: SmolLM2-135M, arithmetic
    PYTHONPATH=. python bench/vs_trl/run.py OUT --model 0.5b --prompts 64 --samples 8 --response 256 \\
        --reward letter_a --micro 64                                              # one H200: speed

TRL runs in its own environment (`--trl-python`, default .venv-trl/bin/python: `make trl-venv`).
The matched settings and what differs are in trl_side.py's docstring and docs/benchmarks.md.
Step 1 of each side is left out of the means (both compile or warm up on it)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import compile_log  # noqa: E402
from spec import Spec  # noqa: E402

ROOT = Path(__file__).parents[2]


def model_dir(out: Path, name: str, stop_tokens: int = 0) -> str:
    """The default model's transformers directory, a random Qwen2.5-shaped one (bench/rollout.py's
    shapes, the byte tokenizer), or a path. `stop_tokens`: a random model's generation_config names
    that many random ids as EOS besides the tokenizer's, which both sides stop at (transformers'
    generate and TRL read generation_config.eos_token_id, as hybridflow does)."""
    if name == "default":
        from hybridflow.models.default import default_model_dir

        return str(default_model_dir())
    if name not in ("0.5b", "1.5b"):
        return name
    path = out / f"model-{name}" if not stop_tokens else out / f"model-{name}-stops{stop_tokens}"
    if not (path / "config.json").is_file():
        import random

        import torch
        from transformers import AutoModelForCausalLM

        sys.path.insert(0, str(ROOT / "bench"))
        from rollout import hf_config

        from hybridflow.models import byte_tokenizer, save_hf

        torch.manual_seed(0)
        model, tokenizer = AutoModelForCausalLM.from_config(hf_config(name)), byte_tokenizer()
        if stop_tokens:
            ids = random.Random(0).sample(range(len(tokenizer), model.config.vocab_size), stop_tokens)
            model.generation_config.eos_token_id = [tokenizer.eos_token_id, *sorted(ids)]
        save_hf(model, tokenizer, path, overwrite=True)
    return str(path)


def prompts_file(out: Path, reward: str, count: int, task: str = "demo") -> str:
    """The built-in arithmetic task's training rows (the demo recipe's, or bench/sft_then_grpo.py's
    whose SFT model learns from scratch), or random-letter prompts for the letter_a reward."""
    import random

    path = out / f"prompts-{reward}.jsonl"
    if reward == "arithmetic":
        from hybridflow.data import read_rows
        from hybridflow.data.tasks import make_task

        if task == "sft_then_grpo":
            sys.path.insert(0, str(ROOT / "bench"))
            from sft_then_grpo import TASK

            files = make_task("arithmetic", out / "task", **TASK)
        else:  # the demo recipe's: single-digit + and -, where SmolLM2-135M gets about half right
            files = make_task("arithmetic", out / "task", train_size=190, test_size=10, seed=0, max_digits=1,
                              operators="+-", instruction="Answer with just the number.")  # fmt: skip
        rows = read_rows(files["train"])
    else:
        rng = random.Random(0)
        rows = [{"prompt": [{"role": "user", "content": "".join(rng.choice("abcdefghij ") for _ in range(200))}],
                 "data_source": "synthetic", "reward_model": {"ground_truth": ""}} for _ in range(count)]  # fmt: skip
    path.write_text(
        "".join(json.dumps({k: r[k] for k in ("prompt", "data_source", "reward_model")}) + "\n" for r in rows)
    )
    return str(path)


def run_side(side: str, spec: Spec, python: str) -> float:
    script = Path(__file__).parent / f"{side}_side.py"
    spec_path = Path(spec.out) / "spec.json"
    Path(spec.out).mkdir(parents=True, exist_ok=True)
    (Path(spec.out) / "steps.jsonl").unlink(missing_ok=True)
    (Path(spec.out) / "triton_compiles.jsonl").unlink(missing_ok=True)
    spec.save(spec_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    with (Path(spec.out) / "log.txt").open("w") as log:
        done = subprocess.run(
            [python, str(script), str(spec_path)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    if done.returncode:
        tail = (Path(spec.out) / "log.txt").read_text()[-3000:]
        raise SystemExit(
            f"{side} side failed (exit {done.returncode}); the end of {spec.out}/log.txt:\n{tail}"
        )
    return time.perf_counter() - start


def summarize(out: Path) -> dict:
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    later = steps[1:] or steps
    mean = {
        k: sum(s[k] for s in later) / len(later)
        for k in ("wall_s", "gen_s", "update_s", "tokens", "response_tokens")
    }
    median = {k: statistics.median(s[k] for s in later) for k in ("wall_s", "gen_s", "update_s")}
    return {
        **{f"{k}_mean": v for k, v in mean.items()},
        **{f"{k}_median": v for k, v in median.items()},  # robust to one-off costs (a recompile)
        "tokens_per_s": sum(s["tokens"] for s in later) / sum(s["wall_s"] for s in later),
        "peak_memory_gib": max(s["peak_memory_gib"] for s in steps),
        "reward_curve": [round(s["reward_mean"], 4) for s in steps],
        # (hybridflow's side: the Triton compiles inside the steps after the first, which the means carry)
        **(
            {"triton_compiles": compile_log.summary(out / "triton_compiles.jsonl")}
            if (out / "triton_compiles.jsonl").exists()
            else {}
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct), 0.5b, 1.5b or a path")
    p.add_argument("--reward", default="arithmetic", choices=["arithmetic", "letter_a"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--response", type=int, default=16, help="max response tokens")
    p.add_argument("--max-prompt", type=int, default=512, help="max prompt tokens")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--micro", type=int, default=64, help="TRL's sequences per micro-batch")
    p.add_argument(
        "--stop-tokens",
        type=int,
        default=0,
        help="a random model stops at this many random ids too (each ~1/vocab a step: varied lengths)",
    )
    p.add_argument(
        "--task",
        default="demo",
        choices=["demo", "sft_then_grpo"],
        help="the arithmetic task: the demo recipe's, or bench/sft_then_grpo.py's (for its SFT model)",
    )
    p.add_argument(
        "--trl-gradient-checkpointing", action="store_true", help="TRL's default (off here, as ours)"
    )
    p.add_argument(
        "--hybridflow",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="settings of hybridflow's side beyond the matched ones (e.g. model.compile=true)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--sides", default="hybridflow,trl")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    args = p.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    base = dict(model_dir=model_dir(args.out, args.model, args.stop_tokens),
                data_file=prompts_file(args.out, args.reward, args.prompts * args.steps, args.task),
                steps=args.steps,
                prompts_per_step=args.prompts, samples_per_prompt=args.samples, max_prompt_tokens=args.max_prompt,
                max_response_tokens=args.response, lr=args.lr, reward=args.reward, device=device,
                sequences_per_microbatch=args.micro,
                trl_gradient_checkpointing=args.trl_gradient_checkpointing,
                hybridflow_overrides=args.hybridflow)  # fmt: skip
    summary = {"settings": {**base, "model": args.model, "stop_tokens": args.stop_tokens}, "sides": {}}
    for side in args.sides.split(","):
        python = sys.executable if side == "hybridflow" else args.trl_python
        total = run_side(side, Spec(out=str(args.out / side), **base), python)
        summary["sides"][side] = {"total_s": total, **summarize(args.out / side)}
        print(side, json.dumps(summary["sides"][side]), flush=True)
    sides = summary["sides"]
    if {"hybridflow", "trl"} <= set(sides):
        summary["step_speedup"] = sides["trl"]["wall_s_mean"] / sides["hybridflow"]["wall_s_mean"]
        summary["generation_speedup"] = sides["trl"]["gen_s_mean"] / sides["hybridflow"]["gen_s_mean"]
        summary["update_speedup"] = sides["trl"]["update_s_mean"] / sides["hybridflow"]["update_s_mean"]
        summary["step_speedup_of_medians"] = (
            sides["trl"]["wall_s_median"] / sides["hybridflow"]["wall_s_median"]
        )
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "sides"}, indent=1))


if __name__ == "__main__":
    main()
