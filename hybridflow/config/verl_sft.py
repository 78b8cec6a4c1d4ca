"""verl's SFT keys (`verl.trainer.fsdp_sft_trainer`, its sft_trainer.yaml) for `hybridflow sft`, and
the same data keys for `hybridflow dpo` / `kto`.

The offline trainers read these keys before verl's RL table (config/aliases.py), because a few of
them mean something else there: in SFT `data.train_batch_size` counts examples per optimizer step,
not prompts; `data.prompt_key` is a column of the SFT file. `prompt_dict_keys` / `response_dict_keys`
and `multiturn.*` are read together (`offline_settings`).
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import verl_rules as r
from hybridflow.config.verl_rules import Entry, Translation, by_value, no_effect, rename

OFFLINE_COMMANDS = ("sft", "dpo", "kto")

# keys read together with others (offline_settings), listed so the table accepts them
_READ_TOGETHER = "read with data.prompt_key / data.response_key / data.multiturn.enable"


def _together(doc: str) -> Entry:
    return by_value(lambda v: Translation(), "(see note)", doc)


def _truncation(value: Any) -> Translation:
    if value in ("error", None):
        return Translation(note="examples longer than the limit are dropped and counted, not an error")
    return Translation(
        refusal=f"data.truncation={value!r}: hybridflow drops examples longer than the limit (and counts them) "
        "instead of cutting them; raise data.max_length, or use data.truncation=error"
    )


def _null_or(refusal: str):
    return lambda v: Translation() if v in (None, "null", "None") else Translation(refusal=refusal)


_NO_OFFLOAD = by_value(
    lambda v: (
        Translation(refusal="the offline trainers do not offload; set it false")
        if r.truthy(v)
        else Translation()
    ),
    "(false only)",
    "offload is refused in the offline trainers",
)


def _sequence_parallel(value: Any) -> Translation:
    return Translation(
        note="the offline trainers run on one worker: no sequence parallelism (it changes memory, not results)"
    )


def _shared(batch_key: str, prefix: str) -> dict[str, Entry]:
    """The keys every offline command reads: data, model, optimizer, run."""
    return {
        "data.train_batch_size": rename(
            batch_key, "examples (DPO: pairs) per optimizer step, as in verl's SFT"
        ),
        "data.micro_batch_size_per_gpu": no_effect(r.MICRO),
        "data.micro_batch_size": no_effect(r.MICRO),
        "data.prompt_key": _together(f"`{prefix}.prompt_key` (with `data.prompt_dict_keys`: a dotted key)"),
        "data.prompt_dict_keys": _together(_READ_TOGETHER),
        "data.max_length": rename(f"{prefix}.max_tokens", "longer examples are dropped and counted"),
        "data.truncation": by_value(
            _truncation, "(see note)", "error: dropped and counted; left/right refused"
        ),
        "data.balance_dp_token": no_effect("one worker: nothing to balance"),
        "data.use_shm": no_effect("data loads from local files"),
        "data.chat_template": by_value(
            _null_or(
                "data.chat_template: the tokenizer's own chat template is used; give a model whose "
                "tokenizer_config.json holds the template you want"
            ),  # fmt: skip
            "(null only)",
            "the tokenizer's own template",
        ),
        "model.partial_pretrain": rename("model.path"),
        "model.trust_remote_code": rename("model.trust_remote_code"),
        "model.enable_gradient_checkpointing": rename("model.enable_gradient_checkpointing"),
        "model.lora_rank": rename("model.lora_rank"),
        "model.lora_alpha": rename("model.lora_alpha"),
        "model.target_modules": by_value(
            lambda v: Translation({} if v == "all-linear" else {"model.lora_target_modules": v}),
            "`model.lora_target_modules`",
            "all-linear: our default list",
        ),
        "model.use_shm": no_effect("models load from local files"),
        "model.use_liger": no_effect("the native model's LM head already computes log-probs in fused chunks"),
        "model.strategy": by_value(r.strategy("model"), "(no effect)", "fsdp / fsdp2 accepted; one worker"),
        "model.external_lib": by_value(
            _null_or(
                "model.external_lib: hybridflow imports no library to register a model; give an HF "
                "directory transformers loads (model.trust_remote_code=true for custom code)"
            ),  # fmt: skip
            "(null only)",
            "no external model library",
        ),
        "model.fsdp_config.model_dtype": rename("model.dtype", convert=r.dtype),
        "model.fsdp_config.wrap_policy.min_num_params": no_effect("FSDP2 wraps each decoder layer"),
        "model.fsdp_config.cpu_offload": _NO_OFFLOAD,
        "model.fsdp_config.offload_params": _NO_OFFLOAD,
        "optim.lr": rename("actor.optim.lr"),
        "optim.betas": rename("actor.optim.betas"),
        "optim.weight_decay": rename("actor.optim.weight_decay"),
        "optim.warmup_steps_ratio": rename("actor.optim.warmup_ratio"),
        "optim.clip_grad": rename("actor.optim.grad_clip"),
        "optim.lr_scheduler": rename("actor.optim.lr_scheduler"),
        "ulysses_sequence_parallel_size": by_value(_sequence_parallel, "(no effect)", "one worker"),
        "use_remove_padding": no_effect("the native model is always padding-free"),
        "trainer.default_hdfs_dir": no_effect("checkpoints are written under trainer.run_dir only"),
        "trainer.checkpoint.save_contents": no_effect("a checkpoint holds the model, optimizer and order"),
    }


def table(command: str) -> dict[str, Entry]:
    """verl's keys as `hybridflow COMMAND` reads them (before verl's RL table)."""
    if command == "sft":
        return {
            **_shared("sft.batch_size", "sft"),
            "data.response_key": _together(
                "`sft.response_key` (with `data.response_dict_keys`: a dotted key)"
            ),
            "data.response_dict_keys": _together(_READ_TOGETHER),
            "data.multiturn.enable": _together("true: rows of chat messages (`sft.messages_key`)"),
            "data.multiturn.messages_key": _together("`sft.messages_key` when data.multiturn.enable is true"),
            "data.multiturn.tools_key": by_value(
                _null_or(
                    "data.multiturn.tools_key: tools in SFT rows are not rendered; drop the column or the key"
                ),
                "(null only)",
                "tools in SFT rows are not rendered",
            ),
            "data.multiturn.enable_thinking_key": by_value(
                _null_or(
                    "data.multiturn.enable_thinking_key: give data.chat_template_kwargs.enable_thinking for all rows"
                ),
                "(null only)",
                "one setting for all rows: data.chat_template_kwargs",
            ),
        }
    return _shared("preference.batch_size", "preference")


def _dotted(key: Any, dict_keys: Any) -> Any:
    """verl's `prompt_key` + `prompt_dict_keys` (fields inside the column, in order) as one dotted key."""
    if dict_keys in (None, "null") or key is None:
        return key
    parts = [dict_keys] if isinstance(dict_keys, str) else list(dict_keys)
    return ".".join([str(key), *map(str, parts)])


def offline_settings(command: str, values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Our settings from the verl keys read together (values: every verl key given, by name), and
    the problems with them."""
    prefix = "sft" if command == "sft" else "preference"
    out: dict[str, Any] = {}
    problems: list[str] = []
    for field in ("prompt", "response") if command == "sft" else ("prompt",):
        key, dict_keys = values.get(f"data.{field}_key"), values.get(f"data.{field}_dict_keys")
        if key is None and dict_keys not in (None, "null"):
            problems.append(
                f"data.{field}_dict_keys={dict_keys!r} needs data.{field}_key (the column they are in)"
            )
        elif key is not None:
            out[f"{prefix}.{field}_key"] = _dotted(key, dict_keys)
    if r.truthy(values.get("data.multiturn.enable", False)):
        out["sft.messages_key"] = values.get("data.multiturn.messages_key") or "messages"
    return out, problems
