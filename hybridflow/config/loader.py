"""Load a Config from a YAML recipe plus `a.b=c` overrides, with verl aliases and clear errors."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from hybridflow.config import aliases
from hybridflow.config.schema import Config
from hybridflow.errors import UserError, closest

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. 'actor.optim.lr'."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys += valid_keys(hint, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def mapping_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Dotted keys of fields that hold a free-form mapping (their contents are not schema keys)."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys |= mapping_keys(hint, f"{prefix}{f.name}.")
        elif typing.get_origin(hint) is dict:
            keys.add(f"{prefix}{f.name}")
    return keys


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
    return _flatten(tree)


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


def _translate(items: list[tuple[str, Any]], known: set[str]) -> tuple[list, dict[str, Any]]:
    """Map alias keys to ours and check every key; returns (our items, deferred aliases)."""
    out, deferred = [], {}
    for key, value in items:
        if key in aliases.EXPANSIONS:
            out += list(aliases.EXPANSIONS[key](value).items())
        elif key in aliases.RENAMES:
            out.append((aliases.RENAMES[key], value))
        elif key in aliases.DEFERRED:
            deferred[key] = value
        elif key in known:
            out.append((key, value))
        else:
            hint = closest(key, [*known, *aliases.all_alias_keys()])
            raise UserError(f"unknown config key '{key}'{hint}")
    return out, deferred


def load_config(
    recipe: str | None = None, overrides: list[str] | tuple[str, ...] = (), *, settings: dict | None = None
) -> Config:
    """Defaults <- recipe YAML <- `settings` (a nested mapping like the YAML's, e.g. {"actor":
    {"optim": {"lr": 1e-6}}}) <- overrides (later wins). Raises UserError naming the bad key/value."""
    known = set(valid_keys())
    items = _read_recipe(recipe) if recipe else []
    items += _flatten(settings) if settings else []
    for item in overrides:
        items += _parse_override(item)
    ours, deferred = _translate(items, known)

    base = OmegaConf.structured(Config)
    try:
        merged = OmegaConf.merge(base, _unflatten(ours)) if ours else base
        resolved = OmegaConf.to_container(merged, resolve=True)
        for verl_key, value in deferred.items():
            our_key, convert = aliases.DEFERRED[verl_key]
            section, name = our_key.split(".")
            merged[section][name] = convert(value, resolved)
        config = OmegaConf.to_object(merged)
    except ValidationError as e:
        raise UserError(f"config {e.full_key}: {str(e.msg).splitlines()[0]}") from e
    except OmegaConfBaseException as e:
        raise UserError(f"config error at {getattr(e, 'full_key', '?')}: {str(e).splitlines()[0]}") from e
    assert isinstance(config, Config)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)
