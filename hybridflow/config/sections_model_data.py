"""The policy model and the prompt data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.checks import check_choice, check_positive
from hybridflow.errors import UserError


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
    lora_merged_forward: bool = False
    """Native LoRA: the trainer computes each adapted layer with the merged weight W + s B A (rounded
    to the compute dtype as the engine's merged copy is) instead of W x + s B (A x), so that in bf16
    both sides run the same weights, as full fine-tuning's do; costs a full weight gradient per adapted
    layer in the backward pass."""
    enable_gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass: less memory, about a third more
    compute."""
    compile: bool = False
    """torch.compile the native model's layers (the parts around attention: fused norms, RoPE and
    SwiGLU), in the trainer and in the built-in rollout engine; costs a compile at start and pays off
    on GPU (see docs/benchmarks.md)."""
    use_remove_padding: bool = True
    """Pack sequences without padding (the native model always does; kept for verl recipes)."""
    trust_remote_code: bool = False
    """Let transformers run the model directory's own Python code (models it does not ship)."""
    cache_dir: str | None = None
    """Where converted models are cached; default ~/.cache/hybridflow (or $HYBRIDFLOW_CACHE)."""

    def __post_init__(self) -> None:
        check_choice("model", "impl", self.impl, ("auto", "hf", "native"))
        check_choice("model", "dtype", self.dtype, ("float32", "bfloat16", "float16"))
        if self.lora_merged_forward and not (self.lora_rank or self.lora_adapter_path):
            raise UserError("model.lora_merged_forward=true applies to LoRA adapters; set model.lora_rank")


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt datasets: parquet, jsonl/json, or `datasets.save_to_disk` directories."""
    task: str | None = None
    """A built-in task ('arithmetic', 'countdown') written into the cache and used when train_files is empty."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Options of the built-in task: train_size, test_size, seed, and the task's own (e.g. max_digits)."""
    val_files: list[str] = field(default_factory=list)
    """Held-out prompt datasets (same formats) for validation every trainer.test_freq steps; none: no
    validation."""
    prompt_key: str = "prompt"
    """Column holding the prompt: chat messages (verl schema) or a plain string."""
    answer_key: str | None = None
    """Column holding the ground truth for plain rows; verl rows use reward_model.ground_truth."""
    data_source: str | None = None
    """data_source for rows that lack the column (chooses the reward scorer)."""
    max_prompt_tokens: int = 512
    """Longest prompt in tokens, chat template included (longer ones: see overlong_prompts)."""
    max_response_tokens: int = 512
    """Most tokens generated per response (per episode with rollout.agent, tool output included)."""
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
    """Render prompts with the tokenizer's chat template; false: a string prompt is tokenized as it is."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the tokenizer's chat template, e.g. {enable_thinking: false} (verl's
    data.apply_chat_template_kwargs)."""
    system_prompt: str | None = None
    """A system message put before every prompt that has none."""
    shuffle: bool = True
    """Draw each epoch's prompts in a seeded random order (trainer.seed); false: file order."""
    max_val_prompts: int | None = None
    """Validate on the first N held-out prompts only; None: all of them."""
    cache_tokenized: bool = True
    """Tokenize each data file once and read the cached prompts after (under model.cache_dir, or
    $HYBRIDFLOW_CACHE or ~/.cache/hybridflow, in prompts/; keyed by file contents, tokenizer, template
    and these data.* settings)."""

    def __post_init__(self) -> None:
        check_choice(
            "data",
            "overlong_prompts",
            self.overlong_prompts,
            ("filter", "error", "truncate_left", "truncate_right"),
        )
        check_choice("data", "on_bad_row", self.on_bad_row, ("error", "skip"))
        for name in ("max_prompt_tokens", "max_response_tokens", "prompts_per_step"):
            check_positive("data", name, getattr(self, name))
