"""Run under TRITON_INTERPRET=1: the engine's fused decode step (its Triton kernels on CPU tensors,
no graphs) against the trainer's modules, end to end. Prints one line per case; exits non-zero on a
mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"


from hybridflow.engine import Engine, EngineConfig  # noqa: E402
from hybridflow.models import tiny_model  # noqa: E402
from hybridflow.models.native import from_hf_model  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402

PROMPTS = [[5, 9, 200, 17, 3, 8], list(range(30, 45)), [250]]
failed = False


def engine(model, fused: bool, own_copy: bool) -> Engine:
    config = EngineConfig(page_size=4, max_context_tokens=48, decode_steps=4, fused_decode=fused,
                          share_weights=not own_copy)  # fmt: skip
    return Engine(model, eos_token_ids=[1], config=config)


for family, own_copy in (("qwen2", True), ("qwen3", False)):  # fused projections; the trainer's module
    model = from_hf_model(tiny_model(family, seed=4))
    cases = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=9),
        "t=0.6 with stops": SamplingParams(
            n=2,
            temperature=0.6,
            max_tokens=9,
            seed=1,
            stop_token_ids=list(range(2, model.config.vocab_size, 7)),
        ),
    }
    fused_engine, plain_engine = engine(model, True, own_copy), engine(model, False, own_copy)
    assert fused_engine.runner.fused is not None and plain_engine.runner.fused is None
    for name, params in cases.items():
        a, b = fused_engine.generate(PROMPTS, params), plain_engine.generate(PROMPTS, params)
        same = [x.token_ids for x in a] == [y.token_ids for y in b]
        same &= [x.finish_reason for x in a] == [y.finish_reason for y in b]
        err = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs + x.unscaled_logprobs,
                                                                  y.logprobs + y.unscaled_logprobs))  # fmt: skip
        stopped = sum(x.finish_reason == "stop" for x in a)
        # runs launched before the last was read (the fused steps run whole on the device)
        ahead = fused_engine.counters()["decode_runs_ahead"]
        print(f"fused decode {family} {name}: same tokens and stops {same} ({stopped} stopped), "
              f"log-prob max abs err {err:.2e}, runs ahead {ahead}")  # fmt: skip
        failed |= not same or err > 1e-5 or ("stops" in name and not stopped) or not ahead
    # the same prompts again: prefilled from the prefix cache's pages (the fused layers store only
    # the new tokens' K/V, attention reads the whole context back)
    before = fused_engine.prefix_cache_stats()["cached_tokens"]
    a, b = fused_engine.generate(PROMPTS, cases["greedy"]), plain_engine.generate(PROMPTS, cases["greedy"])
    hit = fused_engine.prefix_cache_stats()["cached_tokens"] > before
    same = [x.token_ids for x in a] == [y.token_ids for y in b]
    err = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.logprobs, y.logprobs))
    print(f"fused decode {family} from the prefix cache ({hit}): same tokens and stops {same}, "
          f"log-prob max abs err {err:.2e}")  # fmt: skip
    failed |= not same or not hit or err > 1e-5
    if own_copy:  # new weights land in the fused tensors the step reads
        other = from_hf_model(tiny_model(family, seed=9))
        fused_engine.update_weights(other.named_parameters())
        a = fused_engine.generate(PROMPTS, cases["greedy"])
        b = engine(other, False, True).generate(PROMPTS, cases["greedy"])
        same = [x.token_ids for x in a] == [y.token_ids for y in b]
        print(f"fused decode {family} after update_weights: same tokens as a fresh engine {same}")
        failed |= not same
sys.exit(1 if failed else 0)
