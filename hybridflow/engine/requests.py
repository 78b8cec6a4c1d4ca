"""What the engine's request API hands back: per step, each advanced sample's new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The tokens one sample of a request gained in one `Engine.step()`."""

    request_id: str
    sample: int
    """Which of the request's `params.n` samples (0-based)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Under the sampling distribution (after temperature / top-k / top-p)."""
    unscaled_logprobs: list[float] = field(default_factory=list)
    """Under the model's own distribution."""
    finish_reason: str | None = None
    """None while it runs; 'stop', 'length' or 'abort' on its last output."""
    weight_version: int = 0
    """The engine's weight version these tokens were sampled with (+1 at each update_weights)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
