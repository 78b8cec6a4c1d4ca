"""`hybridflow export CHECKPOINT --out DIR`: a checkpoint's trained policy as a transformers
directory (config, safetensors, tokenizer with its chat template, generation config). The weights
come from the sharded actor state, whatever number of ranks wrote it; success is reported only
after transformers has loaded the written directory and its logits equal the checkpoint's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.checkpoint import latest_checkpoint
from hybridflow.devices import DTYPES
from hybridflow.errors import UserError
from hybridflow.models.export import save_hf
from hybridflow.models.loading import load_causal_lm
from hybridflow.parallel.checkpoint import load_model_weights

PROBE = [{"role": "user", "content": "What is 17 + 25? Answer with a number."}]


@dataclass
class ExportReport:
    checkpoint: Path
    out: Path
    parameters: int
    max_logit_diff: float
    probe_tokens: int

    def __str__(self) -> str:
        return (
            f"exported {self.checkpoint} -> {self.out} ({self.parameters / 1e6:.1f}M parameters); "
            f"transformers reloads it with the same logits (max |diff| {self.max_logit_diff:.1e} over "
            f"{self.probe_tokens} tokens)"
        )


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (global_step_N), or a run directory (its latest complete checkpoint)."""
    p = Path(path).expanduser()
    if (p / "trainer_state.json").is_file():
        return p
    if p.is_dir() and (latest := latest_checkpoint(p)) is not None:
        return latest
    raise UserError(
        f"{p} is neither a checkpoint (global_step_N with trainer_state.json) nor a run directory holding one"
    )


def load_trained_policy(checkpoint: Path):
    """(transformers model, tokenizer): the structure and tokenizer of the checkpoint's policy
    export, the weights read from its sharded actor state."""
    policy, state_dir = checkpoint / "policy", checkpoint / "actor_state"
    if not (policy / "config.json").is_file() or not (state_dir / ".metadata").is_file():
        raise UserError(
            f"checkpoint {checkpoint} lacks policy/config.json or actor_state/: not written by hybridflow?"
        )
    model, tokenizer = load_causal_lm(str(policy), dtype=_saved_dtype(policy))
    own = model.state_dict()
    weights = load_model_weights(state_dir, own)
    missing = [n for n in own if n not in weights and not _tied(model, n)]
    if missing:
        raise UserError(f"checkpoint {checkpoint}: actor_state has no weights for {', '.join(missing[:3])}")
    model.load_state_dict(weights, strict=False)  # a tied head is the embedding's tensor
    return model.eval(), tokenizer


def _saved_dtype(policy: Path) -> str:
    """The dtype the policy export was written in (its config's), so the weights load unconverted."""
    config = json.loads((policy / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPES else "float32"


def _tied(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> ExportReport:
    from transformers import AutoModelForCausalLM

    source = resolve_checkpoint(checkpoint)
    model, tokenizer = load_trained_policy(source)
    out = save_hf(model, tokenizer, out, overwrite=overwrite)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=next(model.parameters()).dtype).eval()
    ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, return_dict=False) if tokenizer.chat_template else tokenizer("17 + 25 =")["input_ids"]  # fmt: skip
    probe = torch.tensor([list(ids)])  # [1, T]
    with torch.no_grad():
        diff = (reloaded(probe).logits - model(probe).logits).abs().max().item()
    if diff > 1e-5:
        raise UserError(f"export check failed: {out} reloads with logits {diff:.2e} away from {source}'s")
    return ExportReport(source, Path(out), sum(p.numel() for p in model.parameters()), diff, probe.shape[1])
