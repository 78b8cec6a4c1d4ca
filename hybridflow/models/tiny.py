"""Tiny random-weight models and a byte-level tokenizer: real code paths with no downloads (tests, CI)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from hybridflow.errors import UserError

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Family -> (transformers model_type, family-specific config fields)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {"tie_word_embeddings": True}),
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    "mistral": ("mistral", {"tie_word_embeddings": False, "sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {"tie_word_embeddings": True, "head_dim": 16}),
    # mixture of experts: 4 experts, 2 a token; Qwen3-MoE with a dense first layer (mlp_only_layers)
    "qwen3_moe": (
        "qwen3_moe",
        {
            "tie_word_embeddings": False,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "decoder_sparse_step": 1,
        },
    ),
    "mixtral": (
        "mixtral",
        {
            "tie_word_embeddings": False,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": None,
        },
    ),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer (256 bytes + ChatML specials) with a ChatML chat template."""
    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort(key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        chat_template=CHATML_TEMPLATE,
    )


def _byte_of(char: str) -> int:
    # ByteLevel maps printable bytes to themselves and the rest to U+0100.. in byte order
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def tiny_config(family: str = "llama", **overrides):
    """A 2-layer config of the given family with a vocabulary that fits the byte tokenizer."""
    if family not in FAMILIES:
        raise UserError(f"unknown tiny model family {family!r}; choose one of {', '.join(FAMILIES)}")
    model_type, extra = FAMILIES[family]
    fields = dict(
        vocab_size=len(byte_tokenizer()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>") + 256,
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>") + 256,
    )
    fields.update(extra)
    fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def tiny_model(family: str = "llama", *, seed: int = 0, dtype=torch.float32, **overrides) -> PreTrainedModel:
    """A random-weight 2-layer model; the same seed gives the same weights."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
