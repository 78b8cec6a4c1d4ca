"""Mixture-of-experts policies (Qwen3-MoE, Mixtral) in the native model: gradients and the routers'
load-balancing loss equal transformers', and a GRPO run trains one end to end (engine included).
Logits, greedy generation and the export round trip are covered for every family in
test_native_model.py, test_engine.py and test_models.py."""

import json

import pytest
import torch
from torch.testing import assert_close

from hybridflow.batch import pack_sequences
from hybridflow.models import byte_tokenizer, save_hf, tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.models.native.moe import SparseMoE, load_balancing_loss

SEQS = [[5, 9, 200, 17, 3, 8, 77], [44, 2, 2, 90], list(range(30, 52))]


def _padded(seqs):
    width = max(map(len, seqs))
    ids, mask = (
        torch.zeros(len(seqs), width, dtype=torch.long),
        torch.zeros(len(seqs), width, dtype=torch.long),
    )
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gradients_of_router_and_experts_equal_transformers(family):
    hf = tiny_model(family, seed=4)
    ours = from_hf_model(hf).train()
    packed = pack_sequences(SEQS)
    weights = torch.randn(packed.num_tokens, hf.config.vocab_size, generator=torch.Generator().manual_seed(0))
    (ours(packed.input_ids, packed.position_ids, packed.cu_seqlens) * weights).sum().backward()
    ids, mask = _padded(SEQS)
    logits = hf.train()(input_ids=ids, attention_mask=mask).logits
    cu = packed.cu_seqlens.tolist()
    sum(
        (logits[i, : len(s)] * weights[cu[i] : cu[i + 1]]).sum() for i, s in enumerate(SEQS)
    ).backward()  # the same weighted sum over the real tokens
    theirs = dict(hf.named_parameters())
    sparse = [n for n, _ in ours.named_parameters() if ".experts." in n or ".mlp.gate." in n]
    assert sparse, "no expert parameters"
    for name, p in ours.named_parameters():
        assert_close(p.grad, theirs[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_grouped_gemm_gives_the_per_expert_loop_s_outputs_and_gradients():
    """The path CUDA takes in bf16 (one grouped GEMM, no host sync), forced here in fp32 on the CPU
    against the loop over experts; one expert gets no token."""
    from hybridflow.models.native.moe import MoEConfig

    torch.manual_seed(0)
    block = SparseMoE(
        16, MoEConfig(num_experts=4, top_k=2, intermediate_size=8, norm_topk_prob=True, sparse_layers=(0,))
    )
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.no_grad():
        block.gate.weight[3] = -10.0  # expert 3 never chosen (the inputs below are positive)
    x = torch.rand(12, 16) + 0.1
    results = []
    for grouped in (False, True):
        block.experts.grouped_gemm = grouped
        block.zero_grad()
        inputs = x.clone().requires_grad_()
        out = block(inputs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, inputs.grad, [p.grad.clone() for p in block.parameters()]))
    (loop_out, loop_dx, loop_dw), (gemm_out, gemm_dx, gemm_dw) = results
    assert_close(gemm_out, loop_out, atol=1e-6, rtol=1e-5)
    assert_close(gemm_dx, loop_dx, atol=1e-6, rtol=1e-5)
    for a, b in zip(gemm_dw, loop_dw, strict=True):
        assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert loop_dw[1][3].abs().max() == 0  # the unused expert's gate/up gradient


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_equals_transformers(family):
    hf = tiny_model(family, seed=5)
    ours = from_hf_model(hf)
    blocks = [m for m in ours.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        block.record_routing = True
    ids = torch.tensor([SEQS[2]])
    with torch.no_grad():
        ours(ids[0], torch.arange(ids.shape[1]), torch.tensor([0, ids.shape[1]], dtype=torch.int32))
        expected = hf(input_ids=ids, output_router_logits=True).aux_loss
    got = load_balancing_loss([b.routing for b in blocks], blocks[0].num_experts, blocks[0].top_k)
    assert len(blocks) == (1 if family == "qwen3_moe" else 2)  # Qwen3-MoE's first layer is dense here
    assert_close(got, expected.float(), atol=1e-6, rtol=1e-5)
    # a near-uniform router with balanced choices gives E x (k x E terms of 1/E x 1/E) = top_k
    assert got.item() == pytest.approx(blocks[0].top_k, rel=0.5)


def test_a_moe_policy_trains_with_grpo_and_its_load_balancing_loss(tmp_path):
    from hybridflow.config import load_config
    from hybridflow.controller.trainer import RLTrainer

    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "model")
    rows = [{"prompt": f"q{i}", "data_source": "synthetic"} for i in range(16)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return solution_str.count('a') / max(len(solution_str), 1)\n"
    )
    run = tmp_path / "run"
    config = load_config(
        None,
        [
            f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'prompts.jsonl'}]",
            "data.max_response_tokens=12", "data.prompts_per_step=4", "rollout.samples_per_prompt=4",
            "actor.optim.lr=1e-2", "actor.compute_dtype=float32", "actor.router_aux_loss_coef=0.01",
            f"reward.custom_function_path={tmp_path / 'reward.py'}", "reward.num_workers=0",
            "trainer.logger=[jsonl]", f"trainer.run_dir={run}", "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
        ],
    )  # fmt: skip
    RLTrainer(config).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.5 < m["actor/moe_aux_loss"] < 4.0 for m in metrics)  # top_k = 2 when balanced
    # the engine sampled with the policy's own experts: the trainer's probabilities agree
    assert all(m["training/rollout_probs_diff_max"] < 1e-4 for m in metrics)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "global_step_2" / "policy")
    trained = dict(exported.named_parameters())
    start = dict(tiny_model("qwen3_moe", seed=0).named_parameters())
    moved = [n for n in trained if ".experts." in n and not torch.equal(trained[n], start[n])]
    assert moved, "the experts did not train"


def test_a_load_balancing_weight_on_a_dense_policy_is_refused(setup, tmp_path):
    """Set for a model without routers it would train nothing: one line says so."""
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.errors import UserError

    with pytest.raises(UserError, match="router_aux_loss_coef=0.01 trains mixture-of-experts routers"):
        RLTrainer(config(setup, tmp_path, "actor.router_aux_loss_coef=0.01"))
