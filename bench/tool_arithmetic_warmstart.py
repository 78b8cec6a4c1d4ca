"""tool_arithmetic_grpo from an SFT warm start, on this CPU with the embedded model.

SmolLM2-135M-Instruct makes no tool calls zero-shot, so GRPO alone has nothing to reinforce. This
writes demonstrations of the calculator in use (problems of the recipe's kind, none of its test
problems), fine-tunes on them (`hybridflow sft`'s trainer, the same system turn the tool loop gives
the model), then runs the recipe from that checkpoint and prints held-out accuracy before and after.

    PYTHONPATH=. python bench/tool_arithmetic_warmstart.py --out /tmp/tool_warmstart
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridflow.agents.builtin import calculator
from hybridflow.agents.tool_loop import tools_system_text
from hybridflow.agents.tools import Tool
from hybridflow.config import load_config
from hybridflow.controller.trainer import RLTrainer
from hybridflow.data.tasks.arithmetic import ArithmeticSpec, make_rows
from hybridflow.offline import SFTTrainer

INSTRUCTION = 'Use the calculator tool. Give the final answer after "####".'


def demonstrations(count: int, seed: int) -> list[dict]:
    spec = ArithmeticSpec(max_digits=3, operators="*", instruction=INSTRUCTION)
    test = {r["extra_info"]["expression"] for r in make_rows(40, seed=0, split="test", spec=spec)}
    system = tools_system_text([Tool(calculator).schema])
    rows = []
    for r in make_rows(count, seed=seed, split="demo", spec=spec, exclude=test):
        expression, value = r["extra_info"]["expression"], r["reward_model"]["ground_truth"]
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        rows.append({"messages": [
            {"role": "system", "content": system},
            *r["prompt"],
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": f"{expression} = {value}\n#### {value}"},
        ]})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--demos", type=int, default=320)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--rl-steps", type=int, default=14)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demos.jsonl").write_text("\n".join(json.dumps(r) for r in demonstrations(args.demos, seed=1)))
    start = time.time()
    SFTTrainer(load_config(None, [
        "model.path=default", f"data.train_files=[{out / 'demos.jsonl'}]", "sft.messages_key=messages",
        "sft.batch_size=8", "actor.optim.lr=5e-5", "actor.compute_dtype=float32",
        f"trainer.total_training_steps={args.sft_steps}", f"trainer.run_dir={out / 'sft'}",
        "trainer.logger=[jsonl]", "trainer.progress=false",
    ]), overwrite=True).fit()  # fmt: skip
    sft_s = time.time() - start
    policy = out / "sft" / "checkpoints" / f"global_step_{args.sft_steps}" / "policy"
    RLTrainer(load_config("tool_arithmetic_grpo", [
        f"model.path={policy}", f"trainer.run_dir={out / 'rl'}", f"trainer.total_training_steps={args.rl_steps}",
        "trainer.logger=[jsonl]", "trainer.progress=false", "trainer.save_freq=-1",
    ]), overwrite=True).fit()  # fmt: skip
    total_s = time.time() - start
    metrics = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        held_out = {k: round(v, 3) for k, v in m.items() if k.startswith("val-core/")}
        agent = {k: round(m[k], 3) for k in ("agent/tool_calls_mean", "critic/score/mean") if k in m}
        if held_out or agent:
            print(m.get("step"), held_out, agent)
    print(f"sft {sft_s:.0f} s; sft + grpo {total_s:.0f} s")


if __name__ == "__main__":
    main()
