"""Scoring: rule functions, sandboxed code, a reward model, shaping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.checks import check_choice


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's soft overlong punishment: responses near data.max_response_tokens lose reward."""
    buffer_tokens: int = 64
    """The penalty starts this many tokens before max_response_tokens and grows linearly to -penalty_factor at
    it."""
    penalty_factor: float = 1.0
    """The penalty at max_response_tokens."""


@dataclass
class RewardConfig:
    custom_function_path: str | None = None
    """A Python file defining the reward function (verl's custom_reward_function.path)."""
    custom_function_name: str = "compute_score"
    """The function's name in that file (verl's custom_reward_function.name)."""
    import_timeout_s: float = 120.0
    """The reward file is imported once in a child process at start: an import that hangs past this,
    or exits, stops the run with one line before anything else imports it."""
    custom_function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the function is called with, besides the sample's (verl's
    custom_reward_function.reward_kwargs): reward.custom_function_kwargs.scale=2."""
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
    """score = correctness + format_weight * (response matches format_pattern); 0: no format score."""
    code_all_or_nothing: bool = False
    """Code rewards: 1 only when every test passes; false: the fraction of tests passed."""
    sandbox_timeout_s: float = 5.0
    """Wall limit of one sandboxed program of a code reward (each test runs as its own program)."""
    sandbox_memory_mb: int = 1024
    """Memory limit of one sandboxed program (with its child processes)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft penalty on responses near the length limit."""
    model_path: str | None = None
    """Optional reward model (an HF sequence-classification directory) scored alongside rule rewards."""
    model_weight: float = 1.0
    """Weight of the reward model's score (see rule_weight)."""
    rule_weight: float = 1.0
    """score = rule_weight * rule score + model_weight * reward-model score (when a model is set)."""
    model_max_tokens_per_microbatch: int = 8192
    """Token budget of one reward-model forward pass."""

    def __post_init__(self) -> None:
        check_choice("reward", "on_all_errors", self.on_all_errors, ("stop", "warn"))
