"""Our model against transformers on the same weights, packed vs padded; chunked log-probs; export."""

import random

import pytest
import torch
from torch.testing import assert_close
from transformers import AutoModelForCausalLM

from hybridflow.batch import balance_partitions, pack_sequences
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer, load_causal_lm, save_hf, tiny_model
from hybridflow.models.native import chunked_token_logprobs, from_hf_model, sequence_log_probs, to_hf_model
from hybridflow.models.tiny import FAMILIES

SEQS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 130))]  # the last is longer than llama3's
# original context (64), so its RoPE scaling is exercised


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_transformers_padded(family):
    hf = tiny_model(family, seed=1)
    ours = from_hf_model(hf)
    packed = pack_sequences(SEQS)
    with torch.no_grad():
        logits = ours(packed.input_ids, packed.position_ids, packed.cu_seqlens)  # [N, V]
        width = max(map(len, SEQS))
        ids, mask = (
            torch.zeros(len(SEQS), width, dtype=torch.long),
            torch.zeros(len(SEQS), width, dtype=torch.long),
        )
        for i, s in enumerate(SEQS):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        ref = hf(input_ids=ids, attention_mask=mask).logits  # [B, L, V] right-padded
    cu = packed.cu_seqlens.tolist()
    for i, s in enumerate(SEQS):
        assert_close(logits[cu[i] : cu[i + 1]], ref[i, : len(s)], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sequence_log_probs_equal_log_softmax(family):
    hf = tiny_model(family, seed=2)
    ours = from_hf_model(hf)
    got = sequence_log_probs(ours, SEQS, chunk=7)
    for s, lp in zip(SEQS, got):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([s])).logits[0, :-1], -1).gather(
                -1, torch.tensor(s[1:])[:, None]
            )[:, 0]
        assert lp.shape == (len(s) - 1,)
        assert_close(lp.detach(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_logprob_gradients_equal_naive(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(50, 16, generator=g) * 0.1).requires_grad_()  # LM-head scale
    targets = torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    naive = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (naive * upstream).sum().backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logp, entropy = chunked_token_logprobs(hidden, weight, targets, chunk=8, temperature=temperature)
    (logp * upstream).sum().backward()
    # float32 rounding of a different order of the same products: a few ulps
    assert_close(logp, naive, atol=1e-6, rtol=1e-6)
    assert_close(hidden.grad, gh, atol=1e-6, rtol=1e-6)
    assert_close(weight.grad, gw, atol=1e-6, rtol=1e-6)
    probs = torch.softmax(hidden.detach() @ weight.detach().T / temperature, -1)
    assert_close(entropy, -(probs * probs.log()).sum(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])  # a tied head, an untied one
def test_round_trip_hf_to_ours_to_hf_is_identical(tmp_path, family):
    """to_hf_model builds the transformers model without its random initialisation: every weight
    comes from ours (a tied head tied again), and its forward is the original's."""
    hf = tiny_model(family, seed=4)
    back = to_hf_model(from_hf_model(hf), hf.config)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    assert torch.equal(back(ids).logits, hf(ids).logits)
    save_hf(back, byte_tokenizer(), tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    original = hf.state_dict()
    assert all(torch.equal(original[k], v) for k, v in reloaded.state_dict().items())


def test_weights_that_do_not_fill_the_model_stop_the_conversion():
    """A weight left out would be uninitialised memory in the model built without random init."""
    hf = tiny_model("llama3", seed=4)
    state = from_hf_model(hf).state_dict()
    del state["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"not in them \['model.layers.0.mlp.up_proj.weight'\]"):
        to_hf_model(state, hf.config)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])  # a tied head, an untied one
def test_a_shared_conversion_holds_no_second_copy_until_moved(family):
    """build_models converts the loaded model on the CPU sharing its tensors, then moves ours: only
    ours reaches the GPU. Shared, ours reads the same storage and computes the same logits; a tied
    head stays one parameter; a move (a copy here: to float64) leaves the loaded model as it was."""
    hf = tiny_model(family, seed=2)
    ours = from_hf_model(hf, share=True)
    hf_state = hf.state_dict()
    for name, p in ours.named_parameters():
        assert p.data_ptr() == hf_state[name].data_ptr(), name
    tied = hf.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    packed = pack_sequences(SEQS)
    with torch.no_grad():
        assert_close(
            ours(packed.input_ids, packed.position_ids, packed.cu_seqlens),
            from_hf_model(hf)(packed.input_ids, packed.position_ids, packed.cu_seqlens),
            atol=0,
            rtol=0,
        )
        before = hf.model.embed_tokens.weight.clone()
        moved = ours.to(torch.float64)
        moved.model.embed_tokens.weight.add_(1.0)
    assert hf.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(hf.model.embed_tokens.weight, before)
    assert (moved.lm_head.weight is moved.model.embed_tokens.weight) == tied


def test_load_causal_lm_native_and_auto(tiny_dir):
    model, _ = load_causal_lm(str(tiny_dir), impl="native")
    assert type(model).__name__ == "NativeCausalLM"
    assert type(load_causal_lm(str(tiny_dir), impl="auto")[0]).__name__ == "NativeCausalLM"
    assert type(load_causal_lm(str(tiny_dir), impl="hf")[0]).__name__ == "LlamaForCausalLM"
    with pytest.raises(UserError, match="unknown"):
        load_causal_lm(str(tiny_dir), impl="fast")


def test_unsupported_family_is_refused_natively(tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=300)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(UserError, match="model type 'gpt2' has no native implementation"):
        load_causal_lm(str(tmp_path), impl="native")
    assert type(load_causal_lm(str(tmp_path), impl="auto")[0]).__name__ == "GPT2LMHeadModel"


@pytest.mark.slow
def test_default_model_greedy_continuation_matches_transformers():
    hf, tok = load_causal_lm("default", impl="hf")
    ours = from_hf_model(hf)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids) :].tolist()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(10):
            packed = pack_sequences([seq])
            seq.append(int(ours(packed.input_ids, packed.position_ids, packed.cu_seqlens)[-1].argmax()))
    assert seq[len(ids) : len(ids) + len(expected)] == expected  # transformers stops at EOS


def test_balance_partitions_bound():
    rng = random.Random(0)
    for _ in range(30):
        lengths = [rng.randint(1, 4000) for _ in range(rng.randint(8, 64))]
        parts = rng.choice([2, 4, 8])
        groups = balance_partitions(lengths, parts)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        work = [sum(n + n * n / 4096 for n in (lengths[i] for i in g)) for g in groups]
        longest = max(n + n * n / 4096 for n in lengths)
        # LPT guarantee: max load <= mean load + the largest single item
        assert max(work) <= sum(work) / parts + longest + 1e-6
    assert balance_partitions([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]
