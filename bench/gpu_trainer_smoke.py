"""Run the RL trainer on one GPU: a ~25M-parameter random Qwen2-shaped model learns the synthetic
'share of letter a' reward with GRPO in bf16 autocast. Prints per-step timings and the curve.

    PYTHONPATH=. python bench/gpu_trainer_smoke.py OUT_DIR [config overrides, e.g. algorithm.adv_estimator=gae]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from hybridflow.config import load_config
from hybridflow.controller.trainer import RLTrainer
from hybridflow.models import byte_tokenizer, save_hf, tiny_model

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return solution_str.count('a') / max(len(solution_str), 1)\n"


def main(out: Path, overrides: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(
        "qwen2",
        seed=0,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    print(f"model parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M", flush=True)
    save_hf(model, byte_tokenizer(), out / "model", overwrite=True)
    (out / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"question {i}", "data_source": "synthetic"}) for i in range(512))
    )
    (out / "reward.py").write_text(REWARD)
    config = load_config(
        None,
        [
            f"model.path={out / 'model'}",
            f"data.train_files=[{out / 'prompts.jsonl'}]",
            "data.prompts_per_step=32",
            "data.max_response_tokens=64",
            "rollout.samples_per_prompt=8",
            "actor.optim.lr=3e-4",
            f"reward.custom_function_path={out / 'reward.py'}",
            "trainer.total_training_steps=15",
            "trainer.logger=[console,jsonl]",
            f"trainer.run_dir={out / 'run'}",
            *overrides,
        ],
    )
    start = time.perf_counter()
    RLTrainer(config, overwrite=True).fit()
    print(
        f"device {torch.cuda.get_device_name()} total {time.perf_counter() - start:.1f} s, peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
