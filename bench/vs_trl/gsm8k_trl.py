"""TRL's side of the GSM8K learning run (issue #32), in TRL's own environment: GRPOTrainer with
bench/real_gsm8k.py's settings, held-out greedy accuracy before training and every N steps under the
same strict and lenient scorers, against training seconds (evaluation excluded, as on our side);
OUT/gsm8k_curve.json in real_gsm8k.py's format.

Matched: the model, the preprocessed prompts (chat messages, verl's instruction), samples per
prompt, response length, temperature 1 (top-p 1, top-k 0), one generation and one optimizer update
per step, learning rate (constant), AdamW (weight decay 0.01, grad clip 1), clip 0.2, the KL loss
(TRL's beta with its k3 estimator = our low_var_kl at kl_loss_coef), the step's token mean (TRL's
"dapo" loss = our token-mean), advantages scaled by the group's std, fp32 master weights under bf16
autocast on a GPU. The reward trains on verl's strict score, as ours. TRL generates with
transformers' generate (vLLM is not on the benchmark machines).

    .venv-trl/bin/python bench/vs_trl/gsm8k_trl.py --model DIR --train T.jsonl --test H.jsonl --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

sys.path.insert(0, str(Path(__file__).parents[2]))  # hybridflow's scorers
sys.path.insert(0, str(Path(__file__).parent))
from trl_config import matched_grpo_config  # noqa: E402

from hybridflow.rewards.scorers import compute_score  # noqa: E402


def strict(text: str, truth: str) -> float:
    return compute_score("openai/gsm8k", text, truth)["score"]


def lenient(text: str, truth: str) -> float:
    return compute_score("gsm8k_math_verify", text, truth)["score"]


class HeldOut(TrainerCallback):
    """Greedy accuracy on the held-out rows before training and every `freq` steps; the steps' own
    seconds (generation and update), evaluation left out."""

    def __init__(
        self, rows: list[dict], tokenizer, freq: int, max_tokens: int, out: Path, batch: int, budget_s: float
    ) -> None:
        self.rows, self.tokenizer, self.freq, self.max_tokens, self.out = (
            rows,
            tokenizer,
            freq,
            max_tokens,
            out,
        )
        self.batch, self.budget_s = batch, budget_s
        self.train_s, self.points, self.trainer, self.started = 0.0, [], None, 0.0

    def evaluate(self, step: int) -> None:
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        model.eval()
        tok = self.tokenizer
        tok.padding_side = "left"
        texts = [
            tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
            for r in self.rows
        ]
        right = {"strict": 0.0, "lenient": 0.0}
        for i in range(0, len(texts), self.batch):
            batch = tok(
                texts[i : i + self.batch], return_tensors="pt", padding=True, add_special_tokens=False
            )
            batch = batch.to(model.device)
            with (
                torch.no_grad(),
                torch.autocast(model.device.type, torch.bfloat16, enabled=model.device.type == "cuda"),
            ):
                out = model.generate(**batch, do_sample=False, max_new_tokens=self.max_tokens)
            for row, ids in zip(self.rows[i : i + self.batch], out[:, batch["input_ids"].shape[1] :]):
                text = tok.decode(ids, skip_special_tokens=True)
                truth = row["reward_model"]["ground_truth"]
                right["strict"] += strict(text, truth)
                right["lenient"] += lenient(text, truth)
        model.train(was_training)
        n = len(self.rows)
        point = {"step": step, "train_s": round(self.train_s, 1), "strict": right["strict"] / n,
                 "lenient": right["lenient"] / n}  # fmt: skip
        self.points.append(point)
        print(json.dumps(point), flush=True)

    def on_train_begin(self, args, state, control, **kwargs):
        self.evaluate(0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.train_s += time.perf_counter() - self.started
        if self.budget_s and self.train_s >= self.budget_s:  # the wall-clock budget of the comparison
            control.should_training_stop = True
        if (
            state.global_step % self.freq == 0
            or state.global_step == state.max_steps
            or control.should_training_stop
        ):
            self.evaluate(state.global_step)
            (self.out / "held_out.jsonl").write_text("".join(json.dumps(p) + "\n" for p in self.points))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--train", required=True, help="jsonl rows: prompt (messages), reward_model.ground_truth")
    ap.add_argument("--test", required=True, help="the held-out rows, same schema")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--test-freq", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--kl", type=float, default=0.001, help="TRL's beta: our actor.kl_loss_coef")
    ap.add_argument("--micro", type=int, default=32, help="sequences per forward (gradient accumulation)")
    ap.add_argument(
        "--eval-batch", type=int, default=0, help="held-out prompts per generate (0: 64 on CPU, all on a GPU)"
    )
    ap.add_argument(
        "--budget-s", type=float, default=0, help="stop once training took this many seconds (0: --steps)"
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    config = matched_grpo_config(
        args.out, prompts=args.prompts, samples=args.samples, micro=args.micro, response=args.response,
        lr=args.lr, steps=args.steps, beta=args.kl, cuda=cuda,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def reward(prompts, completions, reward_model, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [strict(t, r["ground_truth"]) for t, r in zip(texts, reward_model)]

    held_out = [json.loads(line) for line in Path(args.test).read_text().splitlines()]
    eval_batch = args.eval_batch or (len(held_out) if cuda else 64)
    callback = HeldOut(
        held_out, tokenizer, args.test_freq, args.response, args.out, eval_batch, args.budget_s
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=load_dataset("json", data_files=args.train, split="train"),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    summary = {"model": args.model, "framework": "trl", "algo": "grpo", "wall_s": round(time.perf_counter() - start, 1),
               "held_out": callback.points}  # fmt: skip
    (args.out / "gsm8k_curve.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
