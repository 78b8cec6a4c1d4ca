"""`hybridflow config show --explain [KEY]`: every config field with its value, default and the
docstring written under it in the section's dataclass (read from the source: the one place it lives)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.errors import UserError


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the string literal under its annotation} of a dataclass."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    docs, body = {}, node.body
    for i, statement in enumerate(body[:-1]):
        after = body[i + 1]
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def leaves(obj: Any, prefix: str = "") -> list[tuple[str, type, dataclasses.Field, Any]]:
    """(dotted key, owning dataclass, field, value) for every non-section field under `obj`."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out += leaves(value, key + ".")
        else:
            out.append((key, type(obj), f, value))
    return out


def _entry(key: str, owner: type, f: dataclasses.Field, value: Any) -> str:
    default = _default(f)
    shown = f"{key} = {value!r}" + ("" if value == default else f"   (default {default!r})")
    doc = field_docs(owner).get(f.name, "(no description)")
    return shown + "\n" + textwrap.indent(textwrap.fill(" ".join(doc.split()), 96), "    ")


def explain(config: Config, key: str | None = None) -> str:
    """One field, a section (its description, then its fields) or, with no key, everything."""
    entries = leaves(config)
    if not key:
        return "\n".join(_entry(*e) for e in entries)
    chosen = [e for e in entries if e[0] == key or e[0].startswith(key + ".")]
    if not chosen:
        from hybridflow.config.aliases import VERL
        from hybridflow.errors import closest

        if key in VERL:  # verl's name for something: what it becomes here
            entry = VERL[key]
            return f"{key} (verl's key) -> {entry.ours}" + (f"\n    {entry.doc}" if entry.doc else "")
        raise UserError(f"'{key}' is not a config key or section{closest(key, [e[0] for e in entries])}")
    text = [_entry(*e) for e in chosen]
    section = _section(config, key)
    if (
        section is not None
        and type(section).__doc__
        and not type(section).__doc__.startswith(type(section).__name__ + "(")
    ):
        text.insert(0, f"{key}: " + " ".join(inspect.cleandoc(type(section).__doc__).split()))
    return "\n".join(text)


def _section(config: Config, key: str) -> Any:
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part, None)
    return obj if dataclasses.is_dataclass(obj) else None
