"""A model read shard by shard (parallel/sharded_load.py), gloo, 2 ranks on CPU: from a bf16
safetensors checkpoint into fp32 FSDP2 shards, and into FSDP2 x TP, each rank's shard equals the
whole loaded model's slice bit for bit, for a tied and an untied family and for MoE checkpoints
read expert by expert (FSDP2, expert parallel, FSDP2 x TP); each rank holds only its
part. The trainer reads its FSDP2-sharded reference that way (the runs: test_distributed_trainer.py,
two workers with a KL loss equal one process), and the memory plan's load phase counts a shard."""

import pytest
import torch
import torch.multiprocessing as mp
from gloo_ranks import gloo_group
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from hybridflow.controller.worker_group import free_address
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.parallel.sharded_experts import (
    checkpoint_keys,
    expert_sources,
    pop_expert_tensors,
    read_expert_tensors,
)
from hybridflow.parallel.sharded_load import load_sharded, safetensors_dir, shardable_config


def _rank(rank: int, world: int, port: int, directory: str) -> None:
    with gloo_group(rank, world, port):
        path = safetensors_dir(directory)
        whole = from_hf_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).state_dict()
        config = shardable_config(path)
        fsdp = load_sharded(
            path, config, torch.float32, mesh=init_device_mesh("cpu", (2,)), device=torch.device("cpu")
        )
        grid = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        fsdp_tp = load_sharded(
            path, config, torch.float32, mesh=grid["dp"], tp_mesh=grid["tp"], device=torch.device("cpu")
        )
        for model in (fsdp, fsdp_tp):
            state = model.state_dict()
            assert state.keys() == whole.keys()
            held = 0
            for name, param in state.items():
                assert param.dtype == torch.float32
                assert torch.equal(param.full_tensor(), whole[name]), name
                held += (
                    param.to_local().numel()
                    if name != "lm_head.weight" or not config.tie_word_embeddings
                    else 0
                )
            total = sum(
                v.numel() for k, v in whole.items() if k != "lm_head.weight" or not config.tie_word_embeddings
            )
            assert held < 0.6 * total  # about half each (rows that do not split evenly round up)
        assert fsdp.lm_head.weight is fsdp.model.embed_tokens.weight or not config.tie_word_embeddings


def test_a_checkpoint_read_shard_by_shard_equals_the_whole_models_shards(tmp_path):
    for family in ("qwen2", "llama3"):  # a tied LM head, an untied one
        directory = tmp_path / family
        tiny_model(family, seed=3).to(torch.bfloat16).save_pretrained(directory)
        assert shardable_config(safetensors_dir(str(directory))).tie_word_embeddings == (family == "qwen2")
        mp.spawn(_rank, args=(2, free_address()[1], str(directory)), nprocs=2, join=True)


def _moe_rank(rank: int, world: int, port: int, checkpoints: list[tuple[str, list[str]]]) -> None:
    with gloo_group(rank, world, port):
        for directory, layouts in checkpoints:
            _check_moe_layouts(safetensors_dir(directory), layouts, world)


def _check_moe_layouts(path, layouts: list[str], world: int) -> None:
    whole = from_hf_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)).state_dict()
    config, cpu = shardable_config(path), torch.device("cpu")
    for layout in layouts:
        if layout == "fsdp":  # FSDP2 alone: experts split by rows of [E, ...] like any weight
            model = load_sharded(
                path, config, torch.float32, mesh=init_device_mesh("cpu", (world,)), device=cpu
            )
        elif layout == "ep":  # expert parallel over all ranks, FSDP2 for the rest
            mesh = init_device_mesh("cpu", (world,))
            model = load_sharded(
                path, config, torch.float32, mesh=mesh, device=cpu, expert_parallel_size=world
            )
        else:  # "dp x tp": TP splits the experts whole, FSDP2 splits each TP rank's experts again
            grid = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            model = load_sharded(path, config, torch.float32, mesh=grid["dp"], tp_mesh=grid["tp"], device=cpu)
        state = model.state_dict()
        assert state.keys() == whole.keys()
        held = total = 0
        for name, param in state.items():
            assert torch.equal(param.full_tensor(), whole[name]), (path.name, layout, name)
            if ".experts." in name:
                held, total = held + param.to_local().numel(), total + whole[name].numel()
        experts = config.moe.num_experts
        assert held * experts <= -(-experts // world) * total, layout  # its own experts alone


def test_an_moe_checkpoint_is_read_expert_by_expert_into_every_layout(tmp_path):
    """Checkpoints store each expert apart (Qwen3-MoE `mlp.experts.{e}.gate_proj`, Mixtral
    `block_sparse_moe.experts.{e}.w1`, and its router renamed); each rank reads the experts its
    shards hold, under FSDP2, expert parallelism and TP (2 dp x 2 tp: FSDP2 splits each TP rank's
    experts again), and holds what a whole load then split would. Also three experts over two ranks
    (FSDP2 gives 2 and 1), and a checkpoint that holds the fused tensors under the native names."""
    for family in ("qwen3_moe", "mixtral"):
        tiny_model(family, seed=5).to(torch.bfloat16).save_pretrained(tmp_path / family)
    tiny_model("qwen3_moe", seed=2, num_experts=3).save_pretrained(tmp_path / "uneven")
    fused, hf = tmp_path / "fused", tiny_model("mixtral", seed=4)
    hf.config.save_pretrained(fused)
    state = {k: v.contiguous() for k, v in from_hf_model(hf).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    two = [("qwen3_moe", ["fsdp", "ep", "dp x tp"]), ("mixtral", ["fsdp", "ep"]), ("uneven", ["fsdp"]),
           ("fused", ["fsdp"])]  # fmt: skip
    for world, checkpoints in ((2, two), (4, [("qwen3_moe", ["dp x tp"])])):
        checkpoints = [(str(tmp_path / name), layouts) for name, layouts in checkpoints]
        mp.spawn(_moe_rank, args=(world, free_address()[1], checkpoints), nprocs=world, join=True)


def test_a_checkpoint_without_its_experts_is_refused_by_name(tmp_path):
    directory = tmp_path / "moe"
    tiny_model("qwen3_moe", seed=1).save_pretrained(directory)
    keys = checkpoint_keys(directory)
    assert expert_sources("model.layers.1.mlp.experts.down_proj", keys, 4)[3] == [
        "model.layers.1.mlp.experts.3.down_proj.weight"
    ]
    assert expert_sources("model.layers.1.mlp.gate.weight", keys, 4) is None  # stored under its own name
    # a plain tensor (one process) of the model's shape reads whole; a config wider than the file is refused
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fits = pop_expert_tensors({name: torch.empty(4, 96, 64)}, keys, 4)
    read_expert_tensors(fits, keys)
    from safetensors import safe_open

    with safe_open(keys["model.layers.1.mlp.experts.3.up_proj.weight"], "pt") as f:
        assert torch.equal(fits[name][0][3, 48:], f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(
        UserError, match=r"experts\.0\.gate_proj\.weight has shape \(48, 64\); .* needs \(None, 80\)"
    ):
        read_expert_tensors(pop_expert_tensors({name: torch.empty(4, 96, 80)}, keys, 4), keys)
    broken = {k: v for k, v in keys.items() if ".experts.2.up_proj" not in k}
    with pytest.raises(UserError, match=r"lacks model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        expert_sources("model.layers.1.mlp.experts.gate_up_proj", broken, 4)


def test_what_cannot_be_read_shard_by_shard_is_read_whole(tmp_path):
    assert safetensors_dir(None) is None and safetensors_dir(str(tmp_path)) is None  # no checkpoint
    assert safetensors_dir("default") is None  # the embedded GGUF
    moe = tmp_path / "moe"
    tiny_model("qwen3_moe", seed=1).save_pretrained(moe)
    assert shardable_config(moe).moe.num_experts == 4  # experts stored apart: read expert by expert
