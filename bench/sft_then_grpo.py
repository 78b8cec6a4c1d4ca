"""From random weights to arithmetic: SFT on worked solutions, then GRPO on the reward — and DPO on
pairs of the SFT model's own right and wrong answers — all through hybridflow's trainers.

    PYTHONPATH=. python bench/sft_then_grpo.py OUT                  # one H200 (nvidia-h200)
    PYTHONPATH=. python bench/sft_then_grpo.py OUT --scale smoke    # CPU, about a minute: the pipeline only
    ... --stages grpo,dpo --grpo actor.optim.lr=3e-6                # again from OUT's SFT run

1. a Qwen2-shaped model with random weights and the 259-token byte tokenizer;
2. `SFTTrainer` on the built-in arithmetic task's worked solutions, 60% of which stop a step early
   (recipe arithmetic_sft);
3. `RLTrainer` (GRPO) from the SFT checkpoint's policy export, validating greedily on the held-out
   problems every trainer.test_freq steps (step 0 = the SFT model);
4. `DPOTrainer` from the same SFT policy on pairs (correct vs wrong) sampled from it on the training
   prompts.
The three policies (SFT, GRPO, DPO) are scored the same way: greedy answers on the held-out problems,
by the native engine. OUT/summary.json holds accuracies, curves and wall times; OUT/report.html the
runs' curves.

Result (one H200, 2026-11-30, docs/benchmarks.md "SFT then GRPO from scratch"): SFT 2.0% -> GRPO 75.0%
(150 steps) and DPO 67.6% held-out greedy accuracy; SFT 165 s, GRPO 231 s, DPO 123 s. The SFT data come
from a flawed teacher (TASK below): on clean worked solutions GRPO and DPO add a point at most.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from hybridflow.checkpoint import latest_checkpoint
from hybridflow.config import load_config
from hybridflow.controller.trainer import RLTrainer
from hybridflow.data.prompts import load_prompts
from hybridflow.data.tasks import use_task_files
from hybridflow.devices import resolve_device
from hybridflow.engine import Engine, EngineConfig
from hybridflow.models import byte_tokenizer, load_causal_lm, save_hf, tiny_config
from hybridflow.offline.dpo import DPOTrainer
from hybridflow.offline.sft import SFTTrainer
from hybridflow.rewards.scorers import arithmetic as score_arithmetic
from hybridflow.rollout.sampling import SamplingParams

# three operands of up to two digits, + and -, solved in two written steps ("47 + 83 = 130",
# "130 - 20 = 110", "#### 110") -- by a flawed teacher: 60% of its worked solutions stop after the first
# step and answer with its value. The SFT model learns to stop early too; only the reward says it is wrong.
TASK = {"min_operands": 3, "max_operands": 3, "max_digits": 2, "operators": "+-", "stop_early_fraction": 0.6,
        "train_size": 20000, "test_size": 500, "seed": 0}  # fmt: skip

SCALES = {
    # ~29M parameters; every stage on one H200
    "h200": dict(
        model=dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4),
        sft=["sft.batch_size=64", "trainer.total_training_steps=2500", "actor.optim.lr=1e-3",
             "actor.optim.warmup_steps=30", "trainer.test_freq=500"],
        # 2,048 samples a step at temperature 1
        grpo=["data.prompts_per_step=256", "rollout.samples_per_prompt=8", "rollout.temperature=1.0",
              "rollout.max_batch_sequences=2048", "rollout.kv_cache_tokens=600000",
              "actor.max_tokens_per_microbatch=65536", "actor.optim.lr=2e-5", "actor.optim.warmup_steps=20",
              "trainer.total_training_steps=150", "trainer.test_freq=10"],
        dpo=["preference.batch_size=64", "actor.optim.lr=1e-5", "preference.beta=0.1", "preference.rpo_alpha=1.0",
             "trainer.total_epochs=2"],
        pair_prompts=8000,
    ),
    # the pipeline end to end on a CPU in about a minute (learns little)
    "smoke": dict(
        model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2),
        sft=["sft.batch_size=16", "trainer.total_training_steps=20", "actor.optim.lr=1e-3",
             "trainer.test_freq=10"],
        grpo=["data.prompts_per_step=8", "rollout.samples_per_prompt=4", "trainer.total_training_steps=4",
              "actor.optim.lr=1e-5", "trainer.test_freq=2", "data.max_val_prompts=32"],
        dpo=["preference.batch_size=8", "actor.optim.lr=1e-5", "trainer.total_training_steps=3"],
        pair_prompts=64,
    ),
}  # fmt: skip


def common(out: Path, model_path: Path, stage: str, extra: list[str]) -> list[str]:
    return [
        f"model.path={model_path}",
        f"model.cache_dir={out / 'cache'}",
        "data.task=arithmetic",
        *(f"data.task_options.{k}={v}" for k, v in TASK.items()),
        "data.max_prompt_tokens=160",
        "data.max_response_tokens=64",
        f"trainer.run_dir={out / stage}",
        "trainer.logger=[console,jsonl]",
        "trainer.progress=false",
        *extra,
    ]


def random_model(out: Path, shape: dict) -> Path:
    from transformers import AutoModelForCausalLM

    path = out / "model-init"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", max_position_embeddings=512, **shape))
    save_hf(model, byte_tokenizer(), path, overwrite=True)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    return path


def policy_of(run_dir: Path) -> Path:
    """The transformers export in the run's latest checkpoint."""
    return latest_checkpoint(run_dir) / "policy"


def sample(policy: Path, prompts, params: SamplingParams, device: torch.device) -> list[list[str]]:
    """`params.n` responses per prompt from the native engine, as text."""
    model, tokenizer = load_causal_lm(str(policy), impl="native")
    engine = Engine(model.to(device), eos_token_ids=[tokenizer.eos_token_id],
                    config=EngineConfig(max_context_tokens=512, gpu_memory_utilization=0.1))  # fmt: skip
    generations = engine.generate([p.token_ids for p in prompts], params)
    texts: list[list[str]] = [[] for _ in prompts]
    for g in generations:
        texts[g.prompt_index].append(tokenizer.decode(g.token_ids, skip_special_tokens=True))
    del engine, model
    return texts


def all_steps_written(response: str) -> bool:
    """Both steps written ('47 + 83 = 130', '130 - 20 = 110'), not stopped after the first."""
    return sum("=" in line for line in response.split("####")[0].splitlines()) > 1


def greedy_accuracy(policy: Path, prompts, device: torch.device, styles: dict) -> float:
    """Held-out accuracy of greedy answers; `styles` gets how often they write all steps or stop early,
    and the accuracy of each."""
    params = SamplingParams(n=1, temperature=0.0, max_tokens=64)
    texts = [t[0] for t in sample(policy, prompts, params, device)]
    right = [score_arithmetic(t, p.ground_truth)["score"] for p, t in zip(prompts, texts)]
    finished = [all_steps_written(t) for t in texts]
    for name, chosen in (("all_steps", finished), ("stopped_early", [not f for f in finished])):
        count = sum(chosen)
        styles[f"{name}_fraction"] = count / len(texts)
        styles[f"{name}_accuracy"] = sum(r for r, c in zip(right, chosen) if c) / count if count else None
    return sum(right) / len(prompts)


def preference_pairs(policy: Path, prompts, device: torch.device, path: Path) -> dict[str, float]:
    """Eight samples per prompt at temperature 1; each prompt with a right and a wrong answer gives
    one pair (a random right one chosen, a random wrong one rejected)."""
    params = SamplingParams(n=8, temperature=1.0, max_tokens=64, seed=0)
    texts = sample(policy, prompts, params, device)
    rng, rows, right = random.Random(0), [], 0
    for p, responses in zip(prompts, texts):
        by_score = defaultdict(list)
        for r in responses:
            by_score[score_arithmetic(r, p.ground_truth)["score"] == 1.0].append(r)
        right += len(by_score[True])
        if by_score[True] and by_score[False]:
            rows.append({"prompt": p.messages, "chosen": rng.choice(by_score[True]),
                         "rejected": rng.choice(by_score[False])})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"pairs": len(rows), "sample_accuracy": right / (8 * len(prompts))}


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    key = "val-core/arithmetic/acc/mean@1"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def grpo_overrides(scale: dict) -> list[str]:
    return ["model.impl=native", "algorithm.adv_estimator=grpo", "trainer.val_before_train=true",
            "actor.optim.warmup_steps=5", *scale["grpo"]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--scale", default="h200", choices=sorted(SCALES))
    parser.add_argument("--stages", default="sft,grpo,dpo",
                        help="stages to run (comma-separated); a stage left out reuses its run in OUT")  # fmt: skip
    for stage in ("model", "sft", "grpo", "dpo"):
        parser.add_argument(f"--{stage}", nargs="+", default=[], metavar="KEY=VALUE",
                            help=f"overrides of the {stage} stage's settings")  # fmt: skip
    args = parser.parse_args()
    out, scale, stages = args.out, SCALES[args.scale], args.stages.split(",")
    scale = {**scale, "model": {**scale["model"], **{k: int(v) for k, v in (o.split("=") for o in args.model)}},
             **{stage: scale[stage] + getattr(args, stage) for stage in ("sft", "grpo", "dpo")}}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary |= {"scale": args.scale, "task": TASK, "settings": scale}
    accuracy, times = summary.setdefault("greedy_accuracy", {}), summary.setdefault("wall_s", {})
    styles = summary.setdefault("greedy_styles", {})
    grpo_config = load_config(None, common(out, out / "model-init", "grpo", grpo_overrides(scale)))
    use_task_files(grpo_config)
    device = resolve_device(grpo_config.resources.device)
    test = load_prompts(grpo_config.data.val_files, byte_tokenizer(), grpo_config.data)
    summary["held_out_prompts"] = len(test)

    if "sft" in stages:
        t = time.perf_counter()
        init = random_model(out, scale["model"])
        SFTTrainer(
            load_config("arithmetic_sft", common(out, init, "sft", scale["sft"])), overwrite=True
        ).fit()
        times["sft"] = time.perf_counter() - t
        accuracy["sft"] = greedy_accuracy(policy_of(out / "sft"), test, device, styles.setdefault("sft", {}))
    sft_policy = policy_of(out / "sft")

    if "grpo" in stages:
        t = time.perf_counter()
        RLTrainer(
            load_config(None, common(out, sft_policy, "grpo", grpo_overrides(scale))), overwrite=True
        ).fit()
        times["grpo"] = time.perf_counter() - t
        accuracy["grpo"] = greedy_accuracy(
            policy_of(out / "grpo"), test, device, styles.setdefault("grpo", {})
        )
        summary["grpo_val_curve"] = val_curve(out / "grpo")

    if "dpo" in stages:
        t = time.perf_counter()
        train = load_prompts(grpo_config.data.train_files, byte_tokenizer(), grpo_config.data)
        pairs = out / "pairs.jsonl"
        summary["dpo_data"] = preference_pairs(sft_policy, train[: scale["pair_prompts"]], device, pairs)
        if summary["dpo_data"]["pairs"]:
            dpo_config = load_config(None, common(out, sft_policy, "dpo", [
                f"data.train_files=[{pairs}]", "data.val_files=[]", *scale["dpo"]]))  # fmt: skip
            DPOTrainer(dpo_config, overwrite=True).fit()
            accuracy["dpo"] = greedy_accuracy(
                policy_of(out / "dpo"), test, device, styles.setdefault("dpo", {})
            )
        else:
            print("DPO skipped: the SFT model's samples are all right or all wrong, so there are no pairs")
        times["dpo"] = time.perf_counter() - t

    if "sft" in accuracy and "grpo" in accuracy:
        summary["gain_grpo_over_sft"] = accuracy["grpo"] - accuracy["sft"]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        from hybridflow.report import write_report

        runs = [out / stage for stage in ("sft", "grpo", "dpo") if (out / stage / "metrics.jsonl").is_file()]
        write_report(runs, out / "report.html")
    except Exception as e:  # the numbers above are the result; a figure that fails must not hide them
        print(f"report not written ({type(e).__name__}: {e})")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
