"""The offline trainers: SFT, DPO and KTO."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.checks import check_choice, check_positive


@dataclass
class SFTConfig:
    """Supervised fine-tuning (`hybridflow sft`): rows of chat messages (loss on the assistant turns)
    or prompt/response columns (loss on the response). Dotted keys reach nested fields, e.g.
    extra_info.solution."""

    messages_key: str | None = None
    """A column of chat messages; when set, prompt_key/response_key are not used."""
    prompt_key: str = "prompt"
    """Column of the prompt (a string or chat messages) for prompt/response rows."""
    response_key: str = "response"
    """Column of the response (the loss is on it alone)."""
    max_tokens: int = 1024
    """Longer examples are dropped (and counted)."""
    batch_size: int = 32
    """Examples per optimizer step; micro-batches pack them to actor.max_tokens_per_microbatch."""

    def __post_init__(self) -> None:
        check_positive("sft", "max_tokens", self.max_tokens)
        check_positive("sft", "batch_size", self.batch_size)


@dataclass
class PreferenceConfig:
    """DPO (`hybridflow dpo`: rows prompt/chosen/rejected) and KTO (`hybridflow kto`: rows
    prompt/completion/label). Responses are strings, or messages whose last turn is the response."""

    beta: float = 0.1
    """Strength of the implicit KL against the reference (DPO's and KTO's beta)."""
    loss_type: str = "sigmoid"
    """DPO: sigmoid, ipo, hinge, robust (against the reference), simpo, orpo (reference-free)."""
    label_smoothing: float = 0.0
    """DPO: the probability that a pair's labels are flipped (conservative DPO); 0: none."""
    simpo_gamma: float = 1.0
    """SimPO's target reward margin."""
    rpo_alpha: float = 0.0
    """DPO: weight of the chosen responses' token-mean NLL added to the loss (TRL's rpo_alpha; Pang
    et al. 2024, "Iterative Reasoning Preference Optimization"): keeps the chosen answers likely when
    chosen and rejected differ in a few tokens, where DPO alone lowers both."""
    desirable_weight: float = 1.0
    """KTO: weights of desirable and undesirable completions."""
    undesirable_weight: float = 1.0
    """KTO: weight of undesirable completions."""
    prompt_key: str = "prompt"
    """Column of the prompt."""
    chosen_key: str = "chosen"
    """DPO: column of the preferred response."""
    rejected_key: str = "rejected"
    """DPO: column of the dispreferred response."""
    completion_key: str = "completion"
    """KTO: column of the completion."""
    label_key: str = "label"
    """KTO: column of the label (true: desirable)."""
    max_tokens: int = 1024
    """Longer examples (prompt + longest response) are dropped (and counted)."""
    batch_size: int = 16
    """Pairs (DPO) or completions (KTO) per optimizer step."""
    precompute_ref_logprobs: bool = True
    """DPO: the reference's log-probs once before training (then the reference is freed)."""

    def __post_init__(self) -> None:
        check_choice(
            "preference", "loss_type", self.loss_type, ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
        )
        check_positive("preference", "beta", self.beta)
        check_positive("preference", "batch_size", self.batch_size)
        check_positive("preference", "rpo_alpha", self.rpo_alpha, allow_zero=True)
        check_positive("preference", "max_tokens", self.max_tokens)
