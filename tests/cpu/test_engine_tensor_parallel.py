"""The engine over a tensor-parallel group (engine/tensor_parallel.py), gloo, 2 ranks on CPU: greedy and
sampled tokens equal one whole engine's, log-probs within float32 summation order, each rank holding
half the heads, KV heads and MLP channels (half the experts of an MoE layer, routing as one engine does)
and its rows of a vocabulary (259) that does not split evenly;
weight updates from whole tensors and from a trainer's TP shards land as in one engine (each rank
writing its part only) and gather back to the trainer's weights bit for bit; ranks that
would run different steps stop with one line instead of waiting on each other, as do all ranks when a
decode graph's replay lost a collective (its check, on CPU tensors); a training worker
pair with rollout.tensor_parallel_size=2 builds its engine split (the runs themselves:
test_distributed_trainer.py); four workers with the engine split unlike the actor (TP 2 -> 4, 4 -> 2)
receive their slices of each synced layer; and what a split cannot run with is refused in one line."""

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_ranks import gloo_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing import assert_close

from hybridflow.controller.worker_group import free_address
from hybridflow.controller.worker_models import build_models
from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.tensor_parallel import EngineTP
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.models.native.moe import SparseMoE
from hybridflow.parallel.tensor import apply_tensor_parallel
from hybridflow.rollout.sampling import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8, 77, 258], [44, 2, 2, 90], list(range(30, 52))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=14)
SAMPLED = SamplingParams(n=3, temperature=1.0, max_tokens=14, seed=11)
CONFIG = EngineConfig(max_batch_sequences=8, max_context_tokens=96, page_size=16, share_weights=False)


def _run(engine: Engine, params: SamplingParams) -> tuple[list[list[int]], list[list[float]]]:
    out = engine.generate(PROMPTS, params)
    return [g.token_ids for g in out], [g.logprobs for g in out]


def _same(tp: Engine, one: Engine, what: str) -> list[list[int]]:
    tokens = []
    for params in (GREEDY, SAMPLED):
        (tp_tokens, tp_logp), (tokens_1, logp_1) = _run(tp, params), _run(one, params)
        assert tp_tokens == tokens_1, f"{what}: tokens differ ({'greedy' if params.greedy else 'sampled'})"
        for a, b in zip(tp_logp, logp_1):
            assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=1e-4, msg=what)
        tokens += tp_tokens
    return tokens


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _rank(rank: int, world: int, port: int, families: list[str]) -> None:
    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        for family in families:
            _engine_over_tp_equals_one_engine(family, mesh)
        _ranks_agree_on_a_random_seed_and_stop_when_their_requests_differ(mesh)
        _a_decode_graph_that_lost_a_collective_stops_every_rank(mesh)


def _engine_over_tp_equals_one_engine(family: str, mesh) -> None:
    model = from_hf_model(tiny_model(family, seed=3)).eval()
    eos = [model.config.vocab_size - 1]
    # the whole engine runs the same modules (not the oneDNN layers), so only summation order differs
    one = Engine(model, eos_token_ids=eos, config=replace(CONFIG, fused_decode=False))
    tp = Engine(model, eos_token_ids=eos, config=CONFIG, tp_mesh=mesh)
    c, attn = model.config, tp.model.model.layers[0].self_attn
    assert (attn.heads, attn.kv_heads) == (c.num_attention_heads // 2, c.num_key_value_heads // 2)
    assert tp.cache.k[0].shape[-2] == c.num_key_value_heads // 2, "KV pages of the local KV heads"
    for layer in tp.model.model.layers:
        if isinstance(layer.mlp, SparseMoE):  # half the experts, whole
            assert layer.mlp.experts.gate_up_proj.to_local().shape[0] == c.moe.num_experts // 2
        else:  # half of each projection's channels
            assert layer.mlp.up_proj.weight.to_local().shape[0] == c.intermediate_size // 2
    assert tp.num_pages == one.num_pages
    before = _same(tp, one, family)
    if c.moe is not None:  # the routes kept for router replay: the same experts as one engine's
        routed = [
            [g.routed_experts for g in Engine(model, eos_token_ids=eos, config=replace(cfg, record_routes=True),
                                              tp_mesh=mesh_or_none).generate(PROMPTS, SAMPLED)]
            for cfg, mesh_or_none in ((CONFIG, mesh), (replace(CONFIG, fused_decode=False), None))
        ]  # fmt: skip
        for a, b in zip(*routed):
            assert torch.equal(a, b), f"{family}: the engines routed differently"

    newer = from_hf_model(tiny_model(family, seed=4)).eval()
    for engine in (tp, one):  # whole tensors, as a trainer that gathers its shards sends them
        engine.update_weights(newer.named_parameters())
    after = _same(tp, one, f"{family} after update_weights")
    assert after != before, "the update changed nothing"

    # the trainer's own TP shards (the same plan): each rank copies its part, nothing gathered
    trainer = apply_tensor_parallel(copy.deepcopy(model), mesh)
    written = tp.update_weights(trainer.named_parameters())
    engine = tp.weight_tensors().values()
    mine = sum(
        t.to_local().numel() * t.element_size() if isinstance(t, DTensor) else t.nbytes for t in engine
    )
    whole = sum(t.numel() * t.element_size() for t in engine)
    assert written == mine < 0.6 * whole, "a rank writes its part (and the replicated norms) only"
    if c.tie_word_embeddings:  # in bfloat16 the head keeps its rows in the compute dtype, as a whole copy
        half = Engine(
            model, eos_token_ids=eos, config=replace(CONFIG, compute_dtype="bfloat16"), tp_mesh=mesh
        )
        head, embed = half.model.lm_head.weight, half.model.model.embed_tokens.weight
        assert head.dtype == torch.bfloat16 and embed.dtype == torch.float32
        half.update_weights(newer.named_parameters())  # the embedding's update reaches both
        assert torch.equal(head.to_local(), embed.to_local().to(torch.bfloat16))
        assert torch.equal(_whole(embed), newer.model.embed_tokens.weight)
    trained = dict(trainer.named_parameters())
    for name, t in tp.weight_tensors().items():  # the round trip: the engine's parts gathered = the trainer's
        assert torch.equal(_whole(t), _whole(trained[name])), name
    one.update_weights(model.named_parameters())
    assert _same(tp, one, f"{family} from the trainer's TP shards") == before


def _ranks_agree_on_a_random_seed_and_stop_when_their_requests_differ(mesh) -> None:
    model = from_hf_model(tiny_model("qwen2", seed=3)).eval()
    tp = Engine(model, eos_token_ids=[258], config=CONFIG, tp_mesh=mesh)
    mine = [g.token_ids for g in tp.generate(PROMPTS, SamplingParams(n=2, max_tokens=10))]  # no seed
    every = [None] * mesh.size()
    dist.all_gather_object(every, mine)
    assert all(tokens == every[0] for tokens in every), "ranks sampled different tokens"
    prompt = [7, 8, 9] if mesh.get_local_rank() == 0 else [7, 8, 10]
    with pytest.raises(RuntimeError, match="must be given the same requests"):
        tp.generate([prompt], GREEDY)


def _a_decode_graph_that_lost_a_collective_stops_every_rank(mesh) -> None:
    """The check of a decode graph's first replay against its eager warm-up (CUDA only, so its verdict
    is tried here on what a graph would return): a replay that kept a rank's partial sums, on one rank
    or on all, stops every rank; the collectives' summation order does not."""
    tp, rank = EngineTP(mesh), mesh.get_local_rank()
    partial = torch.randn(4, 259, generator=torch.Generator().manual_seed(rank))  # [B, V] one rank's share
    eager = partial.clone()
    dist.all_reduce(eager, group=tp.group)  # what the step computes: the shares summed
    tp.check_capture(eager, eager + 1e-4 * torch.randn(eager.shape))  # another summation order: passes
    for replayed in (partial, eager if rank == 0 else partial):  # the all-reduce left out of the graph
        with pytest.raises(RuntimeError, match=r"relative difference .* rollout\.cuda_graphs=false"):
            tp.check_capture(eager, replayed)


@pytest.mark.slow
def test_engine_over_two_tensor_parallel_ranks_equals_one_engine():
    # q/k/v biases and a tied head; an untied head (Qwen3's q/k norms run the trainer's TP modules:
    # test_tensor_parallel.py); experts split over the ranks, a dense first layer beside them
    families = ["qwen2", "llama3", "qwen3_moe", "mixtral"]
    mp.spawn(_rank, args=(2, free_address()[1], families), nprocs=2, join=True)


def _worker_rank(rank: int, world: int, port: int, setup, run_dir, actor_tp: int) -> None:
    from rl_run import config

    with gloo_group(rank, world, port):
        c = config(setup, run_dir, "resources.device=cpu", "resources.num_workers=2",
                   f"actor.tensor_parallel_size={actor_tp}", "rollout.tensor_parallel_size=2")  # fmt: skip
        built = build_models(c, world, torch.device("cpu"))
        engine, mc = built.backend, built.hf_config
        assert engine.tp is not None and engine.tp.size == 2
        assert engine.cache.k[0].shape[-2] == mc.num_key_value_heads // 2
        assert engine.model.model.layers[0].self_attn.heads == mc.num_attention_heads // 2


@pytest.mark.slow
@pytest.mark.parametrize("actor_tp", [2, 1])  # over the actor's TP group; over a group of its own
def test_a_training_worker_pair_builds_its_engine_split(setup, tmp_path, actor_tp):
    mp.spawn(
        _worker_rank, args=(2, free_address()[1], setup, tmp_path / "run", actor_tp), nprocs=2, join=True
    )


def _unequal_rank(rank: int, world: int, port: int, setup, model_dir, run_dir):
    from rl_run import config

    from hybridflow.controller.hybrid_worker import HybridWorker

    with gloo_group(rank, world, port):
        for actor_tp, rollout_tp in ((2, 4), (4, 2)):
            c = config(setup, run_dir / f"{actor_tp}-{rollout_tp}", f"model.path={model_dir}", "resources.device=cpu",
                       f"resources.num_workers={world}", f"actor.tensor_parallel_size={actor_tp}",
                       f"rollout.tensor_parallel_size={rollout_tp}")  # fmt: skip
            worker = HybridWorker(c, rank, world, total_steps=1)
            engine = worker.rollout.backend
            assert (
                engine.tp.size == rollout_tp
                and engine.model.model.layers[0].self_attn.heads == 8 // rollout_tp
            )
            model = worker.actor.model
            with torch.no_grad():  # a policy the engine has not seen: every weight moved, shard by shard
                for p in model.parameters():
                    p.mul_(1.5).add_(0.01)
            worker.sync_weights()  # resharded point to point: each engine rank receives what it lacks
            whole = from_hf_model(tiny_model("qwen2", seed=0, num_attention_heads=8, num_key_value_heads=4))
            whole.load_state_dict({n: _whole(p).detach() for n, p in model.named_parameters()}, strict=False)
            one = Engine(
                whole, eos_token_ids=engine.eos_token_ids, config=replace(engine.config, kv_cache_tokens=None)
            )
            _same(engine, one, f"actor TP {actor_tp} -> engine TP {rollout_tp}")


@pytest.mark.slow
def test_an_engine_split_unlike_the_actor_takes_its_slices_of_each_synced_layer(setup, tmp_path):
    """Four workers, the actor split over pairs and the engine over all four, then the reverse: a sync
    after every weight moved leaves each engine generating what one whole engine on the actor's
    gathered weights generates, tokens and log-probs (no rank ever held the whole model)."""
    from hybridflow.models import byte_tokenizer, save_hf

    save_hf(tiny_model("qwen2", seed=0, num_attention_heads=8, num_key_value_heads=4), byte_tokenizer(),
            tmp_path / "model")  # fmt: skip
    args = (4, free_address()[1], setup, tmp_path / "model", tmp_path / "run")
    mp.spawn(_unequal_rank, args=args, nprocs=4, join=True)


@pytest.mark.parametrize(
    "overrides, world, refusal",
    [
        (["actor.tensor_parallel_size=1"], 3, "needs a multiple of 2 training workers"),
        (
            ["actor.tensor_parallel_size=1", "resources.rollout_workers=3"],
            1,
            r"needs a multiple of 2 rollout workers \(resources.rollout_workers\), not 3",
        ),
        (["trainer.async_mode=one_step"], 2, "synchronous generation only"),
        (["rollout.backend=hf"], 2, "rollout.backend=native"),
    ],
)
def test_what_an_engine_split_cannot_run_with_is_refused(setup, tmp_path, overrides, world, refusal):
    from rl_run import config

    c = config(setup, tmp_path / "run", "actor.tensor_parallel_size=2", "rollout.tensor_parallel_size=2",
               *overrides)  # fmt: skip
    with pytest.raises(UserError, match=f"rollout.tensor_parallel_size=2 .*{refusal}"):
        build_models(c, world, torch.device("cpu"))
