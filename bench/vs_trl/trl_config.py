"""TRL's GRPOConfig matched to hybridflow's GRPO step, for both TRL-side scripts (TRL's environment):
one generation of prompts x samples and one optimizer update per step (gradient accumulation over
micro-batches), constant learning rate, AdamW with grad clip 1, clip 0.2, the step's token mean
(TRL's "dapo" loss = our token-mean), advantages scaled by the group's std, temperature / top-p 1
/ top-k 0, fp32 master weights under bf16 autocast on a GPU."""

from __future__ import annotations

from pathlib import Path

from trl import GRPOConfig


def matched_grpo_config(
    out: Path, *, prompts: int, samples: int, micro: int, response: int, lr: float, steps: int,
    weight_decay: float = 0.01, beta: float = 0.0, temperature: float = 1.0, seed: int = 0,
    cuda: bool, gradient_checkpointing: bool = False,
) -> GRPOConfig:  # fmt: skip
    sequences = prompts * samples
    micro = min(micro, sequences)
    if sequences % micro:
        raise SystemExit(f"prompts x samples ({sequences}) must be a multiple of the micro-batch ({micro})")
    return GRPOConfig(
        output_dir=str(out / "run"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=sequences // micro,  # = steps_per_generation: one generation per step
        num_generations=samples,
        max_completion_length=response,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=weight_decay,
        max_grad_norm=1.0,
        gradient_checkpointing=gradient_checkpointing,
        beta=beta,  # KL loss with TRL's k3 estimator: our low_var_kl at kl_loss_coef
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        bf16=cuda,
        use_cpu=not cuda,
        disable_tqdm=True,
    )
