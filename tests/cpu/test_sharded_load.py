"""A model read shard by shard (parallel/sharded_load.py), gloo, 2 ranks on CPU: from a bf16
safetensors checkpoint into fp32 FSDP2 shards, and into FSDP2 x TP, each rank's shard equals the
whole loaded model's slice bit for bit, for a tied and an untied family; each rank holds only its
part. The trainer reads its FSDP2-sharded reference that way (the runs: test_distributed_trainer.py,
two workers with a KL loss equal one process), and the memory plan's load phase counts a shard."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from hybridflow.controller.worker_group import free_address
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.parallel.sharded_load import load_sharded, safetensors_dir, shardable_config


def _rank(rank: int, world: int, port: int, directory: str) -> None:
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
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
        dist.barrier()  # neither rank tears down while the other still works (rank 0 hosts the store)
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_read_shard_by_shard_equals_the_whole_models_shards(tmp_path):
    for family in ("qwen2", "llama3"):  # a tied LM head, an untied one
        directory = tmp_path / family
        tiny_model(family, seed=3).to(torch.bfloat16).save_pretrained(directory)
        assert shardable_config(safetensors_dir(str(directory))).tie_word_embeddings == (family == "qwen2")
        mp.spawn(_rank, args=(2, free_address()[1], str(directory)), nprocs=2, join=True)


def test_what_cannot_be_read_shard_by_shard_is_read_whole(tmp_path):
    assert safetensors_dir(None) is None and safetensors_dir(str(tmp_path)) is None  # no checkpoint
    assert safetensors_dir("default") is None  # the embedded GGUF
    moe = tmp_path / "moe"
    tiny_model("qwen3_moe", seed=1).save_pretrained(moe)
    assert safetensors_dir(str(moe)) is not None and shardable_config(moe) is None  # experts stored apart
