"""TRL's side: GRPOTrainer on the spec, in TRL's own environment; OUT/steps.jsonl.

One generation of prompts_per_step x samples_per_prompt completions and one optimizer step per step
(gradient accumulation over micro-batches of sequences_per_microbatch), KL off (beta 0, TRL's
default), loss_type "dapo" (the step's token mean, our token-mean), rewards scaled per group (our
GRPO), clip 0.2, constant learning rate, the same AdamW settings, no gradient checkpointing unless
asked (TRL's default has it on; hybridflow's side has it off). Generation by transformers'
`generate` (vLLM, TRL's faster path, is not available on the benchmark machines)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))  # hybridflow's scorers
from spec import Spec, peak_memory_gib, score, write_step  # noqa: E402
from trl_config import matched_grpo_config  # noqa: E402


class TimedGRPOTrainer(GRPOTrainer):
    """Records the time spent generating (and scoring) each step's completions."""

    generation_s = 0.0

    def _generate_and_score_completions(self, inputs):
        start = time.perf_counter()
        result = super()._generate_and_score_completions(inputs)
        self.generation_s += time.perf_counter() - start
        return result


class StepRecorder(TrainerCallback):
    def __init__(self, spec: Spec, out: Path) -> None:
        self.spec, self.out, self.tokens_seen, self.started = spec, out, 0, 0.0
        self.trainer: TimedGRPOTrainer | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started, self.trainer.generation_s = time.perf_counter(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self.wall = time.perf_counter() - self.started

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs:
            return
        tokens = logs["num_tokens"] - self.tokens_seen
        self.tokens_seen = logs["num_tokens"]
        responses = self.spec.prompts_per_step * self.spec.samples_per_prompt
        gen = self.trainer.generation_s
        write_step(self.out, {
            "step": state.global_step, "wall_s": self.wall, "gen_s": gen, "update_s": self.wall - gen,
            "tokens": tokens, "response_tokens": logs["completions/mean_length"] * responses,
            "reward_mean": logs["reward"], "peak_memory_gib": peak_memory_gib(self.spec.device),
        })  # fmt: skip


def main() -> None:
    spec = Spec.load(sys.argv[1])
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    args = matched_grpo_config(
        out, prompts=spec.prompts_per_step, samples=spec.samples_per_prompt, micro=spec.sequences_per_microbatch,
        response=spec.max_response_tokens, lr=spec.lr, steps=spec.steps, weight_decay=spec.weight_decay,
        beta=0.0, temperature=spec.temperature, seed=spec.seed, cuda=spec.device == "cuda",
        gradient_checkpointing=spec.trl_gradient_checkpointing,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir)

    def reward(prompts, completions, reward_model, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            score(spec.reward, t, r.get("ground_truth") if r else None) for t, r in zip(texts, reward_model)
        ]

    dataset = load_dataset("json", data_files=spec.data_file, split="train")
    recorder = StepRecorder(spec, out)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[recorder])  # fmt: skip
    recorder.trainer = trainer
    trainer.train()


if __name__ == "__main__":
    main()
