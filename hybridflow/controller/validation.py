"""Validation: generate on held-out prompts, score, and report accuracy per data source."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from hybridflow.batch import Prompt, Rollouts
from hybridflow.controller.metrics import accuracy_at_n
from hybridflow.rollout.sampling import SamplingParams


def validate(
    generate: Callable[[list[Prompt], SamplingParams], Rollouts],
    reward,
    prompts: list[Prompt],
    params: SamplingParams,
) -> tuple[dict[str, float], list[dict]]:
    """val-core/{data_source}/acc/{mean@N,best@N,maj@N} (N = params.n) of the reward function's `acc`
    when it returns one, else val-core/{data_source}/reward/... of its score, and
    val-aux/{data_source}/{key}/mean@N of each further number it returns (verl's naming), and
    per-response samples. `generate(prompts, params)` samples (over all rollout workers)."""
    rollouts = generate(prompts, params)
    result = reward.score(rollouts)
    per_prompt: dict[int, list[int]] = defaultdict(list)
    for i, g in enumerate(rollouts.group_ids):
        per_prompt[g].append(i)
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    counts: dict[str, int] = defaultdict(int)
    for rows in per_prompt.values():
        source = rollouts.prompts[rows[0]].data_source
        acc = accuracy_at_n([result.accs[i].item() for i in rows], [result.preds[i] for i in rows], params.n)
        for k, v in acc.items():
            sums[source][k] += v
        counts[source] += 1
    name = "acc" if result.acc_given else "reward"
    metrics = {
        f"val-core/{src}/{name}/{k}": v / counts[src] for src, accs in sums.items() for k, v in accs.items()
    }
    for key, values in result.extras.items():  # e.g. a lenient check beside the strict one
        aux: dict[str, float] = defaultdict(float)
        for rows in per_prompt.values():
            aux[rollouts.prompts[rows[0]].data_source] += values[rows].mean().item()
        metrics |= {f"val-aux/{src}/{key}/mean@{params.n}": v / counts[src] for src, v in aux.items()}
    samples = [
        {
            "prompt_index": rollouts.prompts[i].index,
            "response_ids": rollouts.response_ids[i],
            "score": result.raw_scores[i].item(),
            "pred": result.preds[i],
        }
        for i in range(len(rollouts))
    ]
    return metrics, samples
