"""Our value and reward heads against transformers' token/sequence classification on the same weights;
the layer compile switch keeps the numbers."""

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from hybridflow.batch import pack_sequences
from hybridflow.models import tiny_model
from hybridflow.models.native import (
    from_hf_model,
    score_model_from_hf,
    to_hf_score_model,
    value_model_from_causal_lm,
)

SEQS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 90))]
PAD = 0  # appears in no sequence above except where a test puts it


def _classifier(cls, family: str, seed: int, num_labels: int = 1):
    config = tiny_model(family, seed=seed).config
    config.num_labels = num_labels
    config.pad_token_id = PAD
    torch.manual_seed(seed)
    return cls.from_config(config).eval()


def _padded(seqs):
    width = max(map(len, seqs))
    ids, mask = torch.full((len(seqs), width), PAD), torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_token_scores_equal_transformers_token_classification(family):
    hf = _classifier(AutoModelForTokenClassification, family, seed=3, num_labels=2)
    ours = score_model_from_hf(hf)
    packed = pack_sequences(SEQS)
    with torch.no_grad():
        got = ours.token_scores(packed.input_ids, packed.position_ids, packed.cu_seqlens)  # [N, 2]
        ref = hf(*_padded(SEQS)).logits  # [B, L, 2]
    cu = packed.cu_seqlens.tolist()
    assert ref.abs().max() > 1e-3  # a head that says something
    for i, s in enumerate(SEQS):
        assert_close(got[cu[i] : cu[i + 1]], ref[i, : len(s)], atol=1e-5, rtol=0)


def test_last_token_scores_equal_transformers_sequence_classification():
    hf = _classifier(AutoModelForSequenceClassification, "qwen2", seed=5)
    ours = score_model_from_hf(hf)
    packed = pack_sequences(SEQS)
    with torch.no_grad():
        got = ours.scores_at(packed.input_ids, packed.position_ids, packed.cu_seqlens)  # [B, 1]
        ref = hf(*_padded(SEQS)).logits  # [B, 1], read at the last non-pad token
    assert_close(got, ref, atol=1e-5, rtol=0)


def test_score_model_round_trip_is_identical(tmp_path):
    for cls in (AutoModelForTokenClassification, AutoModelForSequenceClassification):
        hf = _classifier(cls, "llama", seed=6)
        back = to_hf_score_model(score_model_from_hf(hf), hf.config)
        assert type(back) is type(hf)
        back.save_pretrained(tmp_path / cls.__name__)
        reloaded = cls.from_pretrained(tmp_path / cls.__name__)
        original = hf.state_dict()
        assert all(torch.equal(original[k], v) for k, v in reloaded.state_dict().items())


def test_value_model_copies_the_policy_backbone_and_starts_at_zero():
    policy = from_hf_model(tiny_model("qwen3", seed=7))
    critic = value_model_from_causal_lm(policy)
    packed = pack_sequences(SEQS)
    inputs = (packed.input_ids, packed.position_ids, packed.cu_seqlens)
    with torch.no_grad():
        assert torch.equal(critic.hidden_states(*inputs), policy.hidden_states(*inputs))
        assert torch.equal(critic.token_scores(*inputs), torch.zeros(packed.input_ids.numel(), 1))
    assert critic.model.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()


def test_compiled_layers_give_the_same_logits_and_gradients():
    model = from_hf_model(tiny_model("qwen2", seed=8)).train()
    packed = pack_sequences(SEQS)
    inputs = (packed.input_ids, packed.position_ids, packed.cu_seqlens)

    def run():
        model.zero_grad()
        logits = model(*inputs)
        logits.square().mean().backward()
        return logits.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    eager = run()
    model.compile_layers()
    compiled = run()
    assert_close(compiled[0], eager[0], atol=1e-5, rtol=0)
    assert_close(compiled[1], eager[1], atol=1e-6, rtol=1e-4)
