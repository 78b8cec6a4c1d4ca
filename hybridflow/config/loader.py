"""Load a Config from a YAML recipe plus `a.b=c` overrides, with verl aliases and clear errors."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from hybridflow.config import aliases, verl_async, verl_sft
from hybridflow.config.schema import Config
from hybridflow.config.sections_model_data import DataConfig
from hybridflow.errors import UserError, closest

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@functools.cache
def _leaves(cls: type = Config, prefix: str = "") -> tuple[tuple[str, Any], ...]:
    """(dotted key, type hint) of every leaf field of the schema, e.g. ('actor.optim.lr', float)."""
    leaves = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            leaves += _leaves(hint, f"{prefix}{f.name}.")
        else:
            leaves.append((f"{prefix}{f.name}", hint))
    return tuple(leaves)


def valid_keys() -> list[str]:
    """Every dotted leaf key of the schema, e.g. 'actor.optim.lr'."""
    return [key for key, _ in _leaves()]


def mapping_keys() -> set[str]:
    """Dotted keys of fields that hold a free-form mapping (their contents are not schema keys)."""
    return {key for key, hint in _leaves() if typing.get_origin(hint) is dict}


def list_valued_keys() -> set[str]:
    """Dotted keys of list fields (a string given for one becomes a one-item list)."""
    return {key for key, hint in _leaves() if typing.get_origin(hint) is list}


def _flatten(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    key = prefix.rstrip(".")
    if isinstance(tree, dict) and tree and key not in mapping_keys():
        items = []
        for k, v in tree.items():
            items += _flatten(v, f"{prefix}{k}.")
        return items
    return [(key, tree)]


def _unflatten(items: list[tuple[str, Any]]) -> dict:
    tree: dict = {}
    for key, value in items:
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(node.get(leaf), dict) and isinstance(value, dict):  # entries of one mapping add up
            value = {**node[leaf], **value}
        node[leaf] = value
    return tree


def resolve_recipe(recipe: str) -> Path:
    """A recipe is a YAML path, or the name of a built-in recipe (hybridflow/recipes/NAME.yaml)."""
    path = Path(recipe)
    if path.is_file():
        return path
    builtin = RECIPES_DIR / f"{Path(recipe).stem}.yaml"
    if not path.suffix and builtin.is_file():
        return builtin
    names = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise UserError(f"recipe file not found: {recipe} (built-in recipes: {', '.join(names) or 'none'})")


def _read_recipe(recipe: str) -> list[tuple[str, Any]]:
    path = resolve_recipe(recipe)
    try:
        tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # yaml errors carry multi-line context; keep the first line
        raise UserError(f"cannot parse recipe {path}: {str(e).splitlines()[0]}") from e
    if tree is None:
        return []
    if not isinstance(tree, dict):
        raise UserError(f"recipe {path} must be a mapping of sections, got {type(tree).__name__}")
    if "defaults" not in tree:
        return _flatten(tree)
    return _hydra_defaults(path, tree) + _flatten(
        {k: v for k, v in tree.items() if k not in ("defaults", "hydra")}
    )


def _hydra_defaults(path: Path, tree: dict) -> list[tuple[str, Any]]:
    """A verl config file (`defaults: [ppo_trainer, _self_]`, with `hydra.searchpath` pointing at
    verl's own configs): verl's defaults, then the file. Nothing else of Hydra is read."""
    defaults = tree["defaults"]
    names = defaults if isinstance(defaults, list) else [defaults]
    others = [d for d in names if d not in ("ppo_trainer", "_self_")]
    if others or names[-1:] != ["_self_"] and "_self_" in names:
        raise UserError(
            f"recipe {path}: defaults {names}: only verl's [ppo_trainer, _self_] is read (its keys, then this "
            "file's); put the other files' keys in this one"
        )
    return _read_recipe(VERL_BASE) if "ppo_trainer" in names else []


def _parse_override(item: str) -> list[tuple[str, Any]]:
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key=value (e.g. actor.optim.lr=1e-6)")
    key = item.split("=", 1)[0].strip().lstrip("+")
    value = OmegaConf.to_container(OmegaConf.from_dotlist([item.lstrip("+")]), resolve=False)
    for part in key.split("."):
        value = value[part]
    for mapping in mapping_keys():  # data.task_options.max_digits=3 sets one entry of a mapping
        if key.startswith(mapping + "."):
            return [(mapping, {key[len(mapping) + 1 :]: value})]
    return [(key, value)]


DEMO_RECIPE = "demo_arithmetic_grpo"
VERL_BASE = "verl_ppo_trainer"


@dataclass(frozen=True)
class Resolved:
    """A config and how it came about: the base it started from and the notes on accepted keys that
    have no effect here (both printed at the start of a run and by `config show`)."""

    config: Config
    base: str
    notes: tuple[str, ...] = ()


def _our_keys_only(items: list[tuple[str, Any]], known: set[str]) -> bool:
    return all(key in known for key, _ in items)


def _as_list(key: str, value: Any, list_keys: set[str]) -> Any:
    # verl writes data.train_files=path.parquet: a string where a list is meant
    return [value] if key in list_keys and isinstance(value, str) else value


def _translate(
    items: list[tuple[str, Any]], known: set[str], command: str = "train"
) -> tuple[list, list[str], dict[str, Any]]:
    """Map verl keys to ours and check every key. Every unknown or refused key is reported in one
    error; returns (our items, notes on keys accepted without effect, deferred verl items). The
    offline commands read verl's SFT keys first (config/verl_sft.py)."""
    offline = command in verl_sft.OFFLINE_COMMANDS
    table = {**aliases.VERL, **verl_sft.table(command)} if offline else aliases.VERL
    list_keys = list_valued_keys()
    out, notes, problems = [], [], []
    deferred: dict[str, Any] = {}
    verl_values: dict[str, Any] = {}
    for key, value in items:
        for prefix, ours in aliases.MAPPING_PREFIXES.items():  # verl's free-form mappings
            if key.startswith(prefix + "."):
                key, value = ours, {key[len(prefix) + 1 :]: value}
        if key in aliases.DEFERRED:
            deferred[key] = value
        if key in table:
            verl_values[key] = value
            try:
                t = table[key].rule(value)
            except (TypeError, ValueError) as e:
                problems.append(f"{key}={value!r}: {e}")
                continue
            if t.refusal:
                problems.append(f"{key}: {t.refusal}")
            if t.note:
                notes.append(f"{key} has no effect here: {t.note}")
            out += [(k, _as_list(k, v, list_keys)) for k, v in t.settings.items()]
        elif key in known:
            out.append((key, _as_list(key, value, list_keys)))
        elif key not in aliases.DEFERRED:
            hint = closest(key, [*known, *aliases.all_alias_keys(), *(table if offline else ())])
            problems.append(f"'{key}' is not a config key{hint}")
    if offline:
        settings, offline_problems = verl_sft.offline_settings(command, verl_values)
        out += list(settings.items())
        problems += offline_problems
    elif "data.filter_overlong_prompts" in verl_values or "data.truncation" in verl_values:
        settings, problem = aliases.overlong_setting(
            verl_values.get("data.filter_overlong_prompts", False),
            verl_values.get("data.truncation", "error"),
        )
        out += list(settings.items())
        problems += [problem] if problem else []
    if "reward_model.reward_kwargs.max_resp_len" in verl_values:
        wanted = verl_values["reward_model.reward_kwargs.max_resp_len"]
        length = dict(out).get("data.max_response_tokens", DataConfig().max_response_tokens)
        if str(wanted) != str(length):
            problems.append(
                f"reward_model.reward_kwargs.max_resp_len={wanted}: the overlong penalty is measured "
                f"from data.max_response_length ({length}); make them equal"
            )
    settings, async_notes, async_problems = verl_async.disaggregated(
        {**verl_values, **deferred}, {key for key, _ in items if key in known}
    )
    out += settings
    notes += async_notes
    problems += async_problems
    resolved = dict(out)
    for prefix, what, actor_key, why in (
        ("_sp", "sequence", "actor.sequence_parallel_size", aliases.SAME_SP),
        ("_tp", "tensor", "actor.tensor_parallel_size", aliases.SAME_TP_EP),
        ("_ep", "expert", "actor.expert_parallel_size", aliases.SAME_TP_EP),
    ):
        actor = resolved.get(actor_key, 1)
        for key in (f"{prefix}.ref", f"{prefix}.critic"):
            if key in resolved and resolved[key] != actor:
                problems.append(
                    f"{key[4:]} {what} parallel size {resolved[key]} != the actor's {actor}: {why}"
                )
    out = [(k, v) for k, v in out if not k.startswith(("_sp.", "_tp.", "_ep."))]
    if problems:
        raise UserError(f"{len(problems)} config key(s) cannot be used: " + "; ".join(problems))
    return out, notes, deferred


def resolve_config(
    recipe: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    settings: dict | None = None,
    bare_is_demo: bool = False,
    command: str = "train",
) -> Resolved:
    """Defaults <- the base <- `settings` (a nested mapping like the YAML's, e.g. {"actor": {"optim":
    {"lr": 1e-6}}}) <- overrides (later wins). The base is the recipe when one is given; else, with
    nothing at all and `bare_is_demo`, the demo recipe; else verl's defaults when verl keys are given
    (they mean verl's defaults for everything else; `train` and `plan` only: verl's SFT has its own
    keys, read by `command` sft/dpo/kto), else hybridflow's. Raises UserError naming every bad
    key/value at once."""
    known = set(valid_keys())
    user_items = _flatten(settings) if settings else []
    for item in overrides:
        user_items += _parse_override(item)
    if recipe is not None:
        base = f"recipe {resolve_recipe(recipe)}"
    elif not user_items and bare_is_demo:
        recipe, base = DEMO_RECIPE, f"the demo recipe {DEMO_RECIPE} (no recipe and no overrides given)"
    elif user_items and command not in verl_sft.OFFLINE_COMMANDS and not _our_keys_only(user_items, known):
        recipe, base = (
            VERL_BASE,
            (
                f"verl's defaults (recipe {VERL_BASE}: verl keys were given without a recipe; "
                "pass a recipe to start from another)"
            ),
        )
    else:
        base = "hybridflow's defaults (no recipe given)"
    items = (_read_recipe(recipe) if recipe else []) + user_items
    ours, notes, deferred = _translate(items, known, command)

    base_config = OmegaConf.structured(Config)
    try:
        merged = OmegaConf.merge(base_config, _unflatten(ours)) if ours else base_config
        resolved = OmegaConf.to_container(merged, resolve=True)
        for verl_key, value in deferred.items():
            for key, converted in aliases.DEFERRED[verl_key](value, resolved).items():
                OmegaConf.update(merged, key, converted)
        config = OmegaConf.to_object(merged)
    except ValidationError as e:
        raise UserError(f"config {e.full_key}: {str(e.msg).splitlines()[0]}") from e
    except OmegaConfBaseException as e:
        raise UserError(f"config error at {getattr(e, 'full_key', '?')}: {str(e).splitlines()[0]}") from e
    assert isinstance(config, Config)
    return Resolved(config, base, tuple(dict.fromkeys(notes)))


def load_config(
    recipe: str | None = None, overrides: list[str] | tuple[str, ...] = (), *, settings: dict | None = None
) -> Config:
    """The config of `resolve_config` (no demo for empty input: that is the CLI's choice)."""
    return resolve_config(recipe, overrides, settings=settings).config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
