"""Load a causal LM and its tokenizer from 'default', an HF directory, or a GGUF file."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.compat import gguf_supported_architectures
from hybridflow.devices import DTYPES
from hybridflow.errors import UserError
from hybridflow.models.hf_filled import filled_hf_model

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def load_causal_lm(
    path: str,
    *,
    impl: str = "hf",
    dtype: str | torch.dtype = "float32",
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model in eval mode, tokenizer with a pad token) for `path`:
    'default' (embedded SmolLM2-135M-Instruct), an HF model directory, or a `.gguf` file.
    impl 'native' is our padding-free model (Llama/Mistral/Qwen2/Qwen3; an error for others);
    'hf' the transformers model; 'auto' native when supported, else transformers (logged)."""
    if impl not in ("hf", "auto", "native"):
        raise UserError(f"model impl {impl!r} is unknown; use 'native', 'hf' or 'auto'")
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    p = _model_path(path, cache_dir)
    if p.is_file():
        if p.suffix != ".gguf":
            raise UserError(f"model file {path} is not a .gguf file; pass an HF model directory or a .gguf")
        model, tokenizer = load_gguf(p, dtype=torch_dtype)
    else:
        model, tokenizer = _load_hf_dir(p, torch_dtype, trust_remote_code)
    _ensure_pad_token(tokenizer)
    if impl in ("native", "auto"):
        from hybridflow.models import native

        if native.supports(model.config):
            return native.from_hf_model(model), tokenizer
        if impl == "native":
            raise UserError(
                f"model type {model.config.model_type!r} has no native implementation; use model.impl=hf"
            )
        log.info(
            "model type %s has no native implementation; using transformers (padded batches)",
            model.config.model_type,
        )
    return model.eval(), tokenizer


def stop_token_ids(model, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Where generation stops, as transformers' `generate` stops: the tokenizer's EOS and every id of
    the model's generation_config.eos_token_id (an int or a list: Qwen2.5-Instruct's names both
    <|im_end|> and <|endoftext|>)."""
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None) if config is not None else None
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return list(dict.fromkeys(t for t in [tokenizer.eos_token_id, *extra] if t is not None))


def load_tokenizer(
    path: str, *, cache_dir: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer of `path` alone (with a pad token), as `load_causal_lm` would return it."""
    p = _model_path(path, cache_dir)
    if p.is_file():
        if p.suffix != ".gguf":
            raise UserError(f"model file {path} is not a .gguf file; pass an HF model directory or a .gguf")
        tokenizer = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    _ensure_pad_token(tokenizer)
    return tokenizer


def _model_path(path: str, cache_dir: str | None) -> Path:
    """'default' (the embedded model's cached directory) or the given path, which must exist."""
    if path == "default":
        from hybridflow.models.default import default_model_dir

        return default_model_dir(cache_dir)
    p = Path(path).expanduser()
    if not p.exists():
        hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
        hint = (
            f" ('{path}' looks like a Hugging Face hub id: hybridflow loads local files, so download it "
            f"first, e.g. `huggingface-cli download {path} --local-dir DIR`, and give DIR)"
            if hub_id
            else ""
        )
        raise UserError(f"model path not found: {path}{hint}")
    return p


def load_model(model, path: str | None = None, *, impl: str = "hf"):
    """The one way a run loads a model: `path` (default: model.path; a reference's or a checkpoint's
    path) with every model.* field that bears on loading: dtype, cache_dir, trust_remote_code.
    `model` is the config's ModelConfig. -> (model, tokenizer), as load_causal_lm."""
    return load_causal_lm(
        path or model.path, impl=impl, dtype=model.dtype, cache_dir=model.cache_dir,
        trust_remote_code=model.trust_remote_code,
    )  # fmt: skip


def load_model_tokenizer(model, path: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `load_model(model, path)` alone."""
    return load_tokenizer(
        path or model.path, cache_dir=model.cache_dir, trust_remote_code=model.trust_remote_code
    )


def load_model_config(model, path: str | Path | None = None):
    """The transformers config of `load_model(model, path)`: its config file alone, no weights."""
    from transformers import AutoConfig

    p = _model_path(str(path or model.path), model.cache_dir)
    if p.is_file():  # a .gguf file
        return AutoConfig.from_pretrained(p.parent, gguf_file=p.name)
    return AutoConfig.from_pretrained(p, trust_remote_code=model.trust_remote_code)


def resolve_model_path(path: str, cache_dir: str | None = None) -> Path:
    """'default' as the embedded model's cached HF directory; any other path checked to exist."""
    return _model_path(path, cache_dir)


def _load_hf_dir(p: Path, dtype: torch.dtype, trust_remote_code: bool):
    if not (p / "config.json").is_file():
        raise UserError(f"model directory {p} has no config.json")
    if not any(any(p.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise UserError(f"model directory {p} has no weights (expected *.safetensors or pytorch_model*.bin)")
    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise UserError(
                f"model directory {p} holds its own Python code (config.json auto_map); transformers runs it "
                "only with model.trust_remote_code=true: set it if you trust that code"
            ) from e
        raise
    tokenizer = AutoTokenizer.from_pretrained(p, trust_remote_code=trust_remote_code)
    return model, tokenizer


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        field = GGUFReader(path).fields["general.architecture"]
    except Exception as e:
        raise UserError(f"cannot read GGUF file {path}: {e}") from e
    return bytes(field.parts[field.data[0]]).decode()


def load_gguf(path: Path, dtype: torch.dtype = torch.float32):
    """Dequantise a GGUF checkpoint through transformers (needs the `gguf` package)."""
    arch = gguf_architecture(path)
    supported = gguf_supported_architectures()
    if supported is not None and arch not in supported:
        raise UserError(f"GGUF file {path} has architecture {arch!r}, which transformers cannot load")
    log.info("dequantising GGUF %s (%s)", path, arch)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The weights are dequantised already, but transformers still marks the model as GGUF-quantised,
    # which blocks save_pretrained. Rebuild a plain model from the config and copy the weights in.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return filled_hf_model(AutoModelForCausalLM, config, loaded.state_dict()), tokenizer


def _ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    # Batched generation needs a pad token; the EOS token is the usual stand-in.
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
