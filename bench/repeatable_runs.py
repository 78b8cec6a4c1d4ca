"""Do two runs with one config and seed, started as separate processes, give the same weights on a GPU?

A random Qwen2 of the 0.5B (or --shape 1.5b) shape (byte tokenizer), GRPO for --steps steps on CUDA, synchronous
(async_mode=off) and streaming (the engine pausing for training, one update stale); each mode twice.
With --deterministic both runs set trainer.deterministic; with --exact, rollout.exact_logprobs (and
--baseline adds one ordinary run per mode: its step time and gaps beside them, in the same lease). Reports, per mode: metrics equal (clock figures aside), the first step and metric that differ, the
largest weight difference after the last step, the rollout/trainer log-prob gap of each step, each
step's seconds by phase, and the Triton compiles that fell inside the steps after the first
(bench/compile_log.py: a compile there is a one-off the step's time carries).

    python bench/repeatable_runs.py --out results.json [--steps 10] [--shape 1.5b] [--runs 1]

(--runs 1: one run a mode, its gaps and step time, no comparison.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import compile_log
import torch
from safetensors.torch import load_file

from hybridflow.models import byte_tokenizer, save_hf, tiny_model

SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}  # fmt: skip
CLOCKS = ("timing_s/", "timing_per_token_ms/", "perf/", "reward/latency")
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return solution_str.count('a') / max(len(solution_str), 1)\n"
)
MODES = {
    "synchronous": ["trainer.async_mode=off"],
    "streaming": ["trainer.async_mode=streaming", "rollout.max_staleness=1"],
}


def _run(root: Path, name: str, steps: int, mode: list[str], device: str, deterministic: bool, extra=()):
    run_dir = root / name
    # (through bench/compile_log.py: each Triton compile logged with the step it fell in)
    compiles = root / f"{name}.compiles.jsonl"
    command = [sys.executable, str(Path(__file__).parent / "compile_log.py"), str(compiles), str(run_dir), "train",
               f"model.path={root / 'model'}", f"data.train_files=[{root / 'prompts.jsonl'}]",
               "data.prompts_per_step=16", "data.max_response_tokens=256", "rollout.samples_per_prompt=8",
               "actor.optim.lr=1e-5", f"reward.custom_function_path={root / 'reward.py'}", "reward.num_workers=0",
               f"resources.device={device}", f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}",
               "trainer.logger=[jsonl]", f"trainer.run_dir={run_dir}", f"trainer.deterministic={deterministic}",
               *mode, *extra, "--quiet"]  # fmt: skip
    began = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    warned = sorted({line.strip()[:300] for line in done.stderr.splitlines() if "deterministic" in line})
    return run_dir, time.time() - began, warned


def _step_seconds(run_dir: Path) -> float:
    """The mean step time after the first (which compiles and captures)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["timing_s/step"] for r in rows if "timing_s/step" in r][1:]
    return sum(times) / max(len(times), 1)


def _phase_seconds(run_dir: Path) -> dict[str, float]:
    """Each phase's mean seconds after the first step (where the step's time goes: timing_s/gen_* are
    parts of timing_s/gen), and the engine's runs and decode steps in generation (perf/gen_*)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r][1:]
    keys = sorted({k for r in rows for k in r if k.startswith(("timing_s/", "perf/gen_"))})
    return {k: round(sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1), 4) for k in keys}


def _per_step(run_dir: Path) -> dict[str, list[float]]:
    """The step's, generation's, prefill's and update's seconds, step by step (a one-off, such as a
    compile, shows in one step, where the mean hides it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = (
        "timing_s/step",
        "timing_s/gen",
        "timing_s/gen_prefill",
        "timing_s/gen_graph_capture",
        "timing_s/update_actor",
    )
    return {k: [round(r[k], 3) for r in rows if k in r] for k in keys}


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(CLOCKS) and not k.endswith("_s")} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument(
        "--deterministic", action="store_true", help="torch.use_deterministic_algorithms, warn_only"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--exact", action="store_true", help="rollout.exact_logprobs=true in both runs")
    parser.add_argument("--baseline", action="store_true", help="and one run without it (or --deterministic)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--runs", type=int, choices=(1, 2), default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="repeatable-"))
    tok = byte_tokenizer()
    shape = SHAPES[args.shape] if args.device == "cuda" else {}
    save_hf(tiny_model("qwen2", seed=0, **shape), tok, root / "model", overwrite=True)
    (root / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"question {i}", "data_source": "synthetic"}) for i in range(512))
    )
    (root / "reward.py").write_text(REWARD)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    report = {
        "device": name,
        "shape": args.shape if shape else "tiny",
        "config": shape,
        "steps": args.steps,
        "modes": {},
    }
    report["deterministic_algorithms"] = args.deterministic
    report["exact_logprobs"] = args.exact
    extra = ["rollout.exact_logprobs=true"] if args.exact else []
    for mode in args.modes.split(","):
        runs = [_run(root, f"{mode}-{x}", args.steps, MODES[mode], args.device, args.deterministic, extra)
                for x in "ab"[: args.runs]]  # fmt: skip
        a, seconds_a, warned = runs[0]
        ma = _metrics(a)
        report["modes"][mode] = {
            "rollout_probs_diff_max": [r.get("training/rollout_probs_diff_max") for r in ma],
            "rollout_probs_diff_mean": [r.get("training/rollout_probs_diff_mean") for r in ma],
            "rollout_probs_diff_fresh_max": [r.get("training/rollout_probs_diff_fresh_max") for r in ma],
            "seconds": [round(run[1], 1) for run in runs],
            "step_seconds_after_the_first": [round(_step_seconds(run[0]), 3) for run in runs],
            "phase_seconds_after_the_first": _phase_seconds(a),
            "per_step_seconds": _per_step(a),
            "triton_compiles": compile_log.summary(root / f"{mode}-a.compiles.jsonl"),
            "nondeterministic_ops_named": warned,
        }
        if args.runs == 2:
            b = runs[1][0]
            mb = _metrics(b)
            first_difference = next(
                ({"step": ra["step"], "metric": k, "a": ra[k], "b": rb.get(k)}
                 for ra, rb in zip(ma, mb) for k in ra if ra[k] != rb.get(k)),
                None,
            )  # fmt: skip
            policy = Path("checkpoints") / f"global_step_{args.steps}" / "policy" / "model.safetensors"
            wa, wb = load_file(a / policy), load_file(b / policy)
            report["modes"][mode] |= {
                "metrics_equal": ma == mb,
                "first_difference": first_difference,
                "weights_equal": all(torch.equal(wa[n], wb[n]) for n in wa),
                "max_weight_difference": max((wa[n].float() - wb[n].float()).abs().max().item() for n in wa),
                # which tensors part tells which backward does not repeat
                "differing_tensors": {
                    n: (wa[n].float() - wb[n].float()).abs().max().item()
                    for n in sorted(wa)
                    if not torch.equal(wa[n], wb[n])
                },
            }
        Path(args.out).write_text(json.dumps(report, indent=1))  # (before the baseline's run)
        if args.baseline:
            base, seconds, _ = _run(root, f"{mode}-ordinary", args.steps, MODES[mode], args.device, False)
            rows = _metrics(base)
            report["modes"][mode]["ordinary_run"] = {
                "seconds": round(seconds, 1),
                "step_seconds_after_the_first": round(_step_seconds(base), 3),
                "phase_seconds_after_the_first": _phase_seconds(base),
                "per_step_seconds": _per_step(base),
                "triton_compiles": compile_log.summary(root / f"{mode}-ordinary.compiles.jsonl"),
                "rollout_probs_diff_max": [r.get("training/rollout_probs_diff_max") for r in rows],
                "rollout_probs_diff_mean": [r.get("training/rollout_probs_diff_mean") for r in rows],
            }
        print(mode, json.dumps(report["modes"][mode]), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
