"""The OpenAI request bodies we accept, checked with pydantic. What we cannot honour is refused with
a 400 that names the field (a penalty, top log-probs, n-best): a client never gets a completion
sampled other than it asked. Fields that change nothing about sampling (user, metadata, ...) pass."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hybridflow.rollout.sampling import SamplingParams


class Unsupported(ValueError):
    """A field set to a value the engine cannot honour: (param, message)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # extension (vLLM's name)
    n: int = Field(1, ge=1, le=256)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = []  # extension (vLLM's name)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    return_token_ids: bool = False  # extension: prompt and completion token ids (training never re-tokenizes)

    def check(self) -> None:
        """Raise Unsupported for what the engine cannot honour."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise Unsupported(name, f"{name} is not supported by this server; leave it at 0")
        if self.logit_bias:
            raise Unsupported("logit_bias", "logit_bias is not supported by this server")
        if self.top_k < -1:
            raise Unsupported("top_k", f"top_k must be -1 or 0 (off) or positive, not {self.top_k}")
        self.stop_strings  # noqa: B018 (checks them)

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise Unsupported("stop", "a stop string is empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            seed=self.seed,
        )


class ChatCompletionRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension: e.g. enable_thinking
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check(self) -> None:
        super().check()
        if self.top_logprobs:
            raise Unsupported(
                "top_logprobs",
                "top_logprobs is not supported; logprobs=true gives each sampled token's log-prob",
            )
        if self.tool_choice not in (None, "auto", "none"):
            raise Unsupported(
                "tool_choice", f"tool_choice {self.tool_choice!r} is not supported; use 'auto' or 'none'"
            )
        if self.response_format not in (None, {"type": "text"}):
            raise Unsupported("response_format", "response_format other than text is not supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise Unsupported(
                "continue_final_message", "continue_final_message needs add_generation_prompt=false"
            )
        for i, message in enumerate(self.messages):
            if not isinstance(message.get("role"), str):
                raise Unsupported(f"messages[{i}].role", f"message {i} has no role")

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs not in (None, 0):
            raise Unsupported(
                "logprobs",
                "logprobs above 0 (top alternatives) is not supported; logprobs=0 gives each sampled token's",
            )
        if self.echo:
            raise Unsupported("echo", "echo is not supported")
        if self.suffix:
            raise Unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise Unsupported("best_of", "best_of is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise Unsupported("prompt", "prompt is empty")

    @property
    def limit(self) -> int | None:
        return self.max_tokens if "max_tokens" in self.model_fields_set else 16  # OpenAI's default

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p or isinstance(p[0], int):  # one prompt of token ids (the type allows no mix)
            return [p]
        return list(p)
