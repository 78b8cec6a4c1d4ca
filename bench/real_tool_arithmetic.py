"""A real instruct model with and without a tool (issue #29): five-digit products, which the model
alone rarely gets right, GRPO with the built-in calculator (`rollout.agent.loop=tools`) or without
it (single turn), the same problems, prompts but for the instruction, samples and steps. Held-out
greedy accuracy before training and every --test-freq steps.

    PYTHONPATH=. python bench/real_tool_arithmetic.py --model /tmp/qwen --mode tool --out /tmp/ta-tool
    PYTHONPATH=. python bench/real_tool_arithmetic.py --model /tmp/qwen --mode alone --out /tmp/ta-alone

The model: bench/real_model.py (Qwen2.5-Coder-1.5B-Instruct; its chat template renders tools in the
Hermes format).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridflow.config import load_config
from hybridflow.controller.trainer import RLTrainer

INSTRUCTIONS = {
    "tool": 'Call the calculator tool in a <tool_call> block. Then end your answer with "#### <number>".',
    "alone": 'Compute the value. End your answer with "#### <number>".',
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=sorted(INSTRUCTIONS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--digits", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a few prompts and tokens: the script works (CPU)")
    args = ap.parse_args()
    task = {"max_digits": args.digits, "operators": "*", "train_size": 4000, "test_size": 200, "seed": 0,
            "instruction": INSTRUCTIONS[args.mode]}  # fmt: skip
    overrides = [
        f"model.path={args.model}", "data.task=arithmetic", f"data.task_options={json.dumps(task)}",
        "data.prompts_per_step=32", "data.max_prompt_tokens=1024", "data.max_response_tokens=512",
        "rollout.samples_per_prompt=8", "actor.optim.lr=1e-6", "actor.sequences_per_update=128",
        "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}", "trainer.val_before_train=true", "trainer.save_freq=-1",
        f"trainer.run_dir={args.out}", "trainer.logger=[jsonl]", "trainer.progress=false",
    ]  # fmt: skip
    if args.smoke:  # later overrides win
        overrides += [f"data.task_options={json.dumps(task | {'test_size': 4})}", "data.prompts_per_step=2",
                      "rollout.samples_per_prompt=2", "data.max_response_tokens=48", "actor.sequences_per_update=4"]  # fmt: skip
    if args.mode == "tool":
        overrides += ["rollout.agent.loop=tools", "rollout.agent.tools=[calculator]", "rollout.agent.max_turns=4",
                      "rollout.agent.max_tokens_per_turn=256"]  # fmt: skip
    start = time.time()
    RLTrainer(load_config(None, overrides), overwrite=True).fit()
    wall = time.time() - start
    rows = [json.loads(line) for line in (Path(args.out) / "metrics.jsonl").read_text().splitlines()]
    for m in rows:
        shown = {k: round(v, 3) for k, v in m.items()
                 if k.startswith("val-core/") or k in ("critic/score/mean", "agent/tool_calls_mean",
                                                                   "agent/turns_mean", "timing/step")}  # fmt: skip
        if shown:
            print(m.get("step"), shown, flush=True)
    print(f"{args.mode}: {args.steps} steps in {wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
