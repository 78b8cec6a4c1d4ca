"""Multi-turn episodes on the engine (issue #29): episodes per second with the prefix cache on and off,
and the rollout/trainer log-prob gap over the masked episodes. A random-weight Qwen2.5 shape with the
byte tokenizer's vocabulary (the agent loop decodes what the model samples), an environment that
answers every turn and never ends the game early, so every episode runs `--turns` turns of
`--turn-tokens` tokens after a long shared system prompt: each turn's request carries the whole
conversation so far, the case the prefix cache is for. `--model` runs a real model instead (a .gguf
file, an HF directory or 'default'), with its own tokenizer and chat template, in bf16 on a GPU; its
turns end where the model ends them.

    PYTHONPATH=. python bench/agent_episodes.py --shape 0.5b --episodes 256      # H200
    PYTHONPATH=. python bench/agent_episodes.py --model default --episodes 256   # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import torch

from hybridflow.agents import EnvAgentLoop, run_episodes
from hybridflow.batch import Prompt
from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.models import byte_tokenizer, load_causal_lm, stop_token_ids
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
import rollout as rollout_bench  # noqa: E402


class Answers:
    """Says 'Lower.' to every guess: the episode lasts max_turns."""

    def reset(self, sample):
        return None

    def step(self, action):
        return "Lower.", 0.0, False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8, help="episodes per prompt")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--model", help="a real model (.gguf, HF directory or 'default') instead of --shape")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model:
        model, tok = load_causal_lm(args.model, impl="native", dtype=dtype)
        model, eos = model.to(device), stop_token_ids(model, tok)
        rule = "Rule: the hidden number is a whole number from 1 to 100; answer with one guess per turn. "
        system = rule * max(1, args.system_tokens // len(tok(rule)["input_ids"]))
    else:
        tok = byte_tokenizer()
        rollout_bench.VOCAB = len(tok)  # sampled ids must decode
        model, eos = rollout_bench.random_model(args.shape, device, dtype), [tok.eos_token_id]
        system = "x" * args.system_tokens  # one byte, one token
    prompts = [
        Prompt(i, [], "game", messages=[{"role": "system", "content": system},
                                        {"role": "user", "content": f"Game {i}: guess the number."}])
        for i in range(args.episodes // args.samples)
    ]  # fmt: skip
    loop = EnvAgentLoop(tok, Answers, max_turns=args.turns, max_tokens_per_turn=args.turn_tokens,
                        max_response_tokens=args.turns * (args.turn_tokens + 32))  # fmt: skip
    params = SamplingParams(n=args.samples, temperature=1.0, seed=0)
    report = {"model": args.model or f"random {args.shape}", "episodes": len(prompts) * args.samples, "turns": args.turns,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}  # fmt: skip
    for cache in (True, False, True):
        engine = Engine(model, eos_token_ids=eos, config=EngineConfig(
            max_context_tokens=4096, prefix_cache=cache, max_batch_sequences=256,
            kv_cache_tokens=None if device.type == "cuda" else 32768))  # fmt: skip

        async def go(engine=engine):
            front = AsyncEngine(engine)
            try:
                start = time.perf_counter()
                episodes = await run_episodes(loop, prompts, front, params)
                return episodes, time.perf_counter() - start
            finally:
                await front.aclose()

        episodes, seconds = asyncio.run(go())
        stats = engine.prefix_cache_stats()
        r = episodes.rollouts
        report[f"prefix_cache={cache}"] = {
            "episodes_per_s": round(len(episodes.episodes) / seconds, 2),
            "seconds": round(seconds, 2),
            "prompt_tokens": stats["prompt_tokens"],
            "cached_tokens": stats["cached_tokens"],
            "turns_mean": round(episodes.metrics["agent/turns_mean"], 2),
            "sampled_tokens": sum(sum(m) for m in episodes.rollouts.loss_masks),
        }
        print(json.dumps(report), flush=True)
    # the trainer's log-probs of the sampled tokens over the whole masked episodes
    from hybridflow.roles.forward import packed_response_logprobs

    with torch.no_grad():
        trainer, _ = packed_response_logprobs(model, r.prompt_ids, r.response_ids, device=device,
                                              compute_dtype="auto")  # fmt: skip
    gaps = torch.cat([
        (trainer[i, : len(ids)].float().cpu() - torch.tensor(lps)).abs()[torch.tensor(mask) > 0]
        for i, (ids, lps, mask) in enumerate(zip(r.response_ids, r.response_logprobs, r.loss_masks))
    ])  # fmt: skip
    report["logprob_gap_sampled_tokens"] = {"mean": round(gaps.mean().item(), 5), "max": round(gaps.max().item(), 4),
                                            "tokens": gaps.numel()}  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
