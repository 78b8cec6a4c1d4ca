"""GRPO with the hybrid engine on 1 or 2 GPUs: actor, reference and the native rollout engine
colocated on every GPU, FSDP2 over all of them, weights synced into each engine in place.

    PYTHONPATH=. python bench/distributed_grpo.py OUT --shape 0.5b --gpus 2    # nvidia-h200-x2

A random-weight Qwen2.5-shaped model (bench/rollout.py's shapes, saved in bf16 and trained from an
fp32 master) with the 259-token byte tokenizer, prompts of 100-300 random letters, the synthetic
"share of letter a" reward, KL loss against the reference. The same global batch on 1 and 2 GPUs,
so step time gives the scaling efficiency. Prints each step's phase timings and peak memory, and a
JSON summary (steps after the first: the first step compiles kernels and captures graphs).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout import hf_config  # noqa: E402

from hybridflow.config import load_config  # noqa: E402
from hybridflow.controller.trainer import RLTrainer  # noqa: E402
from hybridflow.models import byte_tokenizer, save_hf  # noqa: E402

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return solution_str.count('a') / max(len(solution_str), 1)\n"


def _model_dir(out: Path, shape: str) -> Path:
    path = out / f"model-{shape}"
    if not (path / "config.json").is_file():
        from transformers import AutoModelForCausalLM

        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.bfloat16)
        save_hf(model.cpu(), byte_tokenizer(), path, overwrite=True)
    return path


def show(m: dict) -> None:
    phases = {k[len("timing_s/") :]: round(v, 2) for k, v in m.items() if k.startswith("timing_s/")}
    memory = {
        k.rsplit("/", 1)[-1]: round(v, 1)
        for k, v in m.items()
        if k.startswith("perf/max_memory_allocated_gb/")
    }
    parity = {k.rsplit("/", 1)[-1]: v for k, v in m.items() if k.startswith("training/rollout_probs_diff_m")}
    print(json.dumps({"step": m["step"], "timing_s": phases, "peak_gib": memory, **parity}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b", "7b"])
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument(
        "--no-save",
        action="store_true",
        help="no checkpoint at the end (a 7B one is ~120 GB of fp32 weights and Adam state)",
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [
        {
            "prompt": "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(100, 300))),
            "data_source": "synthetic",
        }
        for _ in range(args.prompts * args.steps)
    ]
    (args.out / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts))
    (args.out / "reward.py").write_text(REWARD)
    run = args.out / f"run-{args.shape}-{args.gpus}gpu"
    config = load_config(
        None,
        [
            f"model.path={_model_dir(args.out, args.shape)}",
            f"data.train_files=[{args.out / 'prompts.jsonl'}]",
            f"data.prompts_per_step={args.prompts}",
            f"data.max_response_tokens={args.response}",
            "data.max_prompt_tokens=512",
            "data.shuffle=false",
            f"rollout.samples_per_prompt={args.n}",
            "actor.optim.lr=1e-6",
            "actor.use_kl_loss=true",
            f"reward.custom_function_path={args.out / 'reward.py'}",
            f"trainer.total_training_steps={args.steps}",
            "trainer.save_freq=-1",
            "trainer.logger=[console,jsonl]",
            f"trainer.run_dir={run}",
            f"trainer.n_gpus_per_node={args.gpus}",
            "resources.worker_timeout_s=240",  # a stuck collective stops the run with the workers' stacks
            *args.overrides,
        ],
    )
    start = time.perf_counter()
    trainer = RLTrainer(config, overwrite=True)
    setup_s = time.perf_counter() - start
    if args.no_save:  # the steps without fit()'s final checkpoint
        steps = []
        for step in range(1, trainer.total_steps + 1):
            trainer.step = step
            steps.append({"step": trainer.step, **trainer.train_step()})
            show(steps[-1])
        trainer.placement.shutdown()
    else:
        trainer.fit()
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if not args.no_save:
        for m in steps:
            show(m)
    later = steps[1:] or steps
    keys = sorted({k for m in later for k in m if k.startswith(("timing_s/", "perf/"))})
    summary = {k: sum(m.get(k, 0.0) for m in later) / len(later) for k in keys}
    print(json.dumps({"shape": args.shape, "gpus": args.gpus, "setup_s": setup_s, "sequences_per_step": args.prompts * args.n,
                      "response_tokens": args.response, "mean_over_steps_after_the_first": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
