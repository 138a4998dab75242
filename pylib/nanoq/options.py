"""The training options' schema, as the core defines it (once, in
``cuda_core/include/nanoq/options.h``): names, choices, limits and the rules
between options, each with its error message.

``nanoq.TrainOptions``, ``nanoq.lora.LoraConfig``, the TOML settings of
``nanoq.training`` and the CLI's help take their choice lists and limits from
here, and refuse bad options with ``check`` (the core's own validation)
before anything reaches a Trainer. Python adds only its user-facing forms:
"auto" for the backend and dtype, comma-separated strings, LoRA target
aliases.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

from nanoq import _core

_SCHEMA = _core.option_schema()
_OPTIONS = {spec["name"]: spec for spec in _SCHEMA["options"]}
_RULES = {rule["name"]: rule for rule in _SCHEMA["rules"]}


def names() -> Tuple[str, ...]:
    """The options of the schema, in its order (TrainOptions' core fields)."""
    return tuple(_OPTIONS)


def option(name: str) -> dict:
    """The schema entry of option ``name``: dict(name, kind ("choice", "set",
    "integer", "number", "flag"), help, choices, minimum, maximum)."""
    if name not in _OPTIONS:
        raise ValueError(f"no training option {name!r}; the options are {', '.join(_OPTIONS)}")
    return _OPTIONS[name]


def choices(name: str) -> Tuple[str, ...]:
    """The names option ``name`` may take (or, for a set option, combine), in
    the core's order."""
    return tuple(choice["name"] for choice in option(name)["choices"])


def implied(name: str) -> dict:
    """{choice: the choices it directly turns on too} of set option ``name``
    (e.g. recompute "ffn" -> ("swiglu",)); choices that imply nothing are left out."""
    return {choice["name"]: tuple(choice["implies"]) for choice in option(name)["choices"] if choice["implies"]}


def limits(name: str) -> Tuple[Optional[dict], Optional[dict]]:
    """(minimum, maximum) of a numeric option: each None or dict(value, inclusive)."""
    spec = option(name)
    return spec["minimum"], spec["maximum"]


def rules() -> Tuple[dict, ...]:
    """The cross-option rules: dicts of name, options (those it relates) and
    message (the ValueError raised when it is broken)."""
    return tuple(_SCHEMA["rules"])


def rule_message(name: str) -> str:
    """The error message of rule ``name``."""
    return _RULES[name]["message"]


def check(options: dict, undecided: Iterable[str] = ()) -> None:
    """Applies the core's limits and rules to ``options`` (a dict of
    TrainOptions' fields as the core takes them: dtypes and backend resolved,
    set options as tuples, "lora" a dict of LoraConfig's fields or None).
    Absent keys and the options in ``undecided`` are not checked, nor the
    rules involving them. Raises ValueError with the core's message."""
    undecided = set(undecided)
    _core.check_options({key: value for key, value in options.items() if key not in undecided})


def canonical_names(name: str, value: Iterable[str]) -> Tuple[str, ...]:
    """The choices of set option ``name`` in ``value`` (an iterable of names),
    in the core's order without duplicates; ValueError for an unknown name."""
    return _core.set_option_names(name, list(value))


def split_names(name: str, value) -> list:
    """The stripped, non-empty names of ``value``: a comma-separated string or
    an iterable of strings (a TypeError names option ``name`` otherwise)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{name} must be names (strings), got {item!r}")
    return [item.strip() for item in items if item.strip()]


def describe_limits(name: str) -> str:
    """The limits of a numeric option as text: "[0, 1)", ">= 1", "> 0"."""
    low, high = limits(name)
    if low and high:
        return (f"{'[' if low['inclusive'] else '('}{_number(low['value'])}, {_number(high['value'])}"
                f"{']' if high['inclusive'] else ')'}")
    if low:
        return f"{'>=' if low['inclusive'] else '>'} {_number(low['value'])}"
    if high:
        return f"{'<=' if high['inclusive'] else '<'} {_number(high['value'])}"
    return "any"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def rules_markdown() -> str:
    """The rules between options as a Markdown table (the README's is this)."""
    rows = ["| options | rule (the error when broken) |", "|---|---|"]
    for rule in rules():
        related = ", ".join(f"`{name}`" for name in rule["options"])
        rows.append(f"| {related} | {rule['message'].replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
