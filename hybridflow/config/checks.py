"""Value checks the config sections run in __post_init__: each names the field and the value."""

from __future__ import annotations

from hybridflow.errors import UserError


def check_choice(section: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"config {section}.{name}={value!r} is not one of {', '.join(choices)}")


def check_positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"config {section}.{name}={value} must be {bound}")
