"""Generation: the rollout backend, sampling, the engine, multi-turn agents."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.checks import check_choice, check_positive
from hybridflow.errors import UserError


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
    """Subtracted from the episode's reward when on_malformed=end ends it."""
    tool_timeout_s: float = 30.0
    """One tool call's deadline, its wait for a free slot included; a sandboxed program is stopped at it."""
    max_tool_output_chars: int = 4000
    """A tool's output is cut to this many characters (tool_output_keep says which part stays)."""
    tool_output_keep: str = "start"
    """What is kept of a longer tool output: its 'start', its 'end', or both 'ends' (verl's
    tool_response_truncate_side left / right / middle)."""
    max_concurrent_tools: int = 64
    """Tool calls (or environment steps) running at once over all episodes of a step, each plain
    function in a thread of the loop's own pool of this size."""
    code_tool_concurrency: int = 0
    """Sandboxed programs (the python tool) running at once; 0: one per CPU core."""
    code_tool_memory_mb: int = 1024
    """Memory of one sandboxed program (with its child processes)."""
    step_timeout_s: float = 30.0
    """An environment's reset or step past it ends the episode ('error')."""

    def __post_init__(self) -> None:
        check_choice("rollout.agent", "loop", self.loop, ("", "tools", "environment"))
        if self.loop == "tools" and not (self.tools or self.tool_config):
            raise UserError(
                "rollout.agent.loop=tools (verl: multi_turn.enable=True) needs rollout.agent.tools (e.g. [python]) "
                "or rollout.agent.tool_config (verl: multi_turn.tool_config_path)"
            )
        if self.loop == "environment" and not self.environment:
            raise UserError(
                "rollout.agent.loop=environment needs rollout.agent.environment (e.g. guess_number)"
            )
        check_choice("rollout.agent", "on_malformed", self.on_malformed, ("feedback", "end"))
        check_choice("rollout.agent", "tool_format", self.tool_format, ("", "hermes", "mistral", "llama3"))
        check_choice("rollout.agent", "tool_output_keep", self.tool_output_keep, ("start", "end", "ends"))
        counts = ("max_tool_turns", "max_tool_calls", "max_parallel_calls", "code_tool_concurrency")
        if self.max_turns < 1 or any(getattr(self, k) < 0 for k in counts):
            raise UserError(f"rollout.agent.max_turns must be >= 1 and {', '.join(counts)} >= 0")


@dataclass
class SpeculativeRolloutConfig:
    """Native engine: speculative decoding with drafts from the run's own history, no draft model
    (engine/drafter.py): an n-gram index over the prompt, its other samples in flight and the
    responses to it in earlier steps and epochs (and, in an agent episode, the turns so far: they are
    in the next turn's prompt). While few sequences run (the tail of a step, where a decode step reads
    all the weights for a few tokens) each step checks every sequence's draft in one forward and keeps
    the drafted tokens up to the first that the plain engine would not have drawn, then the one it
    would: tokens and log-probs are the plain engine's, only fewer forwards. Metrics:
    rollout/speculative_*."""

    num_speculative_tokens: int = 0
    """Tokens drafted per sequence and step (vLLM's name); 0: off."""
    prompt_lookup_max: int = 4
    """Longest n-gram looked up (vLLM's name for its prompt lookup); shorter ones down to
    prompt_lookup_min are tried in turn."""
    prompt_lookup_min: int = 2
    """Shortest n-gram looked up."""
    max_batch_sequences: int | None = None
    """Speculate while at most this many sequences run; more run plain decode steps. None: by device
    (32 on a GPU, where a step reads the weights once for dozens of rows; 4 on a CPU, whose matmuls
    are bound by arithmetic from a few rows on)."""
    history_tokens: int = 4_000_000
    """Tokens of finished responses the engine keeps as drafts for the same prompts later (4 bytes a
    token), the least recently seen prompts' dropped first."""
    adaptive: bool = True
    """Speculate only while it measures faster than plain decode runs in this engine (the tokens a
    running sequence gains per second of each, measured as the engine runs; the slower is tried
    again now and then); false: whenever a sequence has a draft."""

    def __post_init__(self) -> None:
        check_positive(
            "rollout.speculative", "num_speculative_tokens", self.num_speculative_tokens, allow_zero=True
        )
        check_positive("rollout.speculative", "prompt_lookup_min", self.prompt_lookup_min)
        if self.max_batch_sequences is not None:
            check_positive("rollout.speculative", "max_batch_sequences", self.max_batch_sequences)
        check_positive("rollout.speculative", "history_tokens", self.history_tokens, allow_zero=True)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise UserError(
                f"config rollout.speculative.prompt_lookup_max={self.prompt_lookup_max} is below "
                f"prompt_lookup_min={self.prompt_lookup_min}"
            )


@dataclass
class RolloutConfig:
    backend: str = "auto"
    """'native' (the built-in engine: paged KV cache, continuous batching, CUDA graphs), 'hf'
    (transformers generate, the reference), 'vllm', or 'auto' (native when the policy runs our model)."""
    samples_per_prompt: int = 4
    """Responses (or episodes) per prompt: GRPO's group size (verl's rollout.n)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts: the smallest set of tokens with this much probability; 1
    disables."""
    top_k: int = -1
    """-1 disables top-k."""
    gpu_memory_utilization: float = 0.5
    """Native engine: the share of the GPU memory free when it starts that its KV pool may take (vLLM: of the
    whole GPU)."""
    max_staleness: float | None = None
    """With trainer.async_mode one_step or streaming: the most policy updates between a group's oldest
    token and the policy that trains on it, enforced by admission (a group waits to start; finished
    work is never discarded). None: 0 when async_mode=off, 1 otherwise; 0 in any mode is the
    synchronous run, bit for bit. A fraction admits that share of one more step's groups early
    (verl's async_training.staleness_threshold): 0.25 lets a quarter of the next step's groups start
    under the policy before the one that trains on them, 1.5 a whole step and half of the next."""
    pause_for_training: bool | None = None
    """trainer.async_mode=streaming with the engine in the trainer's process (one GPU, or this CPU): the
    engine generates until the groups of the step to train next have finished, then pauses between two
    of its steps while the trainer computes, and goes on after the weight update with the sequences in
    flight (partial rollouts), so each side has the device to itself, generation never runs a step's
    tail alone (the next steps' groups fill the batch), and where it pauses is set by its own steps:
    the same run every time, resumed exactly after a kill. On a GPU its KV pool is freed while it
    pauses (rollout.free_cache_engine), so the memory plan is the synchronous run's. False: the engine
    generates beside the trainer's phases on a CUDA stream of its own (they contend for the device, and
    the pool stays beside training). None: True for such a streaming run. Rollout workers have devices
    of their own and never pause. The gain is the long tail's: with responses up to 4,096 tokens on one
    H200, a steady step 1.28x / 1.35x / 1.51x shorter than synchronous at max_staleness 1 / 2 / 3
    (beside the trainer: 1.02x; docs/benchmarks.md), for batches that many updates old at most."""
    keep_kv_on_weight_update: bool = False
    """trainer.async_mode=streaming: a weight update leaves the sequences in flight the K/V they have,
    computed with the older weights, instead of prefilling each again (prompt and tokens so far) with
    the new ones: no recomputation after each update (async/recomputed_tokens), and the tokens
    sampled after it attend to older K/V (PipelineRL's in-flight updates; the sampler's log-probs
    are still the ones the tokens were drawn with, so the off-policy corrections hold, and
    training/rollout_probs_diff_kept_kv_* measures how far they are from the trainer's). An engine
    that pauses for training then keeps its KV pool while paused (the memory plan holds it beside
    training). A resume recomputes the K/V of the sequences in flight (a checkpoint holds tokens,
    not K/V), so it is not the uninterrupted run token for token."""
    exact_logprobs: bool = False
    """Native engine and model, on CUDA: the engine and the trainer run every forward through the same
    batch-invariant kernels (hybridflow/kernels: matmuls with K in fixed chunks, RMSNorm a row per
    program, attention over 64-key blocks from position 0 merged in order), so each sampled token's
    log-prob is the trainer's to the bit: pi_old is the engine's (no recompute pass), the rollout
    corrections are exactly 1, and every step checks training/rollout_probs_diff_max == 0 (fresh
    tokens of an asynchronous run), stopping with one line if a token differs. It also turns on
    trainer.deterministic's settings in every process (the run is to repeat). Not yet with LoRA,
    mixture-of-experts models, tensor or sequence parallelism, compiled layers, top-k / top-p (the
    trainer scores the whole distribution); what it costs is in docs/benchmarks.md."""
    tensor_parallel_size: int = 1
    """Native engine: split each engine over this many consecutive training workers (heads, KV heads,
    MLP channels, vocabulary rows, whole experts of an MoE layer; the same prompts on each, one
    all-reduce after attention and after the MLP), so a model that one GPU cannot hold with its KV cache
    generates; the actor's TP groups when actor.tensor_parallel_size equals it, groups of consecutive
    workers of its own otherwise (the actor at TP 2 can feed engines at TP 4, or 1): at a sync each
    rank receives, a layer at a time, only the parts of its slices its trainer shard lacks;
    on rollout workers of their own (resources.rollout_workers, a multiple of it), consecutive workers
    split each engine and the actor's rank 0 sends each its slices of every layer; synchronous generation
    (vLLM's / verl's tensor_model_parallel_size). Decode steps replay CUDA graphs with the
    all-reduces inside (cuda_graphs); the fused layers are a whole engine's only: slower than whole
    engines where those fit."""
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
    speculative: SpeculativeRolloutConfig = field(default_factory=SpeculativeRolloutConfig)
    """Speculative decoding from the run's own history (SpeculativeRolloutConfig); off by default."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes with tools or an environment (AgentConfig); off by default."""
    server: bool = False
    """Native engine, one training worker: also serve the policy being trained over the OpenAI API
    (`hybridflow serve`'s routes and /metrics) at http://server_host:server_port/v1, written to
    RUN_DIR/policy_server.json; the trainer's own generation then goes through the same engine."""
    server_host: str = "127.0.0.1"
    """Address of the policy server (rollout.server); 0.0.0.0 serves every interface."""
    server_port: int = 0
    """0: a free port."""
    server_api_processes: int = 1
    """HTTP front processes of the policy server (hundreds of concurrent agents: 4 or so)."""
    val_samples_per_prompt: int = 1
    """Responses per held-out prompt in validation (mean@n, best@n, maj@n)."""
    val_temperature: float = 0.0
    """0 means greedy."""
    val_top_p: float = 1.0
    """Validation's own top-p (verl's val_kwargs.top_p): rollout.top_p is not applied to validation."""
    val_top_k: int = -1
    """Validation's own top-k (verl's val_kwargs.top_k); -1 disables."""

    def __post_init__(self) -> None:
        check_choice("rollout", "backend", self.backend, ("auto", "native", "hf", "vllm"))
        check_positive("rollout", "samples_per_prompt", self.samples_per_prompt)
        check_positive("rollout", "decode_steps", self.decode_steps)
        check_positive("rollout", "tensor_parallel_size", self.tensor_parallel_size)
        check_positive("rollout", "server_api_processes", self.server_api_processes)
        check_positive("rollout", "temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise UserError(f"config rollout.top_p={self.top_p} must be in (0, 1]")
        if self.exact_logprobs and (self.top_p < 1 or self.top_k > 0):
            raise UserError(
                f"config rollout.exact_logprobs=true with rollout.top_p={self.top_p}, rollout.top_k={self.top_k}: "
                "the trainer's log-probs are of the whole distribution, a truncated draw's are not: "
                "set top_p=1 and top_k=-1, or exact_logprobs=false"
            )
        if self.exact_logprobs and self.temperature == 0:
            raise UserError(
                "config rollout.exact_logprobs=true with rollout.temperature=0: greedy rollouts have no "
                "sampling distribution to train on; set a temperature > 0"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(
                f"config rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
