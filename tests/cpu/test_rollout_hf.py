import math

import pytest
import torch

from hybridflow.models import byte_tokenizer, tiny_model
from hybridflow.rollout import HFBackend, SamplingParams, warp_logits


@pytest.fixture(scope="module")
def backend():
    tok = byte_tokenizer()
    return HFBackend(
        tiny_model("qwen2", seed=2), pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id]
    )


def _teacher_forced_logprobs(model, prompt, response, params):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(warp_logits(logits, params).float(), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=0),
        SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, max_tokens=12, seed=1),
    ],
)
def test_sampled_logprobs_match_teacher_forcing(backend, params):
    prompts = [[104, 105], [97, 98, 99, 100, 101, 102]]  # different lengths: left padding is exercised
    outs = backend.generate(prompts, params)
    assert [o.prompt_index for o in outs] == [i for i in range(2) for _ in range(params.n)]
    for o in outs:
        expected = _teacher_forced_logprobs(backend.model, prompts[o.prompt_index], o.token_ids, params)
        torch.testing.assert_close(torch.tensor(o.logprobs), expected, atol=1e-5, rtol=0)


def test_seed_makes_sampling_reproducible(backend):
    params = SamplingParams(n=2, max_tokens=10, seed=7)
    a = [o.token_ids for o in backend.generate([[104]], params)]
    b = [o.token_ids for o in backend.generate([[104]], params)]
    assert a == b


def test_greedy_is_argmax_and_stop_tokens_end_responses(backend):
    prompt = [104, 105]
    (o,) = backend.generate([prompt], SamplingParams(temperature=0, max_tokens=6))
    ids = list(prompt)
    for _ in range(6):
        with torch.no_grad():
            ids.append(int(backend.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert o.token_ids == ids[2:] and o.finish_reason == "length"
    stop = o.token_ids[2]
    (s,) = backend.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]))
    assert s.finish_reason == "stop" and s.token_ids == o.token_ids[: o.token_ids.index(stop) + 1]


def test_warp_logits_hand_computed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p = warp_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 + 0.3 reaches 0.8, so 0.15 and 0.05 are dropped
    assert torch.isinf(top_p[0, 2:]).all() and torch.isfinite(top_p[0, :2]).all()
    probs = torch.softmax(top_p, -1)[0]
    assert math.isclose(probs[0].item(), 0.5 / 0.8, rel_tol=1e-6)
    top_k = warp_logits(logits, SamplingParams(temperature=2.0, top_k=3))
    assert torch.isinf(top_k[0, 3]) and math.isclose(top_k[0, 0].item(), math.log(0.5) / 2, rel_tol=1e-6)
    assert torch.equal(warp_logits(logits, SamplingParams(temperature=0)), logits)
