"""Typed configuration: one dataclass per section. Defaults live here and only here.

Units are in the names: `*_tokens` count tokens, `*_prompts` count prompts, `*_sequences` count
sampled responses (prompts x samples_per_prompt). Validation in `__post_init__` names the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import UserError


def _check_choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"config {section}.{name}={value!r} is not one of {', '.join(choices)}")


def _check_positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"config {section}.{name}={value} must be {bound}")


@dataclass
class ModelConfig:
    path: str = "default"
    """'default' (embedded SmolLM2-135M-Instruct), an HF model directory, or a .gguf file."""
    impl: str = "auto"
    """Model code the actor, reference and critic train with: 'auto' (ours when the family is
    supported, else transformers), 'native' (ours, padding-free; Llama/Mistral/Qwen2/Qwen3; an error
    for others) or 'hf' (transformers, padded micro-batches)."""
    dtype: str = "float32"
    """Master weight dtype: float32, bfloat16 or float16. Compute runs in `actor.compute_dtype`."""
    lora_rank: int = 0
    """> 0: train LoRA adapters of this rank on the native model instead of all its weights; the
    reference policy is the base model (adapters off), the rollout gets merged weights."""
    lora_alpha: float = 16.0
    """The adapters' update is scaled by lora_alpha / lora_rank."""
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Linear layers of the decoder blocks that get adapters (default: all of them)."""
    lora_adapter_path: str | None = None
    """A PEFT LoRA adapter directory to continue training (its rank, alpha and layers are used)."""
    enable_gradient_checkpointing: bool = False
    compile: bool = False
    """torch.compile the native model's layers (the parts around attention: fused norms, RoPE and
    SwiGLU), in the trainer and in the built-in rollout engine; costs a compile at start and pays off
    on GPU (see docs/benchmarks.md)."""
    use_remove_padding: bool = True
    """Pack sequences without padding (the native model always does; kept for verl recipes)."""
    trust_remote_code: bool = False
    cache_dir: str | None = None
    """Where converted models are cached; default ~/.cache/hybridflow (or $HYBRIDFLOW_CACHE)."""

    def __post_init__(self) -> None:
        _check_choice("model", "impl", self.impl, ("auto", "hf", "native"))
        _check_choice("model", "dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt datasets: parquet, jsonl/json, or `datasets.save_to_disk` directories."""
    task: str | None = None
    """A built-in task ('arithmetic', 'countdown') written into the cache and used when train_files is empty."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Options of the built-in task: train_size, test_size, seed, and the task's own (e.g. max_digits)."""
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages (verl schema) or a plain string."""
    answer_key: str | None = None
    """Column holding the ground truth for plain rows; verl rows use reward_model.ground_truth."""
    data_source: str | None = None
    """data_source for rows that lack the column (chooses the reward scorer)."""
    max_prompt_tokens: int = 512
    max_response_tokens: int = 512
    prompts_per_step: int = 8
    """Prompts drawn per RL step; each is sampled `rollout.samples_per_prompt` times."""
    overlong_prompts: str = "filter"
    """Prompts longer than max_prompt_tokens: 'filter' drops them (and logs the count); 'error' stops;
    'truncate_left' / 'truncate_right' keep their last / first max_prompt_tokens tokens (verl's
    truncation=left / right)."""
    on_bad_row: str = "error"
    """A malformed row (missing prompt, wrong type, empty prompt, no ground truth where the reward needs
    one, a jsonl line that is not UTF-8 JSON): 'error' stops at the first, naming it; 'skip' drops
    every such row and logs a report (file, row or line, reason) with the count."""
    apply_chat_template: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the tokenizer's chat template, e.g. {enable_thinking: false} (verl's
    data.apply_chat_template_kwargs)."""
    system_prompt: str | None = None
    shuffle: bool = True
    max_val_prompts: int | None = None
    cache_tokenized: bool = True
    """Tokenize each data file once and read the cached prompts after (under model.cache_dir, or
    $HYBRIDFLOW_CACHE or ~/.cache/hybridflow, in prompts/; keyed by file contents, tokenizer, template
    and these data.* settings)."""

    def __post_init__(self) -> None:
        _check_choice(
            "data",
            "overlong_prompts",
            self.overlong_prompts,
            ("filter", "error", "truncate_left", "truncate_right"),
        )
        _check_choice("data", "on_bad_row", self.on_bad_row, ("error", "skip"))
        for name in ("max_prompt_tokens", "max_response_tokens", "prompts_per_step"):
            _check_positive("data", name, getattr(self, name))


@dataclass
class AgentConfig:
    """Multi-turn episodes instead of one response per sample (hybridflow/agents): the model calls
    tools or plays an environment across turns; only the tokens it sampled are trained."""

    loop: str = ""
    """'' (off: one response per sample), 'tools' (call `tools` in the chat template's format) or
    'environment' (turns against `environment`)."""
    tools: list[str] = field(default_factory=list)
    """Built-in names ('calculator'; 'python': programs run in the code sandbox) or FILE.py:FUNCTION,
    typed Python functions with a Google-style docstring (their schema is read from it, as TRL's
    tools= does)."""
    tool_config: str = ""
    """A verl tool YAML (`tools: [{class_name, config, tool_schema}]`, verl's
    multi_turn.tool_config_path): its SandboxFusionTool runs in the code sandbox, its Gsm8kTool checks
    the answer against the sample's; other classes are verl code and are refused."""
    tool_format: str = ""
    """'' (read from the chat template; Hermes where it renders no tools), 'hermes', 'mistral' or
    'llama3' (verl's multi_turn.format: hermes, llama3_json)."""
    fenced_tool_calls: bool = True
    """Also take a call written as a fenced JSON block ({"name": TOOL, "arguments": {...}} in
    ```json ... ```) that names one of the tools: what some models write instead of their template's
    format (Qwen2.5-Coder-1.5B-Instruct, always). False: such a block is plain text."""
    environment: str = ""
    """A built-in name ('guess_number') or FILE.py:CLASS with reset(sample) and step(action)."""
    max_turns: int = 8
    """Model calls per episode."""
    max_tool_turns: int = 0
    """Turns of tool results (or environment answers) per episode; the model's turn after the last
    one ends the episode (verl's max_user_turns). 0: no limit but max_turns."""
    max_tokens_per_turn: int = 0
    """Most tokens of one model call (0: what the episode's data.max_response_tokens leaves). With
    an environment, a turn cut here is still its action; the template closes it."""
    max_tool_calls: int = 16
    """Tool calls per episode; those past it are answered with an error."""
    max_parallel_calls: int = 0
    """Tool calls run from one model turn; those past it are answered with an error (verl runs the
    first max_parallel_calls and drops the rest unanswered). 0: no limit but max_tool_calls."""
    on_malformed: str = "feedback"
    """A tool call that does not parse: 'feedback' (an error as the tool's result, the episode goes
    on) or 'end' (the episode ends, minus malformed_penalty)."""
    malformed_penalty: float = 0.0
    tool_timeout_s: float = 30.0
    """One tool call's deadline, its wait for a free slot included; a sandboxed program is stopped at it."""
    max_tool_output_chars: int = 4000
    tool_output_keep: str = "start"
    """What is kept of a longer tool output: its 'start', its 'end', or both 'ends' (verl's
    tool_response_truncate_side left / right / middle)."""
    max_concurrent_tools: int = 64
    """Tool calls running at once over all episodes of a step."""
    code_tool_concurrency: int = 0
    """Sandboxed programs (the python tool) running at once; 0: one per CPU core."""
    code_tool_memory_mb: int = 1024
    """Memory of one sandboxed program (with its child processes)."""
    step_timeout_s: float = 30.0
    """An environment's reset or step past it ends the episode ('error')."""

    def __post_init__(self) -> None:
        _check_choice("rollout.agent", "loop", self.loop, ("", "tools", "environment"))
        if self.loop == "tools" and not (self.tools or self.tool_config):
            raise UserError(
                "rollout.agent.loop=tools (verl: multi_turn.enable=True) needs rollout.agent.tools (e.g. [python]) "
                "or rollout.agent.tool_config (verl: multi_turn.tool_config_path)"
            )
        if self.loop == "environment" and not self.environment:
            raise UserError(
                "rollout.agent.loop=environment needs rollout.agent.environment (e.g. guess_number)"
            )
        _check_choice("rollout.agent", "on_malformed", self.on_malformed, ("feedback", "end"))
        _check_choice("rollout.agent", "tool_format", self.tool_format, ("", "hermes", "mistral", "llama3"))
        _check_choice("rollout.agent", "tool_output_keep", self.tool_output_keep, ("start", "end", "ends"))
        counts = ("max_tool_turns", "max_tool_calls", "max_parallel_calls", "code_tool_concurrency")
        if self.max_turns < 1 or any(getattr(self, k) < 0 for k in counts):
            raise UserError(f"rollout.agent.max_turns must be >= 1 and {', '.join(counts)} >= 0")


@dataclass
class RolloutConfig:
    backend: str = "auto"
    """'native' (the built-in engine: paged KV cache, continuous batching, CUDA graphs), 'hf'
    (transformers generate, the reference), 'vllm', or 'auto' (native when the policy runs our model)."""
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k."""
    gpu_memory_utilization: float = 0.5
    max_batch_sequences: int = 256
    """Most sequences generated together (the hf backend chunks larger batches)."""
    max_prefill_tokens: int = 16384
    """Native engine: token budget of one prefill step."""
    kv_cache_tokens: int | None = None
    """Native engine: KV pool size in tokens. Default: gpu_memory_utilization of the free GPU memory,
    at most room for max_batch_sequences at full length; on CPU, room for one step's sequences."""
    cuda_graphs: bool = True
    """Native engine: replay decode steps as CUDA graphs."""
    decode_steps: int = 8
    """Native engine: decode steps the GPU runs between two looks of the host (the host plans and
    records once per run; a sequence that stops inside a run computes to the run's end)."""
    free_cache_engine: bool = True
    """Colocated on a GPU: free the rollout's KV pool (and the engine's CUDA graphs) while the other
    roles run, and allocate (and capture) them again for the next generation. false keeps them: no
    re-allocation or graph capture each step, for a pool that fits beside training (a lower
    gpu_memory_utilization or kv_cache_tokens; `hybridflow plan` counts it in every phase)."""
    prefix_cache: bool = True
    """Native engine: keep full KV pages by their token prefix across requests (a shared system
    prompt, a conversation's next turn, a preempted sequence) and prefill only what is new; dropped
    at every weight update."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    server: bool = False
    """Native engine, one training worker: also serve the policy being trained over the OpenAI API
    (`hybridflow serve`'s routes and /metrics) at http://server_host:server_port/v1, written to
    RUN_DIR/policy_server.json; the trainer's own generation then goes through the same engine."""
    server_host: str = "127.0.0.1"
    server_port: int = 0
    """0: a free port."""
    server_api_processes: int = 1
    """HTTP front processes of the policy server (hundreds of concurrent agents: 4 or so)."""
    val_samples_per_prompt: int = 1
    val_temperature: float = 0.0
    """0 means greedy."""
    val_top_p: float = 1.0
    """Validation's own top-p (verl's val_kwargs.top_p): rollout.top_p is not applied to validation."""
    val_top_k: int = -1
    """Validation's own top-k (verl's val_kwargs.top_k); -1 disables."""

    def __post_init__(self) -> None:
        _check_choice("rollout", "backend", self.backend, ("auto", "native", "hf", "vllm"))
        _check_positive("rollout", "samples_per_prompt", self.samples_per_prompt)
        _check_positive("rollout", "decode_steps", self.decode_steps)
        _check_positive("rollout", "server_api_processes", self.server_api_processes)
        _check_positive("rollout", "temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise UserError(f"config rollout.top_p={self.top_p} must be in (0, 1]")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(
                f"config rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_scheduler: str = "constant"
    """'constant', 'cosine' or 'linear' (decay to min_lr_ratio), each after a linear warmup."""
    warmup_steps: int = 0
    """Linear warmup over this many training steps (verl's unit: the schedule moves once per step,
    whatever the mini-batches of a step)."""
    warmup_ratio: float = 0.0
    """With warmup_steps=0: warm up over this fraction of the run's training steps (verl's
    lr_warmup_steps_ratio)."""
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check_choice("optim", "lr_scheduler", self.lr_scheduler, ("constant", "cosine", "linear"))
        _check_positive("optim", "lr", self.lr, allow_zero=True)


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    sequences_per_update: int | None = None
    """Sequences per optimizer step (a mini-batch); None = the whole step's sequences (one update)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward; gradients accumulate over micro-batches."""
    sequences_per_microbatch: int | None = None
    """Optional cap on sequences per micro-batch (verl's ppo_micro_batch_size_per_gpu)."""
    ppo_epochs: int = 1
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    compute_dtype: str = "auto"
    """Autocast dtype for forward/backward: 'auto' (bfloat16 on CUDA, float32 on CPU, where bf16 matmuls
    are only fast with AMX), 'bfloat16', 'float16' or 'float32' (no autocast)."""
    sequence_parallel_size: int = 1
    offload_params: bool = False
    offload_optimizer: bool = False

    def __post_init__(self) -> None:
        _check_choice(
            "actor",
            "loss_agg_mode",
            self.loss_agg_mode,
            ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        )
        _check_choice(
            "actor", "compute_dtype", self.compute_dtype, ("auto", "bfloat16", "float16", "float32")
        )
        _check_positive("actor", "max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        _check_positive("actor", "ppo_epochs", self.ppo_epochs)
        _check_positive("actor", "sequence_parallel_size", self.sequence_parallel_size)


@dataclass
class RefConfig:
    model_path: str | None = None
    """The reference policy (an HF directory with the policy's tokenizer); None: the policy's starting
    weights."""
    max_tokens_per_microbatch: int = 16384
    offload_params: bool = False


@dataclass
class CriticConfig:
    model_path: str | None = None
    """None initialises the critic from the policy's backbone."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    max_tokens_per_microbatch: int = 8192
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    warmup_steps: int = 0
    """RL steps during which only the critic is updated (verl's critic_warmup)."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    buffer_tokens: int = 64
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    custom_function_path: str | None = None
    """A Python file defining the reward function (verl's custom_reward_function.path)."""
    custom_function_name: str = "compute_score"
    max_abs: float = 1e6
    """A score whose magnitude exceeds this is an error (counted in reward/errors, scored 0): 1e39
    is a finite float64 and an infinite float32."""
    on_all_errors: str = "stop"
    """A step (or validation) in which the reward function failed on every response: 'stop' ends the
    run with the first error's traceback; 'warn' prints it and goes on (the responses score 0). The
    first error of a run is always printed with its traceback."""
    num_workers: int = 2
    """Scoring processes; 0 scores in the trainer's process (timeouts still apply, from the main thread)."""
    timeout_s: float = 10.0
    """Per-response scoring deadline; a response past it scores 0 and counts in reward/timeouts."""
    guards: bool | None = None
    """Reward-hacking guards on the final answer; None = the source's default (on, but off for gsm8k)."""
    max_response_chars: int = 20000
    """With guards, longer responses earn no correctness score."""
    format_pattern: str | None = None
    """'think' (<think>...</think> then an answer) or a regex; scored when format_weight != 0."""
    format_weight: float = 0.0
    code_all_or_nothing: bool = False
    sandbox_timeout_s: float = 5.0
    sandbox_memory_mb: int = 1024
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    model_path: str | None = None
    """Optional reward model (an HF sequence-classification directory) scored alongside rule rewards."""
    model_weight: float = 1.0
    rule_weight: float = 1.0
    """score = rule_weight * rule score + model_weight * reward-model score (when a model is set)."""
    model_max_tokens_per_microbatch: int = 8192

    def __post_init__(self) -> None:
        _check_choice("reward", "on_all_errors", self.on_all_errors, ("stop", "warn"))


@dataclass
class KLControlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        _check_choice("algorithm.kl_ctrl", "type", self.type, ("fixed", "adaptive"))


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose scores all agree, regenerate to fill the step."""
    max_generation_rounds: int = 4
    prompts_per_round: int | None = None
    """Prompts sampled per generation round (verl's data.gen_batch_size); None: data.prompts_per_step."""
    metric: str = "seq_reward"
    """What must differ within a group to keep it: 'seq_reward' (the score after shaping), 'score'
    (the function's score), 'acc' (the function's acc, else its score), 'seq_final_reward' (after a
    KL penalty in the reward too)."""

    def __post_init__(self) -> None:
        _check_choice(
            "algorithm.filter_groups",
            "metric",
            self.metric,
            ("seq_reward", "score", "acc", "seq_final_reward"),
        )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_is_cap: float | None = None
    """Truncated importance sampling cap for rollout/trainer log-prob mismatch; None disables."""


@dataclass
class GuardsConfig:
    """Checks against training on wrong numbers, each on by default (controller/guards.py)."""

    max_probs_gap: float = 0.1
    """At an on-policy step, the largest mean |p_rollout - p_trainer| over response tokens; above it
    the run stops (the two sides are not running one policy). 0: off."""
    max_first_ppo_kl: float = 0.01
    """Where old log-probs are recomputed, the largest |ppo_kl| of a step's first mini-batch (the
    policy has not moved yet); above it the run stops. 0: off."""
    weight_sync_check: bool = True
    """After every weight sync, sampled elements of a few tensors must be equal in the trainer and in
    every engine (LoRA: the merged adapted layers)."""
    gap_growth_warning: bool = True
    """Warn once when the rollout/trainer probability gap keeps growing, naming the step it began."""


@dataclass
class TrainerConfig:
    total_training_steps: int | None = None
    """None: run `total_epochs` passes over the training prompts."""
    total_epochs: int = 1
    save_freq: int = -1
    """Save a checkpoint every N steps (-1: only at the end)."""
    test_freq: int = -1
    val_before_train: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Any of console, jsonl, tensorboard (RUN_DIR/tensorboard), wandb (WANDB_MODE=offline works),
    prometheus (the last step's metrics on http://prometheus_host:prometheus_port/metrics)."""
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9400
    log_samples_freq: int = 10
    """Every N steps (and at step 1) a few generations go to RUN_DIR/samples.jsonl; 0: never."""
    log_samples: int = 4
    """How many generations each time, each from a different prompt."""
    progress: bool = True
    """A progress bar over the steps (with ETA and the phase running) when stderr is a terminal."""
    project_name: str = "hybridflow"
    experiment_name: str = "run"
    run_dir: str = "runs/${trainer.experiment_name}"
    resume: str = "auto"
    """'auto' goes on from the run directory's latest checkpoint (refused when it was made with another
    model, data or algorithm), 'force' goes on from it even then, 'disable' never resumes."""
    resume_unverified: bool = False
    """Resume from a checkpoint whose manifest.json is missing, empty or malformed (one written before
    manifests existed); by default such a checkpoint is skipped, named, like a damaged one."""
    keep_last_checkpoints: int = 1
    """Checkpoints kept (the latest N; resuming needs only the latest). Each holds the weights and
    optimizer state for resuming and the policy as a transformers directory: the run prints what
    one costs."""
    seed: int = 0
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    watchdog_s: float = 3600.0
    """A phase of a step (generation, reward, an update, the weight sync, validation, a checkpoint)
    running longer than this is stuck: every thread's stack goes to RUN_DIR/stacks-stepN.txt and the
    run stops with a line naming the phase (exit status 3). 0 turns the watchdog off."""

    def __post_init__(self) -> None:
        _check_choice("trainer", "resume", self.resume, ("auto", "disable", "force"))


@dataclass
class ResourcesConfig:
    device: str = "auto"
    """'auto' (cuda when present), 'cpu' or 'cuda'."""
    n_gpus_per_node: int = 1
    nnodes: int = 1
    num_workers: int = 1
    """Workers on CPU (device=cpu): more than one runs them as Ray actors joined with gloo, the
    distributed path on a laptop. On GPUs the worker count is n_gpus_per_node x nnodes."""
    rollout_workers: int = 0
    """0: the rollout engine shares every worker's GPU (the hybrid engine). N: the last N workers
    hold only a rollout engine each (disaggregated) and receive the actor's weights by broadcast."""
    ray_address: str | None = None
    """An existing Ray cluster to join (multi-node); None starts a local one when needed."""
    worker_timeout_s: float | None = None
    """Longest wait for one call on the workers (None: no limit). Past it the run stops, naming the
    ranks still busy, and the workers on this node write their stacks to their logs."""

    def __post_init__(self) -> None:
        _check_choice("resources", "device", self.device, ("auto", "cpu", "cuda"))
        if self.rollout_workers < 0:
            raise UserError(f"config resources.rollout_workers={self.rollout_workers} must be >= 0")


@dataclass
class SFTConfig:
    """Supervised fine-tuning (`hybridflow sft`): rows of chat messages (loss on the assistant turns)
    or prompt/response columns (loss on the response). Dotted keys reach nested fields, e.g.
    extra_info.solution."""

    messages_key: str | None = None
    """A column of chat messages; when set, prompt_key/response_key are not used."""
    prompt_key: str = "prompt"
    response_key: str = "response"
    max_tokens: int = 1024
    """Longer examples are dropped (and counted)."""
    batch_size: int = 32
    """Examples per optimizer step; micro-batches pack them to actor.max_tokens_per_microbatch."""

    def __post_init__(self) -> None:
        _check_positive("sft", "max_tokens", self.max_tokens)
        _check_positive("sft", "batch_size", self.batch_size)


@dataclass
class PreferenceConfig:
    """DPO (`hybridflow dpo`: rows prompt/chosen/rejected) and KTO (`hybridflow kto`: rows
    prompt/completion/label). Responses are strings, or messages whose last turn is the response."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    """DPO: sigmoid, ipo, hinge, robust (against the reference), simpo, orpo (reference-free)."""
    label_smoothing: float = 0.0
    simpo_gamma: float = 1.0
    rpo_alpha: float = 0.0
    """DPO: weight of the chosen responses' token-mean NLL added to the loss (TRL's rpo_alpha; Pang
    et al. 2024, "Iterative Reasoning Preference Optimization"): keeps the chosen answers likely when
    chosen and rejected differ in a few tokens, where DPO alone lowers both."""
    desirable_weight: float = 1.0
    """KTO: weights of desirable and undesirable completions."""
    undesirable_weight: float = 1.0
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    completion_key: str = "completion"
    label_key: str = "label"
    max_tokens: int = 1024
    """Longer examples (prompt + longest response) are dropped (and counted)."""
    batch_size: int = 16
    """Pairs (DPO) or completions (KTO) per optimizer step."""
    precompute_ref_logprobs: bool = True
    """DPO: the reference's log-probs once before training (then the reference is freed)."""

    def __post_init__(self) -> None:
        _check_choice(
            "preference", "loss_type", self.loss_type, ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
        )
        _check_positive("preference", "beta", self.beta)
        _check_positive("preference", "batch_size", self.batch_size)
        _check_positive("preference", "rpo_alpha", self.rpo_alpha, allow_zero=True)
        _check_positive("preference", "max_tokens", self.max_tokens)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
