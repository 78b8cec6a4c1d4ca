"""How many drafted tokens a drafter gets right, replayed offline on the same text: the plain engine
samples GSM8K responses for a few epochs (the embedded model at temperature 1, `--n` samples a prompt,
a seed per epoch); each drafter then walks them position by position as the engine would meet them
(the samples of a prompt side by side, earlier epochs' responses on record), drafting before every
token with its back-off cleared, and counts the leading drafted tokens that equal the text. A draft
decides only how many tokens a verifying step may keep, never which, so this is the drafter's whole
effect, free of the device's timing. `--baseline` names another drafter.py to compare against (e.g.
an earlier commit's: `git show REV:hybridflow/engine/drafter.py > /tmp/old_drafter.py`).

    PYTHONPATH=.:bench python bench/drafter_replay.py --baseline /tmp/old_drafter.py --out replay.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from speculative import gsm8k_prompts

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.sequence import Sequence
from hybridflow.models import load_causal_lm, stop_token_ids
from hybridflow.rollout.sampling import SamplingParams


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def replay(drafter_module, prompts, epochs, k: int) -> dict:
    drafter = drafter_module.Drafter(drafter_module.SpeculativeConfig(num_speculative_tokens=k))
    report, seq_id = {}, 0
    for e, generations in enumerate(epochs):
        counts = dict.fromkeys(("positions", "drafted", "accepted", "first_right"), 0)
        by_prompt: dict[int, list] = {}
        for g in generations:
            by_prompt.setdefault(g.prompt_index, []).append(g.token_ids)
        for i, responses in by_prompt.items():
            seqs = [
                Sequence(seq_id + j, 0, list(prompts[i]), len(prompts[i]), seed=0)
                for j in range(len(responses))
            ]
            seq_id += len(responses)
            for t in range(max(len(r) for r in responses)):  # the samples side by side, a token each
                for s, response in zip(seqs, responses):
                    if t >= len(response):
                        continue
                    drafter._backoff.clear()  # every position drafts: the drafts alone are compared
                    draft = drafter.draft(s, len(response) - t)
                    kept = 0
                    while kept < len(draft) and draft[kept] == response[t + kept]:
                        kept += 1
                    counts["positions"] += 1
                    counts["drafted"] += len(draft)
                    counts["accepted"] += kept
                    counts["first_right"] += bool(draft) and draft[0] == response[t]
                    s.tokens.append(response[t])
            for s in seqs:
                drafter.finished(s)
        counts["accepted_per_position"] = counts["accepted"] / counts["positions"]
        counts["accepted_per_drafted"] = counts["accepted"] / max(counts["drafted"], 1)
        report[f"epoch_{e + 1}"] = counts
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("../shared/data/gsm8k"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--baseline", type=Path, default=None, help="another drafter.py to replay beside")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    model, tokenizer = load_causal_lm("default", impl="native")
    prompts = gsm8k_prompts(tokenizer, args.data, args.prompts)
    config = EngineConfig(max_context_tokens=1024, max_batch_sequences=len(prompts) * args.n)
    engine = Engine(model, eos_token_ids=stop_token_ids(model, tokenizer), config=config)
    epochs = [
        engine.generate(
            prompts, SamplingParams(temperature=1.0, max_tokens=args.tokens, n=args.n, seed=1 + e)
        )
        for e in range(args.epochs)
    ]
    drafters = {"this tree": Path(__file__).parents[1] / "hybridflow" / "engine" / "drafter.py"}
    if args.baseline is not None:
        drafters = {"baseline": args.baseline, **drafters}
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d"),
        "drafters": {},
    }
    for name, path in drafters.items():
        report["drafters"][name] = replay(
            _module(path, f"drafter_{len(report['drafters'])}"), prompts, epochs, args.k
        )
        print(name, json.dumps(report["drafters"][name]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
