"""The engine's request API: add_request / step / abort give what generate gives, token for token,
whatever else runs beside a request, with each request's own sampling parameters."""

from dataclasses import replace

import pytest
import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 60)), [250]]


@pytest.fixture(scope="module")
def model():
    return from_hf_model(tiny_model("qwen2", seed=3))


def engine_for(model, **config):
    return Engine(
        model, eos_token_ids=[1], config=EngineConfig(**({"page_size": 4, "max_context_tokens": 96} | config))
    )


def run_to_end(engine) -> dict[tuple[str, int], dict]:
    """Every output streamed by step(), joined per (request, sample)."""
    joined: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            got = joined.setdefault(
                (out.request_id, out.sample), {"tokens": [], "logprobs": [], "finish": None}
            )
            assert got["finish"] is None, "an output after the last"
            got["tokens"] += out.token_ids
            got["logprobs"] += out.logprobs
            got["finish"] = out.finish_reason
    return joined


def alone(model, prompt, params):
    return engine_for(model).generate([prompt], params)


PARAMS = [
    SamplingParams(n=2, temperature=0, max_tokens=20),
    SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=7),
    SamplingParams(n=1, temperature=0.7, top_k=5, max_tokens=16, seed=3, stop_token_ids=[17]),
    SamplingParams(n=2, temperature=1.2, top_p=0.8, max_tokens=30, seed=99),
]


def test_requests_with_their_own_parameters_equal_generate_token_for_token(model):
    """Four requests of different lengths, sample counts and sampling parameters in one engine: each
    sample streams exactly what generate gives that request alone (greedy and seeded sampling)."""
    engine = engine_for(model)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(f"r{i}", prompt, params)
    joined = run_to_end(engine)
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        for j, ref in enumerate(alone(model, prompt, params)):
            got = joined[(f"r{i}", j)]
            assert got["tokens"] == ref.token_ids and got["finish"] == ref.finish_reason
            assert got["logprobs"] == pytest.approx(ref.logprobs, abs=1e-5)
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages  # every page back


def test_a_request_added_mid_run_changes_nothing_for_either(model):
    engine = engine_for(model)
    engine.add_request("first", PROMPTS[2], PARAMS[3])
    early = [engine.step() for _ in range(3)]  # a prefill, then decode runs
    engine.add_request("late", PROMPTS[0], PARAMS[1])
    joined = run_to_end(engine)
    before: dict[int, list[int]] = {}
    for out in (o for outs in early for o in outs):  # the first request's early tokens, in order
        before.setdefault(out.sample, []).extend(out.token_ids)
    for sample, tokens in before.items():
        joined[("first", sample)]["tokens"][:0] = tokens
    for request_id, prompt, params in (("first", PROMPTS[2], PARAMS[3]), ("late", PROMPTS[0], PARAMS[1])):
        refs = alone(model, prompt, params)
        assert [joined[(request_id, j)]["tokens"] for j in range(params.n)] == [r.token_ids for r in refs]


def test_abort_ends_a_request_at_once_and_frees_its_pages(model):
    """Four sequences at most run at once: 'drop' runs, 'keep' and 'queued' wait; aborting a running
    request and a waiting one leaves 'keep' to run as it would alone."""
    engine = engine_for(model, max_batch_sequences=4)
    engine.add_request("drop", PROMPTS[2], SamplingParams(n=3, temperature=1.0, max_tokens=60, seed=1))
    engine.add_request("keep", PROMPTS[1], PARAMS[0])
    engine.add_request("queued", PROMPTS[0], PARAMS[1])
    early = engine.step() + engine.step()
    assert {o.request_id for o in early} == {"drop"}  # the others wait for room
    aborted = engine.abort("drop") + engine.abort("queued")
    assert sorted((o.request_id, o.sample, o.finish_reason) for o in aborted) == [
        ("drop", 0, "abort"), ("drop", 1, "abort"), ("drop", 2, "abort"),
        ("queued", 0, "abort"), ("queued", 1, "abort"), ("queued", 2, "abort"),
    ]  # fmt: skip
    assert engine.abort("drop") == []  # gone
    joined = run_to_end(engine)
    assert {k[0] for k in joined} == {"keep"}
    for j in range(2):
        joined[("keep", j)]["tokens"][:0] = [
            t for o in early if (o.request_id, o.sample) == ("keep", j) for t in o.token_ids
        ]
    assert [joined[("keep", j)]["tokens"] for j in range(2)] == [
        g.token_ids for g in alone(model, PROMPTS[1], PARAMS[0])
    ]
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages
    assert not engine.has_unfinished_requests and engine.step() == []


def test_requests_set_aside_wait_while_a_batch_runs_alone_then_go_on_as_if_never_stopped(model):
    """set_aside(): the requests in flight leave the schedule (tokens kept, pages freed) while another
    request runs as on an idle engine; an aborted one stays gone; bring_back() continues the rest to
    the tokens they would have had."""
    engine = engine_for(model)
    engine.add_request("kept", PROMPTS[2], PARAMS[3])
    engine.add_request("dropped", PROMPTS[1], PARAMS[1])
    early = engine.step() + engine.step() + engine.step()
    engine.set_aside()
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages and not engine.has_unfinished_requests
    engine.add_request("alone", PROMPTS[0], PARAMS[0])
    joined = run_to_end(engine)
    assert {k[0] for k in joined} == {"alone"}  # the others did not move
    assert [joined[("alone", j)]["tokens"] for j in range(2)] == [
        g.token_ids for g in alone(model, PROMPTS[0], PARAMS[0])
    ]
    assert len(engine.abort("dropped")) == 3
    engine.bring_back()
    went_on = run_to_end(engine)
    assert {k[0] for k in went_on} == {"kept"}
    for j in range(PARAMS[3].n):
        tokens = [t for o in early if (o.request_id, o.sample) == ("kept", j) for t in o.token_ids]
        assert tokens + went_on[("kept", j)]["tokens"] == alone(model, PROMPTS[2], PARAMS[3])[j].token_ids
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_request_ids_and_prompts_are_checked(model):
    engine = engine_for(model)
    engine.add_request("a", [3, 4], PARAMS[0])
    with pytest.raises(UserError, match="request 'a' is already running"):
        engine.add_request("a", [3, 4], PARAMS[0])
    with pytest.raises(UserError, match="prompt b has 0 tokens"):
        engine.add_request("b", [], PARAMS[0])
    run_to_end(engine)
    engine.add_request("a", [3, 4], PARAMS[0])  # a finished request's id is free again
    assert run_to_end(engine)[("a", 1)]["finish"] in ("stop", "length")


def test_two_hundred_coroutines_share_one_engine_and_a_cancelled_one_is_aborted(model):
    """200 concurrent requests through AsyncEngine: each gets what generate gives it alone; one
    cancelled mid-way is aborted (its pages freed), a bad prompt fails only its own request."""
    import asyncio

    from hybridflow.engine.async_engine import AsyncEngine

    engine = engine_for(model, max_batch_sequences=64)
    front = AsyncEngine(engine)
    params = [SamplingParams(n=1, temperature=1.0, max_tokens=8 + i % 9, seed=i) for i in range(200)]
    prompts = [PROMPTS[i % 4] for i in range(200)]

    async def main():
        slow = asyncio.create_task(
            front.generate(PROMPTS[2], SamplingParams(n=2, temperature=1.0, max_tokens=80, seed=5))
        )
        results = await asyncio.gather(*(front.generate(p, q) for p, q in zip(prompts, params)))
        assert not slow.done()
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        with pytest.raises(UserError, match="has 0 tokens"):
            await front.generate([], params[0])
        for _ in range(50):  # the abort is applied between two steps
            if not engine.has_unfinished_requests:
                break
            await asyncio.sleep(0.01)
        return results

    results = asyncio.run(main())
    reference = engine_for(model)
    for i in range(0, 200, 17):
        assert results[i][0].token_ids == reference.generate([prompts[i]], params[i])[0].token_ids
    assert not engine.has_unfinished_requests
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_pause_update_resume_continues_each_request_with_the_new_weights(model):
    """Paused mid-run, new weights in, resumed: each request keeps the tokens it had and goes on
    exactly as a fresh engine with the new weights goes on from them (greedy); outputs say which
    weights they were sampled with."""
    new_model = from_hf_model(tiny_model("qwen2", seed=11))
    engine = engine_for(model, share_weights=False)
    params = SamplingParams(n=1, temperature=0, max_tokens=24)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", prompt, params)
    before: dict[str, list[int]] = {}
    for out in engine.step() + engine.step():
        assert out.weight_version == 0
        before.setdefault(out.request_id, []).extend(out.token_ids)
    engine.pause()
    assert engine.step() == [] and engine.has_unfinished_requests
    engine.update_weights(new_model.named_parameters())
    engine.resume()
    after: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.weight_version == 1
            after.setdefault(out.request_id, []).extend(out.token_ids)
    fresh = engine_for(new_model)
    for i, prompt in enumerate(PROMPTS[:3]):
        done = before[f"r{i}"]
        rest = SamplingParams(n=1, temperature=0, max_tokens=24 - len(done))
        assert after[f"r{i}"] == fresh.generate([prompt + done], rest)[0].token_ids
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


def test_a_reader_of_results_only_gets_one_output_per_sample_and_weight_version(model):
    """stream(every_step=False) hands each sample's tokens over when it finishes, merged: the same
    tokens and log-probs as reading every step, one output per weight version the sample saw."""
    import asyncio

    from hybridflow.engine.async_engine import AsyncEngine

    params = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=4)
    new_model = from_hf_model(tiny_model("qwen2", seed=11))

    async def read(every_step: bool, update: bool) -> list:
        front = AsyncEngine(engine_for(model, share_weights=False))

        async def update_after_two_steps():
            for _ in range(3):  # each call waits for the step boundary after the last
                await front.between_steps(lambda e: None)
            await front.between_steps(
                lambda e: (e.pause(), e.update_weights(new_model.named_parameters()), e.resume())
            )

        updating = asyncio.ensure_future(update_after_two_steps()) if update else None
        outs = [out async for out in front.stream(PROMPTS[0], params, every_step=every_step)]
        if updating is not None:
            assert updating.done()  # the update came before the end
        await front.aclose()
        return outs

    def joined(outs):
        return {
            s: [(t, lp, o.weight_version) for o in outs if o.sample == s
                for t, lp in zip(o.token_ids, o.unscaled_logprobs)]
            for s in range(2)
        }  # fmt: skip

    every, held = asyncio.run(read(True, False)), asyncio.run(read(False, False))
    assert joined(held) == joined(every) and len(every) > 2
    assert sorted(o.sample for o in held) == [0, 1]  # one output per sample
    assert all(o.finish_reason == "length" and len(o.token_ids) == 30 for o in held)
    every, held = asyncio.run(read(True, True)), asyncio.run(read(False, True))
    assert joined(held) == joined(every)
    assert sorted((o.sample, o.weight_version) for o in held) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_weight_update_that_keeps_the_kv_goes_on_over_the_older_weights_kv(model):
    """keep_kv_on_weight_update: nothing is prefilled again, and each request goes on exactly as
    transformers does with the old model's cache of every token but the last and the new model from
    there (greedy, tokens and log-probs); the recomputing engine goes on as the new model alone does,
    and the two differ. K/V that outlived an update never serve a later request from the prefix cache."""
    import inspect

    from transformers import DynamicCache

    old_hf, new_hf = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=11)
    new_model = from_hf_model(new_hf)
    prompts, total = PROMPTS[:3], 24
    params = SamplingParams(n=1, temperature=0, max_tokens=total)

    def run(keep: bool) -> tuple[Engine, dict[str, list[int]], dict[str, dict]]:
        engine = engine_for(model, share_weights=False, keep_kv_on_weight_update=keep)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        before: dict[str, list[int]] = {}
        for out in engine.step() + engine.step():
            before.setdefault(out.request_id, []).extend(out.token_ids)
        assert all(len(s.tokens) - 1 == s.cached for s in engine.scheduler.running.values())
        engine.update_weights(new_model.named_parameters())
        return engine, before, {request_id: got for (request_id, _), got in run_to_end(engine).items()}

    cache_arg = "cache" if "cache" in inspect.signature(new_hf.forward).parameters else "past_key_values"

    @torch.no_grad()
    def over_old_kv(tokens: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy: the old model's K/V of tokens[:-1], then the new model from the last token on."""
        cache = DynamicCache()
        old_hf(torch.tensor([tokens[:-1]]), use_cache=True, **{cache_arg: cache})
        last, out, logprobs = tokens[-1], [], []
        for _ in range(steps):
            logits = new_hf(torch.tensor([[last]]), use_cache=True, **{cache_arg: cache}).logits[0, -1]
            last = int(logits.argmax())
            out.append(last)
            logprobs.append(torch.log_softmax(logits.double(), -1)[last])
        return out, torch.stack(logprobs)

    kept, before, after = run(keep=True)
    assert kept.recomputed_tokens == 0 and kept.scheduler.preemptions == 0
    recomputing, before_r, after_r = run(keep=False)
    assert before_r == before and recomputing.recomputed_tokens == sum(
        len(p) + len(before[f"r{i}"]) for i, p in enumerate(prompts)
    )
    fresh = engine_for(new_model)
    gaps = []
    for i, prompt in enumerate(prompts):
        done, got, got_r = before[f"r{i}"], after[f"r{i}"], after_r[f"r{i}"]
        tokens, logprobs = over_old_kv(prompt + done, total - len(done))
        assert got["tokens"] == tokens
        torch.testing.assert_close(
            torch.tensor(got["logprobs"], dtype=torch.float64), logprobs, atol=1e-4, rtol=0
        )
        alone = fresh.generate([prompt + done], replace(params, max_tokens=total - len(done)))[0]
        assert got_r["tokens"] == alone.token_ids and got_r["logprobs"] == pytest.approx(
            alone.logprobs, abs=1e-5
        )
        gaps.append(max(abs(a - b) for a, b in zip(got["logprobs"], got_r["logprobs"])))
    assert max(gaps) > 1e-2  # the test tells the two apart
    assert kept.cache.pool.num_cached == 0  # the finished sequences' pages were not named
    kept.generate([prompts[2]], replace(params, max_tokens=4))
    assert kept.stats["prefix_cached_tokens"] == 0


def test_a_request_the_engine_cannot_run_is_refused_before_it_is_queued():
    from hybridflow.engine.requests import check_request
    from hybridflow.errors import UserError
    from hybridflow.rollout.sampling import SamplingParams

    check_request("r", [5, 6], SamplingParams(stop_token_ids=[258]), max_context=8, vocab=259)
    for prompt, params, message in (
        (
            [5],
            SamplingParams(stop_token_ids=[10**20]),
            "stop_token_ids holds a token id outside the vocabulary",
        ),
        ([5, 259], SamplingParams(), "prompt holds a token id outside the vocabulary"),
        ([-1], SamplingParams(), "prompt holds"),
        ([5] * 8, SamplingParams(), "the engine takes 1 to 7"),
        ([5], SamplingParams(max_tokens=0), "must be at least 1"),
    ):
        with pytest.raises(UserError, match=message):
            check_request("r", prompt, params, max_context=8, vocab=259)
    assert SamplingParams(temperature=1e-40).greedy  # 1/t would overflow: greedy, as vLLM's
