"""Sample generations for people to read: every trainer.log_samples_freq steps, a few responses
(each from a different prompt) with their scores and advantages, appended to RUN_DIR/samples.jsonl
and shown by the sinks that draw tables (TensorBoard text, a W&B table) and by the run report."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridflow.batch import Rollouts


def sample_rows(
    step: int,
    rollouts: Rollouts,
    scores: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tokenizer,
    count: int,
) -> list[dict]:
    """`count` sequences, the first of each prompt group first. scores [B]; advantages, mask [B, T]."""
    firsts = set({g: i for i, g in reversed(list(enumerate(rollouts.group_ids)))}.values())
    order = sorted(firsts) + [i for i in range(len(rollouts)) if i not in firsts]
    mean_advantage = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
    rows = []
    for i in order[:count]:
        prompt = rollouts.prompts[i]
        rows.append(
            {
                "step": step,
                "data_source": prompt.data_source,
                # an agent's episode starts from its own rendering (tools in the system turn, say)
                "prompt": (prompt.text if rollouts.agent_stats is None else "")
                or tokenizer.decode(rollouts.prompt_ids[i]),
                "response": tokenizer.decode(rollouts.response_ids[i], skip_special_tokens=True),
                "score": round(float(scores[i]), 4),
                "advantage": round(float(mean_advantage[i]), 4),
                "response_length": len(rollouts.response_ids[i]),
                "finish_reason": rollouts.finish_reasons[i],
            }
        )
    return rows


def val_sample_rows(step: int, samples: list[dict], prompts: list, tokenizer, count: int) -> list[dict]:
    """The first `count` of a validation's responses (controller/validation.py's samples), in prompt
    order, with their prompts' text."""
    by_index = {p.index: p for p in prompts}
    rows = []
    for sample in samples[:count]:
        prompt = by_index[sample["prompt_index"]]
        rows.append(
            {
                "step": step,
                "data_source": prompt.data_source,
                "prompt": prompt.text or tokenizer.decode(prompt.token_ids),
                "response": tokenizer.decode(sample["response_ids"], skip_special_tokens=True),
                "score": round(sample["score"], 4),
                "pred": sample["pred"],
            }
        )
    return rows


def append_samples(path: Path, rows: list[dict]) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
