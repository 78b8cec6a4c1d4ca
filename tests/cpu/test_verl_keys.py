"""verl's keys: the table in hybridflow/config/aliases.py walked entry by entry, and verl's own
commands (its quickstart, GRPO and PPO example scripts, DAPO recipe) resolved as written.

tests/cpu/data/verl_script_keys.json lists the keys each of verl's FSDP example scripts sets
(examples/grpo_trainer, examples/ppo_trainer, the quickstart, the DAPO recipe and its CI script, at
verl b178a3cd): every one must be in the table or be one of our own keys."""

import json
import re
import shlex
import typing
from pathlib import Path

import pytest

from hybridflow.config import Config, to_yaml, valid_keys
from hybridflow.config.aliases import DEFERRED, VERL
from hybridflow.config.loader import resolve_config
from hybridflow.config.verl_async import read_together
from hybridflow.errors import UserError

SCRIPT_KEYS = json.loads((Path(__file__).parent / "data" / "verl_script_keys.json").read_text())

# verl's quickstart (docs/start/quickstart.rst), word for word but for the data paths
QUICKSTART = """
data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet data.train_batch_size=256
data.max_prompt_length=512 data.max_response_length=512
actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.actor.ppo_mini_batch_size=64 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.gpu_memory_utilization=0.4
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 critic.optim.lr=1e-5
critic.model.path=Qwen/Qwen2.5-0.5B-Instruct critic.ppo_micro_batch_size_per_gpu=4
algorithm.kl_ctrl.kl_coef=0.001 trainer.logger=console trainer.val_before_train=False
trainer.n_gpus_per_node=1 trainer.nnodes=1 trainer.save_freq=10 trainer.test_freq=10 trainer.total_epochs=15
"""

# examples/grpo_trainer/run_qwen2-7b.sh
GRPO_EXAMPLE = """
algorithm.adv_estimator=grpo data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet
data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation='error' actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
trainer.project_name='verl_grpo_example_gsm8k' trainer.experiment_name='qwen2_7b_function_rm'
trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
"""

# recipe/dapo/run_dapo_qwen2.5_32b.sh, its variables substituted
DAPO_RECIPE = """
data.train_files=$DATA/dapo-math-17k.parquet data.val_files=$DATA/aime-2024.parquet data.prompt_key=prompt
data.truncation='left' data.max_prompt_length=2048 data.max_response_length=20480 data.gen_batch_size=1536
data.train_batch_size=512 actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo
algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.kl_loss_coef=0.0 actor_rollout_ref.actor.clip_ratio_low=0.2
actor_rollout_ref.actor.clip_ratio_high=0.28 algorithm.filter_groups.enable=True
algorithm.filter_groups.max_num_gen_batches=10 algorithm.filter_groups.metric=acc
actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=22528 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=22528
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=22528 actor_rollout_ref.model.path=$MODELS/Qwen2.5-32B
+actor_rollout_ref.model.override_config.attention_dropout=0. +actor_rollout_ref.model.override_config.embd_pdrop=0.
+actor_rollout_ref.model.override_config.resid_pdrop=0. actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.fsdp_config.param_offload=True actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.use_token_level_loss=True actor_rollout_ref.actor.ulysses_sequence_parallel_size=8
actor_rollout_ref.rollout.gpu_memory_utilization=0.80 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.enable_chunked_prefill=True actor_rollout_ref.rollout.max_num_batched_tokens=22528
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k="-1"
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=1.0
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.ref.fsdp_config.param_offload=True
actor_rollout_ref.ref.ulysses_sequence_parallel_size=8 actor_rollout_ref.actor.fsdp_config.fsdp_size=-1
reward_model.reward_manager=dapo custom_reward_function.overlong_buffer.enable=True
custom_reward_function.overlong_buffer.len=4096 custom_reward_function.overlong_buffer.penalty_factor=1.0
trainer.logger=['console','wandb'] trainer.project_name=DAPO trainer.experiment_name=DAPO-Qwen2.5-32B
trainer.n_gpus_per_node=8 trainer.nnodes=16 +trainer.val_before_train=True trainer.test_freq=5
trainer.save_freq=5 trainer.total_epochs=1 trainer.default_local_dir=$CKPTS trainer.resume_mode=auto
"""


# verl/experimental/fully_async_policy/shell/dapo_7b_math_fsdp2_4_4.sh, its variables substituted
FULLY_ASYNC = """
data.train_files=$DATA/dapo-math-17k.parquet data.val_files=$DATA/aime-2024.parquet data.prompt_key=prompt
data.truncation='left' data.max_prompt_length=2048 data.max_response_length=8192 data.train_batch_size=0
data.gen_batch_size=1 data.return_raw_chat=True actor_rollout_ref.rollout.n=16 algorithm.adv_estimator=grpo
algorithm.use_kl_in_reward=False algorithm.kl_ctrl.kl_coef=0.0 actor_rollout_ref.actor.strategy=fsdp2
critic.strategy=fsdp2 actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.0
actor_rollout_ref.actor.clip_ratio_low=0.2 actor_rollout_ref.actor.clip_ratio_high=0.28
actor_rollout_ref.actor.clip_ratio_c=10.0 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.hybrid_engine=False +actor_rollout_ref.model.override_config.max_position_embeddings=32768
actor_rollout_ref.actor.use_dynamic_bsz=True actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True
actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20480
actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=30720
actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30720 actor_rollout_ref.model.path=$MODELS/Qwen2.5-Math-7B
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.lr_warmup_steps=10
actor_rollout_ref.actor.optim.weight_decay=0.1 actor_rollout_ref.actor.ppo_mini_batch_size=32
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.actor.grad_clip=1.0
actor_rollout_ref.actor.loss_agg_mode=token-mean actor_rollout_ref.actor.ulysses_sequence_parallel_size=1
actor_rollout_ref.rollout.gpu_memory_utilization=0.80 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.enable_chunked_prefill=True actor_rollout_ref.rollout.max_num_batched_tokens=10240
actor_rollout_ref.rollout.temperature=1.0 actor_rollout_ref.rollout.top_p=1.0 actor_rollout_ref.rollout.top_k=-1
actor_rollout_ref.rollout.val_kwargs.temperature=1.0 actor_rollout_ref.rollout.val_kwargs.top_p=0.7
actor_rollout_ref.rollout.val_kwargs.top_k=-1 actor_rollout_ref.rollout.val_kwargs.do_sample=True
actor_rollout_ref.rollout.val_kwargs.n=1 actor_rollout_ref.rollout.calculate_log_probs=True
actor_rollout_ref.ref.fsdp_config.param_offload=True actor_rollout_ref.ref.ulysses_sequence_parallel_size=1
actor_rollout_ref.actor.fsdp_config.fsdp_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.mode=async reward_model.reward_manager=dapo
+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True +reward_model.reward_kwargs.overlong_buffer_cfg.len=4096
+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0
+reward_model.reward_kwargs.overlong_buffer_cfg.log=False +reward_model.reward_kwargs.max_resp_len=8192
trainer.logger=['console','tensorboard'] trainer.project_name=DAPO trainer.experiment_name=fully-async-4-4
trainer.val_before_train=False trainer.save_freq=-1 trainer.default_local_dir=$CKPTS trainer.resume_mode=auto
trainer.nnodes=1 trainer.n_gpus_per_node=4 rollout.nnodes=1 rollout.n_gpus_per_node=4
rollout.total_rollout_steps=51200 trainer.total_epochs=10 rollout.test_freq=10
async_training.staleness_threshold=0.1 async_training.trigger_parameter_sync_step=4
async_training.require_batches=4 async_training.partial_rollout=True async_training.use_rollout_log_probs=True
"""

# recipe/one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh, its variables substituted
ONE_STEP_OFF = """
algorithm.adv_estimator=grpo data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet
data.train_batch_size=1152 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation='error' actor_rollout_ref.actor.strategy=fsdp2
critic.strategy=fsdp2 actor_rollout_ref.model.path=$MODELS/Qwen3-0.6B actor_rollout_ref.actor.optim.lr=1e-6
actor_rollout_ref.hybrid_engine=False actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=192 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=1
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.rollout.load_format=safetensors actor_rollout_ref.rollout.layered_summon=True
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.val_before_train=True
trainer.logger=['console','tensorboard'] trainer.project_name=GRPO trainer.experiment_name=one-step-off-2-6
trainer.save_freq=-1 trainer.test_freq=5 trainer.total_epochs=2 trainer.nnodes=1 trainer.n_gpus_per_node=6
rollout.nnodes=1 rollout.n_gpus_per_node=2
"""


def test_verls_fully_async_script():
    """A weight version of trigger x require x mini-batch prompts is one step; the staleness
    threshold bounds admission as a fraction; pi_old is the rollout's (verl's default); 4 trainer
    and 4 rollout GPUs on one node are 8 workers, the last 4 engines."""
    resolved = resolve_config(None, words(FULLY_ASYNC, DATA="/d", MODELS="/m", CKPTS="/ck"))
    c = resolved.config
    assert (c.trainer.async_mode, c.rollout.max_staleness) == ("streaming", 0.1)
    assert (c.data.prompts_per_step, c.actor.sequences_per_update) == (4 * 4 * 32, 32 * 16)
    assert c.trainer.total_training_steps == 51200 // 512 and c.trainer.test_freq == 10
    assert c.algorithm.rollout_correction.bypass_mode
    r = c.resources
    assert (r.n_gpus_per_node, r.nnodes, r.rollout_workers) == (8, 1, 4)
    buffer = c.reward.overlong_buffer
    assert (buffer.enable, buffer.buffer_tokens, buffer.penalty_factor) == (True, 4096, 1.0)
    assert any("fully_async_policy" in n and "512 prompts" in n for n in resolved.notes)


def test_verls_fully_async_options_and_defaults():
    base = words(FULLY_ASYNC, DATA="/d", MODELS="/m", CKPTS="/ck")
    drop = ("async_training.", "rollout.total_rollout_steps")
    bare = [w for w in base if not w.startswith(drop)]
    c = resolve_config(None, [*bare, "async_training.partial_rollout=False"]).config
    # the YAML's defaults for the keys not given: threshold 0.1, trigger 4, require 1
    assert (c.trainer.async_mode, c.rollout.max_staleness, c.data.prompts_per_step) == ("one_step", 0.1, 128)
    c = resolve_config(None, [*base, "async_training.compute_prox_log_prob=True"]).config
    assert not c.algorithm.rollout_correction.bypass_mode  # decoupled PPO: pi_old recomputed
    c = resolve_config(None, [*base, "async_training.staleness_threshold=0"]).config
    assert c.rollout.max_staleness == 0  # the synchronous run on the engine's own GPUs
    for extra, message in (
        (
            ["async_training.partial_rollout=False", "async_training.staleness_threshold=2"],
            "bounds staleness at 1",
        ),
        (["rollout.total_rollout_steps=100"], "fewer prompts than one weight version (512)"),
        (["trainer.nnodes=2", "rollout.n_gpus_per_node=2"], "whole nodes"),
        (["+reward_model.reward_kwargs.max_resp_len=4096"], "max_resp_len=4096"),
    ):
        with pytest.raises(UserError, match=re.escape(message)):
            resolve_config(None, [*base, *extra])


def test_verls_one_step_off_policy_script():
    resolved = resolve_config(None, words(ONE_STEP_OFF, DATA="/d", MODELS="/m"))
    c = resolved.config
    assert (c.trainer.async_mode, c.rollout.max_staleness) == ("one_step", None)  # a bound of 1
    assert (c.resources.n_gpus_per_node, c.resources.rollout_workers) == (8, 2)
    assert (c.data.prompts_per_step, c.actor.sequences_per_update) == (1152, 192 * 5)
    assert not c.algorithm.rollout_correction.bypass_mode  # pi_old recomputed by the trainer, as verl
    assert any("one_step_off_policy" in n for n in resolved.notes)


def test_the_engine_on_gpus_of_its_own_needs_them_named():
    with pytest.raises(UserError, match="hybrid_engine=False: give the engine GPUs of its own"):
        resolve_config(None, ["actor_rollout_ref.hybrid_engine=False"])
    with pytest.raises(UserError, match="set actor_rollout_ref.hybrid_engine=False"):
        resolve_config(None, ["rollout.n_gpus_per_node=2"])
    with pytest.raises(UserError, match="give the GPUs one way"):  # ours would be replaced silently
        resolve_config(
            None,
            [
                "actor_rollout_ref.hybrid_engine=False",
                "rollout.n_gpus_per_node=2",
                "resources.rollout_workers=1",
            ],
        )


MULTI_TURN_BY_VALUE = ("enable", "format", "tool_response_truncate_side", "max_assistant_turns")


def words(command: str, **paths: str) -> list[str]:
    for name, value in paths.items():
        command = command.replace(f"${name}", value)
    return shlex.split(command)  # as bash hands them to the program


def test_every_key_of_verls_scripts_is_in_the_table_or_ours():
    ours = set(valid_keys())
    missing = {
        script: [k for k in keys if k not in VERL and k not in DEFERRED and k not in ours]
        for script, keys in SCRIPT_KEYS.items()
    }
    assert not {s: k for s, k in missing.items() if k}
    assert len(SCRIPT_KEYS) >= 30 and sum(map(len, SCRIPT_KEYS.values())) > 1000


def _leaf_type(key: str):
    cls, hint = Config, None
    for part in key.split("."):
        hint = typing.get_type_hints(cls)[part]
        cls = hint
    return hint


def _sample(key: str):
    """A value of the right type for our key, other than its default where the type allows."""
    section, *rest = key.split(".")
    default = Config()
    for part in key.split("."):
        default = getattr(default, part)
    hint = str(_leaf_type(key))
    if "bool" in hint:
        return not default
    if "float" in hint:
        return 0.25
    if "int" in hint:
        return 2
    if "list" in hint:
        return ["x"]
    return default


@pytest.mark.parametrize("key", sorted(VERL))
def test_each_table_entry_does_what_it_says(key):
    entry = VERL[key]
    ours = set(valid_keys())
    if entry.ours.startswith("`") and " and " not in entry.ours and "=" not in entry.ours:
        target = entry.ours.strip("`")
        assert target in ours or target.rsplit(".", 1)[0] in ours, f"{key} -> {target}: not one of our keys"
        sample = {"model.dtype": "bfloat16", "rollout.backend": "hf", "trainer.resume": "disable",
                  "algorithm.filter_groups.metric": "acc", "actor.policy_loss": "vanilla",
                  "actor.loss_agg_mode": "seq-mean-token-mean", "trainer.logger": ["jsonl"],
                  "data.overlong_prompts": "error", "trainer.run_dir": "/tmp/x"}.get(target)  # fmt: skip
        if key in (
            "data.filter_overlong_prompts",
            "data.truncation",
            f"{'actor_rollout_ref'}.actor.use_token_level_loss",
            *(f"actor_rollout_ref.rollout.multi_turn.{k}" for k in MULTI_TURN_BY_VALUE),
        ):
            return  # by value: their own tests below
        if entry.rule is read_together:
            return  # read with the keys they go with: the fully-async and one-step-off tests
        value = sample if sample is not None else _sample(target) if target in ours else "v"
        also = ["actor_rollout_ref.rollout.val_kwargs.do_sample=True"] if "val_kwargs" in key else []
        config = resolve_config(None, [f"{key}={json.dumps(value)}", *also]).config
        got = config
        for part in target.split("."):
            got = got[part] if isinstance(got, dict) else getattr(got, part)
        assert got == value or (target == "model.dtype" and got == "bfloat16"), key
    elif entry.ours == "(no effect)" and entry.rule(True).note:  # plain no-effect keys
        resolved = resolve_config(None, [f"{key}=1"])
        assert any(n.startswith(key) for n in resolved.notes)
    elif entry.ours == "(refused)":
        with pytest.raises(UserError, match=key.replace(".", r"\.")):
            resolve_config(None, [f"{key}=1"])


def test_the_quickstart_runs_verls_default_ppo_not_the_demo():
    resolved = resolve_config(None, words(QUICKSTART, DATA="/data/gsm8k"))
    c = resolved.config
    assert resolved.base.startswith("verl's defaults")
    # what the quickstart leaves unsaid is verl's default: PPO with a critic, one sample
    assert (c.algorithm.adv_estimator, c.rollout.samples_per_prompt, c.trainer.total_epochs) == ("gae", 1, 15)
    assert c.trainer.total_training_steps is None and c.data.task is None
    assert c.critic.model_path == "Qwen/Qwen2.5-0.5B-Instruct" and c.critic.optim.lr == 1e-5
    assert (c.data.prompts_per_step, c.actor.sequences_per_update, c.actor.sequences_per_microbatch) == (
        256,
        64,
        4,
    )
    assert c.data.train_files == ["/data/gsm8k/train.parquet"]  # a string in verl's command
    assert (c.rollout.backend, c.rollout.gpu_memory_utilization, c.trainer.val_before_train) == (
        "vllm",
        0.4,
        False,
    )
    assert (c.trainer.save_freq, c.trainer.test_freq, c.trainer.logger) == (10, 10, ["console"])
    assert (c.algorithm.use_kl_in_reward, c.actor.use_kl_loss) == (False, False)  # verl's defaults too
    notes = "\n".join(resolved.notes)
    for key in (
        "log_prob_micro_batch_size_per_gpu",
        "tensor_model_parallel_size",
        "critic.ppo_micro_batch_size_per_gpu",
    ):
        assert key in notes


def test_the_grpo_example_script():
    c = resolve_config(None, words(GRPO_EXAMPLE, DATA="/d")).config
    assert (c.algorithm.adv_estimator, c.rollout.samples_per_prompt, c.data.prompts_per_step) == (
        "grpo",
        5,
        1024,
    )
    assert c.actor.sequences_per_update == 256 * 5  # verl's mini-batch counts prompts
    assert (c.actor.use_kl_loss, c.actor.kl_loss_coef, c.actor.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert (c.data.overlong_prompts, c.ref.offload_params, c.model.enable_gradient_checkpointing) == (
        "filter",
        True,
        True,
    )
    assert c.trainer.logger == ["console", "wandb"] and c.resources.n_gpus_per_node == 8


def test_the_dapo_recipe():
    resolved = resolve_config(None, words(DAPO_RECIPE, DATA="/d", MODELS="/m", CKPTS="/ck"))
    c = resolved.config
    f = c.algorithm.filter_groups
    assert (f.enable, f.metric, f.max_generation_rounds, f.prompts_per_round) == (True, "acc", 10, 1536)
    assert (c.data.prompts_per_step, c.rollout.samples_per_prompt, c.actor.sequences_per_update) == (
        512,
        16,
        512,
    )
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (
        0.2,
        0.28,
        "token-mean",
    )
    buffer = c.reward.overlong_buffer
    assert (buffer.enable, buffer.buffer_tokens, buffer.penalty_factor) == (True, 4096, 1.0)
    assert c.data.overlong_prompts == "truncate_left" and c.data.max_prompt_tokens == 2048
    assert (c.actor.optim.warmup_steps, c.actor.optim.weight_decay) == (10, 0.1)
    assert (c.rollout.val_temperature, c.rollout.val_top_p, c.rollout.val_top_k) == (
        1.0,
        1.0,
        -1,
    )  # do_sample
    assert (c.actor.sequence_parallel_size, c.trainer.run_dir, c.resources.nnodes) == (8, "/ck", 16)
    assert c.trainer.val_before_train and c.trainer.resume == "auto"
    assert any("dropout" in n for n in resolved.notes)


def test_validation_is_greedy_unless_do_sample_whatever_the_order():
    for order in (1, -1):
        keys = ["actor_rollout_ref.rollout.val_kwargs.do_sample=False",
                "actor_rollout_ref.rollout.val_kwargs.temperature=0.7"][::order]  # fmt: skip
        assert resolve_config(None, keys).config.rollout.val_temperature == 0.0
    keys = [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.7",
    ]
    assert resolve_config(None, keys).config.rollout.val_temperature == 0.7


def test_truncation_and_filtering_combine_as_in_verl():
    def mode(*keys):
        return resolve_config(None, list(keys)).config.data.overlong_prompts

    assert mode("data.filter_overlong_prompts=True", "data.truncation=left") == "filter"
    assert mode("data.truncation=left") == "truncate_left"
    assert mode("data.truncation=right") == "truncate_right"
    assert mode("data.truncation=error") == "error"
    with pytest.raises(UserError, match="data.truncation='middle'"):
        mode("data.truncation=middle")


def test_every_bad_key_is_named_in_one_message():
    keys = ["actor_rollout_ref.actor.strategy=megatron", "data.nonsense=1", "trainer.bogus=2",
            "algorithm.pf_ppo.weight_pow=2", "actor_rollout_ref.actor.optim.lr=1e-6"]  # fmt: skip
    with pytest.raises(UserError) as e:
        resolve_config(None, keys)
    message = str(e.value)
    assert message.startswith("4 config key(s) cannot be used")
    for bad in ("megatron", "data.nonsense", "trainer.bogus", "PF-PPO"):
        assert bad in message


def test_hints_name_the_right_key():
    with pytest.raises(UserError, match="did you mean 'data.train_batch_size'"):
        resolve_config(None, ["data.train_batch_sz=3"])
    with pytest.raises(UserError, match="did you mean 'actor.optim.lr'"):
        resolve_config(None, ["actor.optim.lrr=3"])


# verl's Qwen3-30B-A3B example (examples/grpo_trainer/run_qwen3moe-30b_megatron.sh at 3f388066), its
# overrides word for word but for the paths (it also names --config-name ppo_megatron_trainer.yaml)
QWEN3_MOE_MEGATRON = """
algorithm.adv_estimator=grpo data.train_files=$DATA/train.parquet data.val_files=$DATA/test.parquet
data.train_batch_size=64 data.max_prompt_length=1024 data.max_response_length=2048
data.filter_overlong_prompts=True data.truncation='error' actor_rollout_ref.model.path=$HF_MODEL_PATH
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64
actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4
actor_rollout_ref.actor.megatron.expert_model_parallel_size=4
actor_rollout_ref.actor.megatron.use_dist_checkpointing=True
actor_rollout_ref.actor.megatron.dist_checkpointing_path=$DIST_CKPT_PATH actor_rollout_ref.actor.use_kl_loss=True
actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2
actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4 actor_rollout_ref.ref.megatron.expert_model_parallel_size=4
actor_rollout_ref.ref.megatron.use_dist_checkpointing=True
actor_rollout_ref.ref.megatron.dist_checkpointing_path=$DIST_CKPT_PATH algorithm.use_kl_in_reward=False
trainer.critic_warmup=0 trainer.logger=['console','wandb'] trainer.project_name='verl_grpo_example_gsm8k_math'
trainer.experiment_name='qwen3_30b_moe_megatron' trainer.n_gpus_per_node=8 trainer.nnodes=4 trainer.save_freq=20
trainer.test_freq=5 trainer.total_epochs=15
"""


def test_verls_megatron_moe_example_maps_its_parallel_sizes_or_names_what_is_not_built():
    """As written, its two pipeline stages are refused in one line naming what splits a model instead;
    with one stage (and strategy fsdp) its tensor and expert parallel sizes become ours, for actor
    and reference alike, and its converted-checkpoint keys are notes (we read model.path)."""
    args = words(QWEN3_MOE_MEGATRON, DATA="/d", HF_MODEL_PATH="Qwen/Qwen3-30B-A3B", DIST_CKPT_PATH="/ck")
    with pytest.raises(
        UserError, match=r"pipeline_model_parallel_size=2: pipeline parallelism is not built.*set it to 1"
    ):
        resolve_config(None, args)
    one_stage = [a.replace("pipeline_model_parallel_size=2", "pipeline_model_parallel_size=1") for a in args]
    resolved = resolve_config(None, [*one_stage, "actor_rollout_ref.actor.strategy=fsdp"])
    c = resolved.config
    assert (c.actor.tensor_parallel_size, c.actor.expert_parallel_size) == (4, 4)
    assert any(n.startswith("actor_rollout_ref.ref.megatron.dist_checkpointing_path") for n in resolved.notes)
    with pytest.raises(UserError, match="set strategy fsdp .*as actor.tensor_parallel_size"):
        resolve_config(None, [*one_stage, "actor_rollout_ref.actor.strategy=megatron"])
    with pytest.raises(UserError, match="ref expert parallel size 2 != the actor's 4"):
        resolve_config(None, [*one_stage, "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"])


def test_sequence_parallel_sizes_must_agree():
    with pytest.raises(UserError, match="critic sequence parallel size 2 != the actor's 4"):
        resolve_config(None, ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
                              "critic.ulysses_sequence_parallel_size=2"])  # fmt: skip


def test_bases_of_each_command_shape():
    bare = resolve_config(None, [], bare_is_demo=True)
    assert "demo recipe demo_arithmetic_grpo" in bare.base and bare.config.data.task == "arithmetic"
    ours = resolve_config(None, ["data.train_files=x.parquet"], bare_is_demo=True)
    assert ours.base.startswith("hybridflow's defaults") and ours.config.data.task is None
    assert ours.config.algorithm.adv_estimator == "grpo"
    verl = resolve_config(None, ["data.train_batch_size=4"], bare_is_demo=True)
    assert verl.base.startswith("verl's defaults") and verl.config.algorithm.adv_estimator == "gae"
    recipe = resolve_config("gsm8k_grpo", ["data.train_batch_size=4"], bare_is_demo=True)
    assert "gsm8k_grpo.yaml" in recipe.base and recipe.config.rollout.samples_per_prompt == 8


def test_config_show_prints_what_train_runs(capsys):
    from omegaconf import OmegaConf

    from hybridflow.cli import main

    argv = words(QUICKSTART, DATA="/d")
    assert main(["config", "show", *argv]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("# config base: verl's defaults")
    shown = OmegaConf.to_container(OmegaConf.create(out))
    assert shown == OmegaConf.to_container(OmegaConf.create(to_yaml(resolve_config(None, argv).config)))


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "async_training.staleness_threshold=abc",
            "async_training.staleness_threshold='abc' must be a number",
        ),
        ("async_training.trigger_parameter_sync_step=0", "trigger_parameter_sync_step=0 must be >= 1"),
        ("async_training.require_batches=1.5", "require_batches=1.5 must be a whole number"),
        ("rollout.n_gpus_per_node=two", "rollout.n_gpus_per_node='two' must be a whole number"),
        ("rollout.nnodes=0", "rollout.nnodes=0 must be >= 1"),
        ("async_training.partial_rollout=maybe", "partial_rollout='maybe' must be True or False"),
        ("async_training.compute_prox_log_prob=2", "compute_prox_log_prob=2 must be True or False"),
        ("+reward_model.reward_kwargs.max_resp_len=abc", "max_resp_len=abc"),
    ],
)
def test_a_malformed_async_value_stops_naming_its_key(extra, message):
    """Never read as False or 0 (partial_rollout=maybe was one_step, a 0 divided the rollout total)."""
    base = [
        "actor_rollout_ref.hybrid_engine=False",
        "rollout.n_gpus_per_node=2",
        "rollout.total_rollout_steps=4096",
    ]
    with pytest.raises(UserError, match=re.escape(message)):
        resolve_config(None, [*base, extra])


def test_verls_reward_kwargs_reach_the_function(tmp_path):
    """`+custom_reward_function.reward_kwargs.*` (verl passes them to compute_score): each entry is a
    keyword the function is called with, not a refused key with a hint at another."""
    from hybridflow.rewards.loading import load_custom_function

    (tmp_path / "r.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1, mode='loose'):\n"
        "    return {'score': scale * len(solution_str), 'mode': mode}\n"
    )
    c = resolve_config(None, [f"custom_reward_function.path={tmp_path / 'r.py'}",
                              "+custom_reward_function.reward_kwargs.scale=2",
                              "custom_reward_function.reward_kwargs.mode=strict"]).config  # fmt: skip
    assert c.reward.custom_function_kwargs == {"scale": 2, "mode": "strict"}
    fn = load_custom_function(
        c.reward.custom_function_path, "compute_score", kwargs=c.reward.custom_function_kwargs
    )
    assert fn("x", "abc", "") == {"score": 6, "mode": "strict"}


def test_verls_grpo_lora_script_keeps_its_reference_offload_key():
    """verl's GRPO-LoRA scripts set ref.fsdp_config.param_offload=True; with LoRA the reference is the
    base with the adapters off, so there is nothing to offload: no sharded reference (which LoRA in one
    worker refuses, naming model.lora_rank), and the step plan says why the key does nothing."""
    from hybridflow.controller.setup import step_plan
    from hybridflow.controller.worker_models import WorkerLayout

    c = resolve_config(None, ["actor_rollout_ref.model.lora_rank=32", "actor_rollout_ref.actor.use_kl_loss=True",
                              "actor_rollout_ref.ref.fsdp_config.param_offload=True"]).config  # fmt: skip
    layout = WorkerLayout.of(c, 1)
    assert layout.needs_ref and not layout.shard_ref and not layout.sharded
    assert "ref.offload_params has nothing to offload" in step_plan(c, 10, 100, 10)
