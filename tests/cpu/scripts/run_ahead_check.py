"""Decode runs launched before the last one is read (decode_runs.DecodeRuns._launch_after), in Triton's interpreter (the
fused steps run whole "on the device" there): the request API's outputs equal those of the engine
without fused steps (no run ever launched ahead) while requests are added, aborted, paused and given
new weights between steps, with a run ahead pending each time; and with speculation on, runs launched
ahead while too many sequences run to speculate. Run by tests/cpu/test_engine.py."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

from hybridflow.engine import Engine, EngineConfig  # noqa: E402
from hybridflow.engine.drafter import SpeculativeConfig  # noqa: E402
from hybridflow.models import tiny_model  # noqa: E402
from hybridflow.models.native import from_hf_model  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402

model = from_hf_model(tiny_model("qwen2", seed=4))
other = from_hf_model(tiny_model("qwen2", seed=9))
vocab = model.config.vocab_size
STOPS = list(range(2, vocab, 29))  # a stop now and then, mid-run
PARAMS = SamplingParams(n=2, temperature=0.8, max_tokens=23, seed=3, stop_token_ids=STOPS)


def engine(fused: bool, speculative: SpeculativeConfig | None = None) -> Engine:
    config = EngineConfig(
        page_size=4, max_context_tokens=64, decode_steps=4, fused_decode=fused, share_weights=False,
        speculative=speculative or SpeculativeConfig(),
    )  # fmt: skip
    return Engine(model, eos_token_ids=[1], config=config)


def script(eng: Engine) -> dict:
    """Each request's tokens, log-probs and finish reasons, through a schedule of interruptions."""
    got: dict = {}

    def take(outputs) -> None:
        for out in outputs:
            row = got.setdefault((out.request_id, out.sample), {"tokens": [], "logprobs": [], "end": None})
            row["tokens"] += out.token_ids
            row["logprobs"] += out.logprobs
            row["end"] = out.finish_reason

    def step(times: int = 1) -> None:
        for _ in range(times):
            take(eng.step())

    eng.add_request("a", [5, 9, 200, 17, 3, 8], PARAMS)
    eng.add_request("b", list(range(30, 45)), PARAMS)
    step(3)  # prefill, a run, and (fused) one launched ahead of the next
    eng.add_request("c", [250, 7], PARAMS)  # admitted once the run ahead is read
    step(2)
    take(eng.abort("b"))  # its rows in a run ahead are dropped when that run is read
    while eng.has_unfinished_requests:
        step()
    # new weights while a run is ahead (its draws dropped, the sequences prefilled again): at the
    # update both engines have read the same runs, so the same tokens come from the new weights
    eng.add_request("e", [9, 9, 31, 4], PARAMS)
    step(2)  # prefill, a run read (fused: the next launched ahead)
    eng.pause()
    step()  # nothing while paused
    eng.update_weights(other.named_parameters())
    eng.resume()
    eng.add_request("d", [44, 2, 2], SamplingParams(temperature=0.0, max_tokens=17))
    while eng.has_unfinished_requests:
        step()
    return got


fused, plain = engine(True), engine(False)
a, b = script(fused), script(plain)
same = {k: (v["tokens"], v["end"]) for k, v in a.items()} == {
    k: (v["tokens"], v["end"]) for k, v in b.items()
}
err = max(abs(p - q) for k in a for p, q in zip(a[k]["logprobs"], b[k]["logprobs"]))
ahead = fused.counters()["decode_runs_ahead"]
ends = sorted({v["end"] for v in a.values()})
print(
    f"runs ahead: request outputs equal {same} over {len(a)} samples ({ends}), log-prob max abs err "
    f"{err:.2e}, runs launched ahead {ahead}, none without fused steps {plain.counters()['decode_runs_ahead'] == 0}"
)
pages = fused.cache.pool
print(f"runs ahead: every page back in the pool {pages.num_free == pages.num_pages}")
# speculation on, speculating while at most 6 sequences run: runs are launched ahead while 8 run; a
# request that stops in the first run leaves 6 with a run ahead pending, which is read before any
# speculative step; every sample the plain engine's (greedy: a tiny random model falls into loops its
# drafts follow)
spec_engine = engine(True, SpeculativeConfig(num_speculative_tokens=2, max_batch_sequences=6, adaptive=False))
prompts = [[5, 9, 200, 17, 3, 8], list(range(30, 45)), [250, 7], [9, 9, 31, 4]]
greedy = SamplingParams(n=2, temperature=0.0, max_tokens=23, stop_token_ids=STOPS)
want = [(g.token_ids, g.finish_reason) for g in engine(False).generate(prompts, greedy)]
got: dict = {}
pending_while_few = False
for i, p in enumerate(prompts):
    spec_engine.add_request(str(i), p, greedy)
while spec_engine.has_unfinished_requests:
    for out in spec_engine.step():
        tokens, _ = got.get((out.request_id, out.sample), ([], None))
        got[(out.request_id, out.sample)] = (tokens + out.token_ids, out.finish_reason)
    few = len(spec_engine.scheduler.running) <= 6
    pending_while_few |= few and spec_engine.decoding.ahead is not None
spec_same = [got[k] for k in sorted(got)] == want
counts = spec_engine.counters()
print(
    f"runs ahead with speculation: outputs equal {spec_same} over {len(want)} samples, a run ahead pending "
    f"while few enough ran to speculate {pending_while_few}, runs launched ahead {counts['decode_runs_ahead']}, "
    f"speculative steps {counts['speculative_steps']}"
)
ok = same and err < 1e-5 and ahead >= 3 and pages.num_free == pages.num_pages
spec_ok = spec_same and pending_while_few and counts["speculative_steps"] >= 1
sys.exit(0 if ok and spec_ok else 1)
