"""The one GRPO configuration both sides run, and the per-step record both write.

Stdlib only (plus hybridflow's scorers), so the TRL side imports it from its own environment."""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Spec:
    model_dir: str
    data_file: str  # jsonl: prompt (chat messages), data_source, reward_model.ground_truth
    out: str
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_prompt_tokens: int
    max_response_tokens: int
    lr: float
    temperature: float = 1.0
    weight_decay: float = 0.01
    seed: int = 0
    reward: str = "arithmetic"  # or "letter_a": the share of 'a' in the response (random-weight models)
    device: str = "cpu"
    sequences_per_microbatch: int = 64  # TRL's per-device batch (gradient accumulation up to one step)
    trl_gradient_checkpointing: bool = False  # TRL's default is on; hybridflow's side runs without
    hybridflow_overrides: list[str] = field(default_factory=list)  # e.g. model.compile=true

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Spec:
        return cls(**json.loads(Path(path).read_text()))


def score(reward: str, response: str, ground_truth: str | None) -> float:
    if reward == "letter_a":
        return response.count("a") / max(len(response), 1)
    from hybridflow.rewards.scorers import arithmetic

    return arithmetic(response, ground_truth)["score"]


def peak_memory_gib(device: str) -> float:
    """The accelerator's peak allocation, or on a CPU the process's peak resident memory."""
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


def write_step(out: Path, record: dict) -> None:
    """One line of OUT/steps.jsonl: step, wall_s, gen_s, update_s, tokens, response_tokens,
    reward_mean, peak_memory_gib."""
    with (out / "steps.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
