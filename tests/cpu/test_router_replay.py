"""Router replay for mixture-of-experts policies. R3: the engine keeps the experts every token went
to beside its K/V and hands them out with each sample; the trainer's forward routes the same tokens
to the same experts, its router still weighting them (so the router trains). R2: the trainer's own
old-log-prob pass records the experts, and every update of the step routes to them."""

import json
import shutil

import pytest
import torch
from torch.testing import assert_close

from hybridflow.batch import pack_sequences, pad_ragged
from hybridflow.engine import Engine, EngineConfig
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.models.native.moe import MoEConfig, SparseMoE
from hybridflow.roles.forward import policy_logprobs
from hybridflow.rollout.sampling import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 60)), [250]]


def _own_routes(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The experts the trainer's forward picks for every token of each sequence, [T, layers, k]."""
    packed = pack_sequences(sequences)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for block in blocks:
        block.record_routing = True
    with torch.no_grad():
        model.hidden_states(packed.input_ids, packed.position_ids, packed.cu_seqlens)
    for block in blocks:
        block.record_routing = False
    routes = torch.stack([block.routing.experts for block in blocks], dim=1)  # [N, layers, k]
    return list(torch.split(routes, [len(s) for s in sequences]))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_engine_records_the_experts_the_trainer_routes_to(family):
    """fp32 on the CPU: the engine's kept routes (prompts prefilled once for their 3 samples, decode
    runs, a pool so small that sequences are preempted and recomputed) equal the trainer's own
    routing of each whole sequence, token for token, for every token but the last."""
    model = from_hf_model(tiny_model(family, seed=3)).eval()
    for kv_tokens in (None, 96):  # 96: 24 pages of 4 for 12 sequences, preemptions
        engine = Engine(
            model,
            eos_token_ids=[1],
            config=EngineConfig(
                page_size=4, max_context_tokens=64, kv_cache_tokens=kv_tokens, record_routes=True
            ),
        )
        out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=20, seed=7))
        assert kv_tokens is None or engine.stats["preemptions"] > 0
        sequences = [PROMPTS[g.prompt_index] + g.token_ids for g in out]
        own = _own_routes(model, sequences)
        for g, seq, mine in zip(out, sequences, own):
            assert g.routed_experts.shape == (len(seq) - 1, len(model.config.moe.sparse_layers), 2)
            assert torch.equal(g.routed_experts.long(), mine[:-1])


def test_recorded_routes_are_refused_for_a_dense_model():
    with pytest.raises(UserError, match="mixture-of-experts models only"):
        Engine(
            from_hf_model(tiny_model("llama", seed=0)),
            eos_token_ids=[1],
            config=EngineConfig(record_routes=True),
        )


def _block(norm_topk_prob: bool) -> SparseMoE:
    torch.manual_seed(0)
    block = SparseMoE(8, MoEConfig(num_experts=4, top_k=2, intermediate_size=6, norm_topk_prob=norm_topk_prob,
                                   sparse_layers=(0,)))  # fmt: skip
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replayed_experts_are_weighted_by_the_router_and_train_it(norm_topk_prob):
    """Token 0 replays experts (3, 0), token 1 is free (-1); the output equals the experts computed
    by hand with the router's probabilities of the replayed experts, the free token's is the one
    without replay, and the router's weight gets a gradient through the replayed experts."""
    block = _block(norm_topk_prob)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    free = block(x)
    probs = torch.softmax(x @ block.gate.weight.T, -1)
    assert set(torch.topk(probs[0], 2).indices.tolist()) != {0, 3}, "replay would change nothing"
    out = block(x, torch.tensor([[3, 0], [-1, -1]]))
    assert_close(out[1], free[1])  # a free token routes as without replay

    def expert(e, v):
        gate, up = (block.experts.gate_up_proj[e] @ v).chunk(2)
        return block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)

    w = probs[0, [3, 0]]
    w = w / w.sum() if norm_topk_prob else w
    assert_close(out[0], w[0] * expert(3, x[0]) + w[1] * expert(0, x[0]), atol=1e-6, rtol=1e-5)
    out[0].sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_replay_brings_the_trainer_back_to_the_engine_where_routing_flipped(family):
    """The engine in bf16, the trainer in fp32 (the mismatch of a GPU run): a few tokens' routing
    flips between the two, and replaying the engine's experts takes the largest log-prob gap down
    to the rounding noise of the tokens whose routing did not flip."""
    model = from_hf_model(tiny_model(family, seed=3)).eval()
    config = EngineConfig(page_size=4, max_context_tokens=96, compute_dtype="bfloat16", record_routes=True)
    out = Engine(model, eos_token_ids=[1], config=config).generate(
        PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=7)
    )
    prompts, responses = [PROMPTS[g.prompt_index] for g in out], [g.token_ids for g in out]
    routes = [g.routed_experts for g in out]
    flips = sum(
        (own[:-1].sort(-1).values != kept.long().sort(-1).values).any(-1).sum()
        for own, kept in zip(_own_routes(model, [p + r for p, r in zip(prompts, responses)]), routes)
    )
    assert flips > 0, "no routing flipped: the test shows nothing"
    engine = pad_ragged([g.logprobs for g in out])
    gaps = {}
    for name, replay in (("free", None), ("replayed", routes)):
        with torch.no_grad():
            lp, _ = policy_logprobs(model, prompts, responses, device=torch.device("cpu"),
                                    compute_dtype="float32", pad_token_id=0, routes=replay)  # fmt: skip
        gaps[name] = (lp - engine)[engine != 0].abs().max().item()
    assert gaps["replayed"] < gaps["free"] / 1.5, gaps


def test_a_replaying_run_recomputes_the_engine_s_log_probs(setup, tmp_path):
    """fp32 on the CPU, where engine and trainer route alike: a GRPO run replaying the engine's experts
    (two mini-batches a step, so old log-probs are recomputed; checkpointed layers recompute their
    forward with the routes) gets the engine's log-probs back to fp32 rounding at every step: a
    misaligned route (another token's or sequence's experts) moves a log-prob by ~1e-2."""
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.models import byte_tokenizer, save_hf

    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "model")
    run = tmp_path / "run"
    c = config(setup, run, f"model.path={tmp_path / 'model'}", "actor.sequences_per_update=16",
               "model.enable_gradient_checkpointing=true", "actor.router_replay=R3",
               "trainer.total_training_steps=2")  # fmt: skip
    RLTrainer(c).fit()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["router_replay/recorded_fraction"] for m in metrics] == [1.0, 1.0]
    assert all(m["training/rollout_probs_diff_max"] < 1e-5 for m in metrics)
    assert all(m["actor/grad_norm"] > 0 for m in metrics)


def test_an_asynchronous_run_hands_its_groups_routes_to_the_trainer(setup, tmp_path):
    """trainer.async_mode=one_step: groups come from the stream (the engine's per-step outputs), and
    every sample still carries its routes to the trainer, across a resume too."""
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.models import byte_tokenizer, save_hf

    save_hf(tiny_model("mixtral", seed=0), byte_tokenizer(), tmp_path / "model")
    args = [f"model.path={tmp_path / 'model'}", "actor.router_replay=R3", "trainer.async_mode=one_step",
            "trainer.val_before_train=false", "trainer.save_freq=1", "trainer.keep_last_checkpoints=3",
            "trainer.total_training_steps=3"]  # fmt: skip

    def metrics(run):
        RLTrainer(config(setup, run, *args)).fit()
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    whole = metrics(tmp_path / "whole")
    assert [m["router_replay/recorded_fraction"] for m in whole] == [1.0, 1.0, 1.0]
    # step 2's checkpoint keeps step 3's groups, finished (one_step), with their routes; a run resumed
    # from it replays them, and its step 3 is the uninterrupted run's
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "global_step_3")
    state = json.loads(
        (tmp_path / "cut" / "checkpoints" / "global_step_2" / "trainer_state.json").read_text()
    )
    kept = [sample for group in state["in_flight"].values() for sample in group]
    assert kept and all(sample["finish"] and sample["routes"]["shape"][1:] == [2, 2] for sample in kept)
    resumed = metrics(tmp_path / "cut")
    assert resumed[2]["router_replay/recorded_fraction"] == 1.0
    same = [k for k in whole[2] if not k.startswith(("timing", "perf/", "async/", "reward/latency"))]
    assert {k: resumed[2][k] for k in same} == {k: whole[2][k] for k in same}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor.router_replay=R2"],
            "R2 replays a mixture-of-experts policy's routing, and this policy has no",
        ),
        (
            ["actor.router_replay=R2", "algorithm.rollout_correction.bypass_mode=true"],
            "bypass_mode=true skips",
        ),
        (["actor.router_replay=R2", "actor.sequence_parallel_size=2"], "R2 does not split its routes"),
        (["actor.router_replay=R3"], "this policy is dense"),
        (["actor.router_replay=R3", "rollout.backend=hf"], "needs the experts our engine records"),
        (["actor.router_replay=R3", "actor.sequence_parallel_size=2"], "sequence_parallel_size > 1"),
    ],
)
def test_replay_where_it_cannot_work_is_refused_in_one_line(setup, tmp_path, overrides, message):
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer

    with pytest.raises(UserError, match=message):
        RLTrainer(config(setup, tmp_path / "run", *overrides))


def test_replay_with_an_agent_loop_is_refused(setup, tmp_path):
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.models import byte_tokenizer, save_hf

    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "model")
    c = config(setup, tmp_path / "run", f"model.path={tmp_path / 'model'}", "actor.router_replay=R3",
               "rollout.agent.loop=environment", "rollout.agent.environment=guess_number",
               "reward.custom_function_path=null")  # fmt: skip
    with pytest.raises(
        UserError,
        match="actor.router_replay=R3 with rollout.agent.loop=environment: R3 with agent loops is not built",
    ):
        RLTrainer(c)


def test_r2_updates_route_as_the_old_policy_pass_did_after_the_router_moved():
    """The old-log-prob pass records each sequence's experts (those of a plain forward, the last token
    left free); once the routers move, as an update moves them, a free forward routes some tokens
    elsewhere and the R2 forward still routes every recorded token to pi_old's experts."""
    from hybridflow.batch import TrainingBatch
    from hybridflow.config.sections_training import ActorConfig
    from hybridflow.roles.actor import Actor

    torch.manual_seed(0)
    model = from_hf_model(tiny_model("qwen3_moe", seed=0))
    responses = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16]]
    sequences = [p + r for p, r in zip(PROMPTS, responses)]
    actor = Actor(model, ActorConfig(router_replay="R2", compute_dtype="float32", max_tokens_per_microbatch=40),
                  total_steps=1, max_response_tokens=4, pad_token_id=0)  # fmt: skip
    batch = TrainingBatch(PROMPTS, responses, pad_ragged([torch.ones(len(r)) for r in responses]))
    routes = [None] * len(batch)
    actor.log_probs(batch, routes=routes)  # micro-batches of <= 40 tokens: the 36-token sequence alone
    for recorded, own in zip(routes, _own_routes(model, sequences), strict=True):
        assert recorded.dtype == torch.int16 and torch.equal(recorded.long(), own[:-1])
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    with torch.no_grad():
        for block in blocks:
            block.gate.weight.add_(torch.randn_like(block.gate.weight))
    moved = _own_routes(model, sequences)
    assert any(not torch.equal(m[:-1], r.long()) for m, r in zip(moved, routes))
    batch.routed_experts = routes
    for block in blocks:
        block.record_routing = True
    with torch.no_grad():
        actor._forward(batch, with_entropy=False)
    used = torch.split(torch.stack([b.routing.experts for b in blocks], dim=1), [len(s) for s in sequences])
    for replayed, recorded in zip(used, routes, strict=True):
        assert torch.equal(replayed[:-1], recorded.long())


def test_an_r2_run_records_pi_old_s_routing_when_there_is_one(setup, tmp_path):
    """Two mini-batches a step: pi_old's pass runs and records its experts for both updates
    (recorded_fraction 1); one update on-policy: the update's forward is pi_old's own pass, so
    nothing is recorded or replayed (0)."""
    from rl_run import config

    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.models import byte_tokenizer, save_hf

    save_hf(tiny_model("qwen3_moe", seed=0), byte_tokenizer(), tmp_path / "model")
    for name, per_update, recorded in (("two", 16, 1.0), ("one", 32, 0.0)):
        run = tmp_path / name
        c = config(setup, run, f"model.path={tmp_path / 'model'}", f"actor.sequences_per_update={per_update}",
                   "actor.router_replay=R2", "trainer.total_training_steps=2")  # fmt: skip
        RLTrainer(c).fit()
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["router_replay/recorded_fraction"] for m in metrics] == [recorded, recorded], name
        assert all(m["actor/grad_norm"] > 0 for m in metrics), name
