from __future__ import annotations

import pytest
import torch

from hybridflow.models import byte_tokenizer, save_hf, tiny_model


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """An HF directory holding a tiny random llama and the byte tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_hf(tiny_model("llama", seed=1), byte_tokenizer(), path, overwrite=True)
    return path
