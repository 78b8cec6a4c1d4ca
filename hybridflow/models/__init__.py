"""Models: loaders (HF directory, GGUF, embedded default, tiny random), HF export."""

from hybridflow.models.export import save_hf
from hybridflow.models.loading import load_causal_lm, load_tokenizer, stop_token_ids
from hybridflow.models.tiny import byte_tokenizer, tiny_config, tiny_model

__all__ = [
    "byte_tokenizer",
    "load_causal_lm",
    "load_tokenizer",
    "save_hf",
    "stop_token_ids",
    "tiny_config",
    "tiny_model",
]
