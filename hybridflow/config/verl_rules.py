"""The pieces verl's key table (config/aliases.py) is made of: what a key's value becomes
(`Translation`), the entry kinds (rename, no effect, refused, by value) and the rules that read a
value before deciding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Translation:
    settings: dict[str, Any] = field(default_factory=dict)
    note: str | None = None
    refusal: str | None = None


@dataclass(frozen=True)
class Entry:
    rule: Callable[[Any], Translation]
    ours: str
    """Our key(s), or '(no effect)' / '(refused)', for the docs table."""
    doc: str = ""


def truthy(value: Any) -> bool:
    return value in (True, "True", "true", 1, "1")


def rename(ours: str, doc: str = "", convert: Callable[[Any], Any] | None = None) -> Entry:
    return Entry(lambda v: Translation({ours: convert(v) if convert else v}), f"`{ours}`", doc)


def no_effect(reason: str) -> Entry:
    return Entry(lambda v: Translation(note=reason), "(no effect)", reason)


def refused(reason: str) -> Entry:
    return Entry(lambda v: Translation(refusal=reason), "(refused)", reason)


def by_value(rule: Callable[[Any], Translation], ours: str, doc: str) -> Entry:
    return Entry(rule, ours, doc)


def only(accepted: Callable[[Any], bool], note: str, refusal: str) -> Callable[[Any], Translation]:
    return lambda v: Translation(note=note) if accepted(v) else Translation(refusal=refusal.format(v=v))


MICRO = "micro-batches are packed to a token budget (actor.max_tokens_per_microbatch), which changes memory, not results"
DYNAMIC = "micro-batches are always packed by tokens (verl's dynamic batch size)"
PROFILE = "profiling hooks of verl's workers; use torch.profiler around hybridflow's roles instead"
SAME_SP = "hybridflow uses actor.sequence_parallel_size for actor, reference and critic alike"
SAME_TP_EP = "hybridflow splits actor, reference and critic alike (actor.tensor_parallel_size, actor.expert_parallel_size)"
NO_DIST_CKPT = (
    "hybridflow reads the weights at model.path as transformers saved them: no converted checkpoint"
)


def pipeline_parallel(value: Any) -> Translation:
    if int(value) == 1:
        return Translation(note="no pipeline stages (1)")
    return Translation(
        refusal=f"pipeline_model_parallel_size={value}: pipeline parallelism is not built; a model one GPU cannot "
        "hold is split by tensor parallelism (megatron.tensor_model_parallel_size), expert parallelism and FSDP2 "
        "(`hybridflow plan` chooses): set it to 1"
    )


def same_as_actor(key: str) -> Callable[[Any], Translation]:
    """A reference's or critic's parallel size, checked against the actor's once all keys are read."""
    return lambda v: Translation({key: int(v)})


def logger(value: Any) -> Translation:
    names = [value] if isinstance(value, str) else list(value)
    return Translation({"trainer.logger": ["jsonl" if n == "file" else n for n in names]})


def warmup_steps(value: Any) -> Translation:
    # verl: -1 (its default) means "use lr_warmup_steps_ratio"
    return Translation({} if int(value) < 0 else {"actor.optim.warmup_steps": int(value)})


def dtype(value: Any) -> str:
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16"}  # fmt: skip
    return names.get(str(value), str(value))


def rollout_name(value: Any) -> Translation:
    if value in ("vllm", "hf", "native"):
        return Translation({"rollout.backend": value})
    if value == "sglang":
        return Translation(
            {"rollout.backend": "native"},
            note="SGLang is not used: the built-in engine generates (the same sampling, continuous batching, prefix cache)",
        )
    return Translation(
        refusal=f"rollout engine {value!r} is not available here; use native (the built-in engine), vllm or hf"
    )


def strategy(role: str) -> Callable[[Any], Translation]:
    return only(
        lambda v: v in ("fsdp", "fsdp2"),
        "hybridflow always shards with FSDP2",
        f"{role} strategy {{v!r}}: hybridflow trains with FSDP2 only: set strategy fsdp (megatron's "
        "tensor_model_parallel_size and expert_model_parallel_size still apply, as actor.tensor_parallel_size "
        "and actor.expert_parallel_size)",
    )


def reward_model_enable(value: Any) -> Translation:
    # verl: with a reward model enabled, its score replaces the rule reward
    if truthy(value):
        return Translation({"reward.rule_weight": 0.0, "reward.model_weight": 1.0})
    return Translation()


def token_level_loss(value: Any) -> Translation:
    return Translation({"actor.loss_agg_mode": "token-mean" if truthy(value) else "seq-mean-token-mean"})


def max_gen_batches(value: Any) -> Translation:
    if int(value) <= 0:
        return Translation(
            refusal="algorithm.filter_groups.max_num_gen_batches<=0 (no limit) could sample forever; give a positive limit"
        )
    return Translation({"algorithm.filter_groups.max_generation_rounds": int(value)})


def dropout(value: Any) -> Translation:
    if float(value) == 0.0:
        return Translation(note="the native model has no dropout")
    return Translation(refusal=f"dropout {value}: the native model has no dropout; remove the key")


def pf_ppo(value: Any) -> Translation:
    if truthy(value):
        return Translation(refusal="PF-PPO (reweighted replay of samples) is not implemented in hybridflow")
    return Translation()


def resume_mode(value: Any) -> Translation:
    if value in ("auto", "disable"):
        return Translation({"trainer.resume": value})
    return Translation(
        refusal=f"trainer.resume_mode={value}: start a new run from a checkpoint's policy/ directory with "
        "model.path=RUN_DIR/checkpoints/global_step_N/policy (or resume the run in its own trainer.run_dir)"
    )


def fsdp_size(value: Any) -> Translation:
    if int(value) == -1:
        return Translation(note="FSDP2 shards over all training workers")
    return Translation(
        note=f"fsdp_size={value}: FSDP2 shards over all training workers, not groups of {value} "
        "(the same results; more memory saved, more communication)"
    )


def unless_null(ours: str, convert: Callable[[Any], Any] | None = None) -> Callable[[Any], Translation]:
    """verl's `null` (its default: no limit, no file) leaves ours as it is."""
    return lambda v: (
        Translation() if v in (None, "null", "None") else Translation({ours: convert(v) if convert else v})
    )


def multi_turn_enable(value: Any) -> Translation:
    return Translation({"rollout.agent.loop": "tools"}) if truthy(value) else Translation()


def truncate_side(value: Any) -> Translation:
    keep = {"left": "start", "right": "end", "middle": "ends"}
    if value not in keep:
        return Translation(refusal=f"tool_response_truncate_side={value!r}: choose left, right or middle")
    return Translation({"rollout.agent.tool_output_keep": keep[value]})


def tool_format(value: Any) -> Translation:
    # qwen / qwen25: SGLang's Qwen 2.5 parser (verl's SGLang-era examples), the same <tool_call> blocks
    ours = {
        "hermes": "hermes",
        "qwen": "hermes",
        "qwen25": "hermes",
        "llama3_json": "llama3",
        "mistral": "mistral",
    }
    if value not in ours:
        return Translation(
            refusal=f"multi_turn.format={value!r}: tool calls are read in hermes, llama3_json or mistral"
        )
    return Translation({"rollout.agent.tool_format": ours[value]})


def interaction(value: Any) -> Translation:
    if value in (None, "null", "None"):
        return Translation()
    return Translation(
        refusal="multi_turn.interaction_config_path: verl interactions are verl code; write an environment class "
        "with reset(sample) and step(action) and set rollout.agent.loop=environment rollout.agent.environment=FILE.py:CLASS"
    )


def hybrid_engine(value: Any) -> Translation:
    # False is read with rollout.n_gpus_per_node (config/verl_async.py), which it needs
    if truthy(value):
        return Translation(note="the rollout engine shares the training GPUs (the default here)")
    return Translation()


NO_TURN_LIMIT = 1_000_000  # verl's null: episodes end by the response length alone


def assistant_turns(value: Any) -> Translation:
    return Translation(
        {"rollout.agent.max_turns": NO_TURN_LIMIT if value in (None, "null", "None") else int(value)}
    )
