"""The prefix cache across requests: a conversation's next turn prefills only its new tokens and
samples what an engine without the cache samples; idle cached pages are evicted least recently used
first; new weights drop every cached page."""

import pytest
import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.kv_cache import PagePool
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams

PS = 4


@pytest.fixture(scope="module")
def model():
    return from_hf_model(tiny_model("qwen2", seed=3))


def engine_for(model, **config):
    config = {"page_size": PS, "max_context_tokens": 160} | config
    return Engine(model, eos_token_ids=[1], config=EngineConfig(**config))


def one(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    tokens, logprobs = [], []
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens += out.token_ids
            logprobs += out.logprobs
    return tokens, logprobs


def test_the_page_pool_keeps_released_pages_by_key_and_evicts_the_oldest_first():
    pool = PagePool(5)  # pages 1..4
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register([a, b], [b"ka", b"kb"])
    pool.release([a, b, c])  # c had no key: free; a then b idle, in that order
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.lookup([b"ka", b"kb", b"kc"]) == [a, b] and pool.refs[a] == pool.refs[b] == 1
    assert pool.num_free == 2  # held again
    pool.release([b, a])  # now b is the older idle page
    taken = [pool.allocate() for _ in range(3)]  # two free pages, then the oldest idle one: b
    assert taken[2] == b and pool.lookup([b"ka"]) == [a] and pool.lookup([b"kb"]) == []
    pool.release([a])
    pool.forget_prefixes()
    assert pool.lookup([b"ka"]) == [] and pool.num_free == 1 and pool.num_cached == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_second_turn_prefills_only_its_new_tokens_and_samples_as_without_the_cache(model, temperature):
    params = SamplingParams(n=1, temperature=temperature, max_tokens=19, seed=11)
    system = list(range(100, 130))  # 30 tokens
    turn1 = system + [7, 8, 9]
    cached, plain = engine_for(model), engine_for(model, prefix_cache=False)
    reply, _ = one(cached, "t1", turn1, params)
    assert reply == one(plain, "t1", turn1, params)[0]
    turn2 = turn1 + reply + [55, 56, 57, 58, 59]
    before = (cached.scheduler.admitted_tokens, cached.scheduler.cached_tokens)
    got = one(cached, "t2", turn2, params)
    admitted = cached.scheduler.admitted_tokens - before[0]
    hits = cached.scheduler.cached_tokens - before[1]
    # every full page of turn 1 (all its tokens but the last had their K/V computed) is found again
    assert admitted == len(turn2) and hits == (len(turn1) + len(reply) - 1) // PS * PS
    want = one(plain, "t2", turn2, params)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-5)
    assert cached.prefix_cache_stats()["hit_rate"] == pytest.approx(hits / (len(turn1) + len(turn2)))
    assert cached.cache.pool.num_free == cached.cache.pool.num_pages  # idle cached pages count as free


def test_requests_sharing_a_system_prompt_reuse_its_pages_while_they_run(model):
    system = list(range(60, 100))  # 40 tokens: 10 full pages
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5)
    cached, plain = engine_for(model), engine_for(model, prefix_cache=False)
    one(cached, "warm", system + [3], params)
    outs = {}
    for i in range(6):
        cached.add_request(f"q{i}", system + [200 + i, 3 + i], params)
    while cached.has_unfinished_requests:
        for out in cached.step():
            outs.setdefault((out.request_id, out.sample), []).extend(out.token_ids)
    assert cached.scheduler.cached_tokens == 6 * 40
    for i in range(6):
        ref = plain.generate([system + [200 + i, 3 + i]], params)
        assert [outs[(f"q{i}", j)] for j in range(2)] == [g.token_ids for g in ref]


def test_a_pool_full_of_cached_pages_evicts_them_and_keeps_sampling_right(model):
    params = SamplingParams(n=1, temperature=0, max_tokens=8)
    small = engine_for(model, kv_cache_tokens=44 * PS, max_batch_sequences=4, max_context_tokens=40)
    plain = engine_for(model, prefix_cache=False, max_context_tokens=40)
    prompts = [[(7 * i + j) % 250 + 2 for j in range(20)] for i in range(12)]
    want = [g.token_ids for g in plain.generate(prompts, params)]
    assert [g.token_ids for g in small.generate(prompts, params)] == want
    # backwards, the last prompts' pages (released last) are found; the first ones were evicted
    assert [g.token_ids for g in small.generate(prompts[::-1], params)] == want[::-1]
    assert 0 < small.stats["prefix_cached_tokens"] < 12 * 16
    assert 0 < small.cache.pool.num_cached <= small.cache.pool.num_pages
    assert small.cache.pool.num_free == small.cache.pool.num_pages


def test_new_weights_drop_every_cached_page(model):
    params = SamplingParams(n=1, temperature=0, max_tokens=10)
    prompt = list(range(10, 50))
    engine = engine_for(model, share_weights=False)
    one(engine, "a", prompt, params)
    assert engine.cache.pool.num_cached > 0
    changed = {n: p + 0.01 * torch.randn_like(p) for n, p in model.named_parameters()}
    engine.update_weights(changed.items())
    assert engine.cache.pool.num_cached == 0
    hits = engine.scheduler.cached_tokens
    after = one(engine, "b", prompt, params)[0]
    assert engine.scheduler.cached_tokens == hits  # nothing found: everything computed anew
    fresh_model = from_hf_model(tiny_model("qwen2", seed=3))
    fresh_model.load_state_dict(changed, strict=False)
    assert after == engine_for(fresh_model, prefix_cache=False).generate([prompt], params)[0].token_ids


def test_an_optimizer_step_on_a_shared_module_drops_the_cache_without_update_weights(model):
    """The engine runs the trainer's own module (CPU): a step of the optimizer on it is noticed."""
    own = from_hf_model(tiny_model("qwen2", seed=3))
    engine = engine_for(own)
    assert engine.model is own
    prompt, params = list(range(10, 50)), SamplingParams(n=1, temperature=0, max_tokens=10)
    one(engine, "a", prompt, params)
    optimizer = torch.optim.SGD(own.parameters(), lr=0.5)
    for p in own.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    hits = engine.scheduler.cached_tokens
    after = one(engine, "b", prompt, params)[0]
    assert engine.scheduler.cached_tokens == hits and engine.weight_version == 1
    assert after == engine_for(own, prefix_cache=False).generate([prompt], params)[0].token_ids
