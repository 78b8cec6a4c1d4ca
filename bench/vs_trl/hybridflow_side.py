"""hybridflow's side: RLTrainer (GRPO, native model and engine) on the spec; OUT/steps.jsonl."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import compile_log  # noqa: E402
from spec import Spec, peak_memory_gib, score, write_step  # noqa: E402

from hybridflow.config import load_config  # noqa: E402
from hybridflow.controller.trainer import RLTrainer  # noqa: E402


def main() -> None:
    spec = Spec.load(sys.argv[1])
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        f"model.path={spec.model_dir}",
        "model.impl=native",
        f"data.train_files=[{spec.data_file}]",
        "data.val_files=[]",
        f"data.prompts_per_step={spec.prompts_per_step}",
        f"data.max_prompt_tokens={spec.max_prompt_tokens}",
        f"data.max_response_tokens={spec.max_response_tokens}",
        f"rollout.samples_per_prompt={spec.samples_per_prompt}",
        f"rollout.temperature={spec.temperature}",
        # TRL generates the step's sequences in one `generate` call: ours decode them together too
        f"rollout.max_batch_sequences={spec.prompts_per_step * spec.samples_per_prompt}",
        "algorithm.adv_estimator=grpo",
        "actor.loss_agg_mode=token-mean",  # TRL's loss_type="dapo": tokens of the whole step
        # the tokens TRL's micro-batch of padded sequences holds at full length: the same worst-case
        # memory, filled with packed sequences instead of padding
        f"actor.max_tokens_per_microbatch={spec.sequences_per_microbatch * (spec.max_prompt_tokens + spec.max_response_tokens)}",
        f"actor.optim.lr={spec.lr}",
        f"actor.optim.weight_decay={spec.weight_decay}",
        "actor.optim.lr_scheduler=constant",
        "actor.optim.warmup_steps=0",
        f"trainer.total_training_steps={spec.steps}",
        f"trainer.seed={spec.seed}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        "trainer.progress=false",
        f"trainer.run_dir={out / 'run'}",
        *spec.hybridflow_overrides,
    ]

    def reward(data_source, solution_str, ground_truth, extra_info=None):  # the TRL side's scorer too
        return score(spec.reward, solution_str, ground_truth)

    # each Triton compile logged with the step it fell in (steps.jsonl gets a line as a step ends)
    compile_log.install(out / "triton_compiles.jsonl", compile_log.step_of(out / "steps.jsonl"))
    trainer = RLTrainer(load_config(None, overrides), overwrite=True, reward_function=reward)
    trainer.run_dir.mkdir(parents=True, exist_ok=True)  # fit() would; the steps are driven here
    for step in range(1, trainer.total_steps + 1):
        trainer.step = step
        m = trainer.train_step()
        gen = m["timing_s/gen"]
        write_step(out, {
            "step": step, "wall_s": m["timing_s/step"], "gen_s": gen, "update_s": m["timing_s/step"] - gen,
            "tokens": m["perf/total_num_tokens"], "response_tokens": m["response_length/mean"] * m["rollout/responses"],
            "reward_mean": m["critic/score/mean"],
            # the trainer resets the peak per phase: its own per-step maximum over the phases
            "peak_memory_gib": m.get("perf/max_memory_allocated_gb", peak_memory_gib(spec.device)),
            "phases_s": {k[len("timing_s/"):]: v for k, v in m.items() if k.startswith("timing_s/")},
        })  # fmt: skip
    trainer.placement.shutdown()


if __name__ == "__main__":
    main()
