"""Version shims for other libraries live here and only here."""

from __future__ import annotations


def gguf_supported_architectures() -> list[str] | None:
    """Architectures transformers can read from GGUF, or None when this version does not say."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:
        return None
    return list(GGUF_SUPPORTED_ARCHITECTURES)
