"""What CPU CI cannot check, on a real GPU: the engine's fused decode step under CUDA graphs against
the same step run eagerly, the engine's bf16 log-probs against the trainer's forward, Triton's kernels
against their PyTorch references, the native model against transformers in bf16, and GRPO runs on
CUDA (synchronous, and streaming with the engine pausing for training).

    pytest tests/gpu -m gpu          # a few minutes on one H100/H200; skipped without CUDA
"""

import json
import random

import pytest
import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.attention import paged_decode_attention_reference
from hybridflow.engine.sampler import sample_reference, step_keys
from hybridflow.engine.triton_decode import paged_decode_attention_triton
from hybridflow.engine.triton_sampler import sample_triton
from hybridflow.models import byte_tokenizer, native, save_hf, tiny_model
from hybridflow.roles.forward import packed_response_logprobs
from hybridflow.rollout.sampling import SamplingParams

CUDA = torch.device("cuda")
SHAPE = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip


def _policy():
    """A small random Qwen2 as the trainer holds it: fp32 master weights on the GPU."""
    hf = tiny_model("qwen2", seed=0, **SHAPE)
    return hf, native.from_hf_model(hf).to(CUDA).eval()


def _prompts(vocab: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 120))] for _ in range(count)]


def _engine(model, **options) -> Engine:
    config = EngineConfig(max_context_tokens=512, page_size=64, gpu_memory_utilization=0.1, **options)
    return Engine(model, eos_token_ids=[], config=config, device=CUDA)


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=48),
    "t=1": SamplingParams(n=2, temperature=1.0, max_tokens=48, seed=3),
    "t=0.7 with stops": SamplingParams(
        n=2, temperature=0.7, max_tokens=48, seed=5, stop_token_ids=list(range(3, 250, 9))
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(PARAMS))
def test_cuda_graph_decode_is_the_eager_decode_token_for_token(name):
    """The fused step captured in CUDA graphs (runs of steps, the draw and stop check on the device)
    runs the same kernels as the eager step: the same tokens and log-probs, bit for bit."""
    _, model = _policy()
    prompts = _prompts(model.config.vocab_size)
    outs = {
        graphs: _engine(model, cuda_graphs=graphs).generate(prompts, PARAMS[name]) for graphs in (True, False)
    }
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert [o.unscaled_logprobs for o in outs[True]] == [o.unscaled_logprobs for o in outs[False]]
    assert sum(len(o.token_ids) for o in outs[True]) > len(prompts)  # it decoded


@pytest.mark.parametrize("fused", [True, False])
def test_engine_log_probs_are_the_trainer_s_within_bf16(fused):
    """The engine (its bf16 copy; fused kernels or the trainer's modules) against the trainer's packed
    forward under bf16 autocast, on the tokens the engine sampled."""
    _, model = _policy()
    prompts = _prompts(model.config.vocab_size)
    outs = _engine(model, fused_decode=fused).generate(prompts, PARAMS["t=1"])
    with torch.no_grad():
        trainer, _ = packed_response_logprobs(
            model, [prompts[o.prompt_index] for o in outs], [o.token_ids for o in outs],
            device=CUDA, compute_dtype="auto",
        )  # fmt: skip
    gaps = torch.cat([(trainer[i, : len(o.token_ids)].cpu() - torch.tensor(o.unscaled_logprobs)).abs()
                      for i, o in enumerate(outs)])  # fmt: skip
    assert gaps.mean().item() < 0.02 and gaps.max().item() < 0.3, (gaps.mean().item(), gaps.max().item())


def test_triton_decode_attention_and_sampler_match_their_references():
    torch.manual_seed(0)
    # (batch, q heads, kv heads, head dim, page, pages a row): one split and several, padded rows
    for b, hq, hkv, d, page, pages in [(3, 4, 2, 64, 16, 5), (64, 14, 2, 64, 64, 9), (1, 8, 8, 128, 32, 40)]:
        k, v = (torch.randn(64 * page, hkv, d, device=CUDA, dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(b, hq, d, device=CUDA, dtype=torch.bfloat16)
        table = torch.randint(1, 64, (b, pages), dtype=torch.int32, device=CUDA)
        ctx = torch.randint(0, pages * page + 1, (b,), dtype=torch.int32, device=CUDA)
        ctx[0] = pages * page
        got = paged_decode_attention_triton(q, k, v, table, ctx, page).float()
        want = paged_decode_attention_reference(q.float(), k.float(), v.float(), table, ctx, page)
        assert (got - want).abs().max().item() < 2e-2, (b, hq, hkv, d)
    logits = torch.randn(64, 151936, device=CUDA) * 3
    seeds, steps = torch.arange(64, device=CUDA) * 77 + 1, torch.arange(64, device=CUDA)
    for t in (0.0, 0.7, 1.0):
        ref = sample_reference(logits, SamplingParams(temperature=t), seeds, steps)
        got = sample_triton(logits, t, step_keys(seeds, steps))
        assert torch.equal(ref[0], got[0]), t  # the same draws: the noise is a hash of seed and step
        assert max((r - g).abs().max().item() for r, g in zip(ref[1:], got[1:])) < 1e-4


def test_native_model_equals_transformers_on_cuda():
    """The trainer's way (fp32 master weights under bf16 autocast; flash attention takes no fp32) and
    bf16 weights: the log-probabilities of transformers' fp32 forward within bf16's rounding."""
    hf, model = _policy()
    hf = hf.to(CUDA).eval()
    ids = torch.tensor([_prompts(hf.config.vocab_size, 1)[0]], device=CUDA)
    positions = torch.arange(ids.shape[1], device=CUDA)
    bounds = torch.tensor([0, ids.shape[1]], dtype=torch.int32, device=CUDA)
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits[0].float(), -1)  # [T, V]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            autocast = torch.log_softmax(model(ids[0], positions, bounds).float(), -1)
        bf16 = torch.log_softmax(model.to(torch.bfloat16)(ids[0], positions, bounds).float(), -1)
    for got in (autocast, bf16):
        gap = (got - want).abs()
        assert gap.mean().item() < 0.02 and gap.max().item() < 0.2, (gap.mean().item(), gap.max().item())


@pytest.mark.parametrize(
    "mode",
    [
        ["trainer.async_mode=off"],
        ["trainer.async_mode=streaming", "rollout.max_staleness=1"],
        ["model.lora_rank=16", "model.lora_alpha=32", "actor.optim.lr=2e-3", "actor.offload_params=true"],
    ],
    ids=["synchronous", "streaming", "lora_offloaded"],
)
def test_a_grpo_run_on_cuda_learns_and_keeps_engine_and_trainer_together(tmp_path, mode):
    """8 GRPO steps of a small random model on the reward 'share of the letter a': the reward rises,
    the engine's log-probs stay the trainer's (bf16), the weight check agrees after every sync."""
    from hybridflow.config import load_config
    from hybridflow.controller.trainer import RLTrainer

    hf, _ = _policy()
    save_hf(hf, byte_tokenizer(), tmp_path / "model", overwrite=True)
    (tmp_path / "prompts.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"question {i}", "data_source": "synthetic"}) for i in range(256))
    )
    (tmp_path / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return solution_str.count('a') / max(len(solution_str), 1)\n"
    )
    config = load_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{tmp_path / 'prompts.jsonl'}]",
        "data.prompts_per_step=16", "data.max_response_tokens=32", "rollout.samples_per_prompt=8",
        "actor.optim.lr=3e-4", f"reward.custom_function_path={tmp_path / 'reward.py'}", "resources.device=cuda",
        "trainer.total_training_steps=8", "trainer.logger=[jsonl]", f"trainer.run_dir={tmp_path / 'run'}",
        "trainer.guards.weight_sync_check=true", "reward.num_workers=0", *mode,
    ])  # fmt: skip
    RLTrainer(config).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    assert len(steps) == 8
    assert max(r["training/rollout_probs_diff_max"] for r in steps) < 0.2
    first, last = (sum(r["critic/score/mean"] for r in part) / 2 for part in (steps[:2], steps[-2:]))
    assert last > first + 0.02, (first, last)
