"""The updates: optimizer, actor, reference, critic, and the algorithm (advantages, KL, dynamic sampling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.checks import check_choice, check_positive
from hybridflow.errors import UserError


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2)."""
    lr_scheduler: str = "constant"
    """'constant', 'cosine' or 'linear' (decay to min_lr_ratio), each after a linear warmup."""
    warmup_steps: int = 0
    """Linear warmup over this many training steps (verl's unit: the schedule moves once per step,
    whatever the mini-batches of a step)."""
    warmup_ratio: float = 0.0
    """With warmup_steps=0: warm up over this fraction of the run's training steps (verl's
    lr_warmup_steps_ratio)."""
    min_lr_ratio: float = 0.0
    """Cosine and linear schedules end at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this before each optimizer step; 0 or less: no clipping."""

    def __post_init__(self) -> None:
        check_choice("optim", "lr_scheduler", self.lr_scheduler, ("constant", "cosine", "linear"))
        check_positive("optim", "lr", self.lr, allow_zero=True)


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The policy's optimizer and learning-rate schedule."""
    sequences_per_update: int | None = None
    """Sequences per optimizer step (a mini-batch); None = the whole step's sequences (one update)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one forward/backward; gradients accumulate over micro-batches."""
    sequences_per_microbatch: int | None = None
    """Optional cap on sequences per micro-batch (verl's ppo_micro_batch_size_per_gpu)."""
    ppo_epochs: int = 1
    """Passes over a step's sequences (each pass in mini-batches of sequences_per_update)."""
    policy_loss: str = "vanilla"
    """The policy-gradient loss: 'vanilla' (PPO's clipped surrogate, dual-clipped), 'gspo', 'cispo', 'gpg',
    'sapo', 'clip_cov', 'kl_cov', 'geo_mean' (docs/algorithms.md)."""
    clip_ratio_low: float = 0.2
    """PPO clip range below 1: the ratio is clipped at 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1: 1 + clip_ratio_high (DAPO's clip-higher sets it above clip_ratio_low)."""
    clip_ratio_c: float = 3.0
    """Dual-clip constant: for negative advantages the loss is capped at clip_ratio_c times the advantage."""
    loss_agg_mode: str = "token-mean"
    """How token losses become one number: 'token-mean' (over all tokens of the mini-batch), 'seq-mean-token-
    mean' (per sequence, then over sequences), 'seq-mean-token-sum', 'seq-mean-token-sum-norm' (Dr. GRPO:
    sums divided by max_response_tokens)."""
    entropy_coeff: float = 0.0
    """Weight of an entropy bonus in the actor loss (0: none)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts policies (Qwen3-MoE, Mixtral): weight of the routers' load-balancing loss
    (Switch Transformer's, over every MoE layer's tokens, as transformers computes it) in the actor
    loss; 0: none (transformers adds it only with output_router_logits; its configs give 0.001)."""
    router_replay: str = "disabled"
    """Mixture-of-experts policies: 'R3' (rollout routing replay) has the engine record the experts
    every token went to and the trainer's forwards (old log-probs, updates) route those tokens to the
    same experts, weighted by the trainer's router (which still trains), so that routing flips between
    the engine's numerics and the trainer's do not move the log-probs; 'R2' (routing replay) records
    the experts of the trainer's own old-log-prob pass and has every update route to them, so the
    routing stays that of pi_old across mini-batches and epochs (where no pass of pi_old runs — one
    update a step, on-policy — the update's own forward is that pass and nothing is replayed; bypass
    mode, which skips it, is refused); 'disabled': each forward routes itself."""
    use_kl_loss: bool = False
    """Add a KL penalty against the reference policy to the actor loss (GRPO's way; needs the reference)."""
    kl_loss_coef: float = 0.001
    """Weight of that KL loss."""
    kl_loss_type: str = "low_var_kl"
    """Its estimator: 'kl'/'k1', 'abs', 'mse'/'k2', 'low_var_kl'/'k3'."""
    compute_dtype: str = "auto"
    """Autocast dtype for forward/backward: 'auto' (bfloat16 on CUDA, float32 on CPU, where bf16 matmuls
    are only fast with AMX), 'bfloat16', 'float16' (with a dynamic loss scale, as float16 gradients
    underflow: roles/loss_scale.py; GPUs without bfloat16) or 'float32' (no autocast). The rollout
    engine computes in the same dtype."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism: split each packed micro-batch's tokens over this many workers (attention
    heads exchanged by all-to-all)."""
    tensor_parallel_size: int = 1
    """Tensor parallelism of the actor, reference and critic over this many consecutive workers (attention
    heads, MLP channels and the vocabulary split; log-probs computed without gathering the
    vocabulary; a mixture-of-experts layer's experts split whole, num_experts / size each), FSDP2 over
    the groups. rollout.tensor_parallel_size splits the engine."""
    expert_parallel_size: int = 1
    """Mixture-of-experts policies: split each MoE layer's experts over groups of this many consecutive
    workers (it divides the training workers and num_experts) instead of sharding them by FSDP2: each
    worker keeps num_experts / size whole experts for the actor, reference and critic, the tokens
    travel to them (two all-to-alls per MoE layer and pass) rather than the experts' weights to the
    tokens, and the groups sum their experts' gradients before each step. The rollout engine still
    holds a whole copy of the policy."""
    offload_params: bool = False
    """Keep the actor's sharded weights in CPU memory between uses (less GPU memory, slower steps)."""
    offload_optimizer: bool = False
    """Keep the optimizer state in CPU memory; the optimizer steps there."""

    def __post_init__(self) -> None:
        check_choice(
            "actor",
            "loss_agg_mode",
            self.loss_agg_mode,
            ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
        )
        check_choice("actor", "compute_dtype", self.compute_dtype, ("auto", "bfloat16", "float16", "float32"))
        check_choice("actor", "router_replay", self.router_replay, ("disabled", "R2", "R3"))
        check_positive("actor", "max_tokens_per_microbatch", self.max_tokens_per_microbatch)
        check_positive("actor", "ppo_epochs", self.ppo_epochs)
        check_positive("actor", "sequence_parallel_size", self.sequence_parallel_size)
        check_positive("actor", "tensor_parallel_size", self.tensor_parallel_size)
        check_positive("actor", "expert_parallel_size", self.expert_parallel_size)


@dataclass
class RefConfig:
    model_path: str | None = None
    """The reference policy (an HF directory with the policy's tokenizer); None: the policy's starting
    weights."""
    max_tokens_per_microbatch: int = 16384
    """Token budget of one reference forward pass."""
    offload_params: bool = False
    """Keep the reference weights in CPU memory between uses."""


@dataclass
class CriticConfig:
    model_path: str | None = None
    """None initialises the critic from the policy's backbone."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """The critic's optimizer (default lr 1e-5)."""
    max_tokens_per_microbatch: int = 8192
    """Token budget of one critic forward/backward."""
    cliprange_value: float = 0.5
    """Value clipping: new values stay within this of the old ones in the clipped value loss."""
    loss_agg_mode: str = "token-mean"
    """How the value loss is aggregated (as actor.loss_agg_mode)."""
    warmup_steps: int = 0
    """RL steps during which only the critic is updated (verl's critic_warmup)."""


@dataclass
class KLControlConfig:
    type: str = "fixed"
    """'fixed' (kl_coef throughout) or 'adaptive' (kl_coef moves toward target_kl over horizon, Ziegler et al.
    2019)."""
    kl_coef: float = 0.001
    """Weight of the KL penalty in the reward (algorithm.use_kl_in_reward), the start value when adaptive."""
    target_kl: float = 0.1
    """Adaptive: the KL per token the coefficient steers toward."""
    horizon: int = 10000
    """Adaptive: the number of sequences over which the coefficient may change by up to 20%."""

    def __post_init__(self) -> None:
        check_choice("algorithm.kl_ctrl", "type", self.type, ("fixed", "adaptive"))


@dataclass
class FilterGroupsConfig:
    enable: bool = False
    """DAPO dynamic sampling: drop groups whose scores all agree, regenerate to fill the step."""
    max_generation_rounds: int = 4
    """Most generation rounds a step may take to fill itself with groups that carry signal; then the run stops,
    naming the count."""
    prompts_per_round: int | None = None
    """Prompts sampled per generation round (verl's data.gen_batch_size); None: data.prompts_per_step."""
    metric: str = "seq_reward"
    """What must differ within a group to keep it: 'seq_reward' (the score after shaping), 'score'
    (the function's score), 'acc' (the function's acc, else its score), 'seq_final_reward' (after a
    KL penalty in the reward too)."""

    def __post_init__(self) -> None:
        check_choice(
            "algorithm.filter_groups",
            "metric",
            self.metric,
            ("seq_reward", "score", "acc", "seq_final_reward"),
        )


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction: the batch was sampled by the rollout engine's policy (older
    by up to rollout.max_staleness updates in an asynchronous run, and numerically different in any
    run); these reweight or reject its tokens by log(pi_old / pi_rollout) per token."""

    rollout_is: str | None = None
    """Truncated importance weights: 'token' (min(pi_old/pi_rollout, threshold) per token),
    'sequence' (the product over the sequence, truncated, on all its tokens); None: off."""
    rollout_is_threshold: float = 2.0
    """The truncation cap of those weights."""
    rollout_is_batch_normalize: bool = False
    """Scale the weights to mean 1 over the batch's tokens."""
    rollout_rs: str | None = None
    """Rejection: tokens or whole sequences whose divergence passes rollout_rs_threshold leave the actor's
    loss. Options (comma-separated, all must pass): token_k1|k2|k3, seq_sum_k1|k2|k3,
    seq_mean_k1|k2|k3, seq_max_k2|k3 (k1 = -log ratio, k2 = log ratio^2/2, k3 = ratio - 1 - log ratio)."""
    rollout_rs_threshold: str | float | int | None = None
    """One entry shared by every rollout_rs option or one per option, comma-separated: 'lower_upper'
    ratio bounds for k1 options (e.g. '0.5_2.0'; quoted on a command line or in YAML, where 0.5_2
    reads as the number 0.52), one upper bound for the others."""
    bypass_mode: bool = False
    """False (decoupled PPO, three policies): the trainer recomputes pi_old, the PPO ratio is against
    it, and the corrections weigh pi_old against pi_rollout. True (two policies): pi_old is the
    rollout's own log-probs, nothing is recomputed, and the PPO ratio itself corrects."""

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def __post_init__(self) -> None:
        from hybridflow.algorithms.rollout_correction import parse_options, parse_thresholds

        if self.rollout_is is not None:
            check_choice("algorithm.rollout_correction", "rollout_is", self.rollout_is, ("token", "sequence"))
        check_positive("algorithm.rollout_correction", "rollout_is_threshold", self.rollout_is_threshold)
        if self.rollout_rs is not None:
            try:
                options = parse_options(self.rollout_rs)
                if self.rollout_rs_threshold is None:
                    raise ValueError(f"rollout_rs={self.rollout_rs!r} needs rollout_rs_threshold")
                parse_thresholds(options, self.rollout_rs_threshold)
            except ValueError as e:
                raise UserError(f"config algorithm.rollout_correction: {e}") from None
        if self.bypass_mode and self.enabled:
            raise UserError(
                "algorithm.rollout_correction.bypass_mode=true takes pi_old from the rollout, so "
                "rollout_is / rollout_rs would compare it with itself; turn them off or bypass_mode=false"
            )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """How advantages are computed: 'gae' (PPO with a critic), 'grpo', 'grpo_passk', 'rloo', 'opo', 'gpg',
    'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'remax' (docs/algorithms.md)."""
    gamma: float = 1.0
    """Discount factor of returns (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda: 1 uses full returns, 0 one-step TD."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO divides each group's centred scores by their standard deviation; false: centred only (Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef x KL(policy || reference) from the token rewards (PPO's way; needs the
    reference)."""
    kl_penalty: str = "kl"
    """The KL estimator of that penalty: 'kl'/'k1', 'abs', 'mse'/'k2', 'low_var_kl'/'k3'."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Its coefficient, fixed or adaptive."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Off-policy corrections between the rollout's policy and the trainer's (verl's names)."""
