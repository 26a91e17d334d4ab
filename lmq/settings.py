"""Settings dataclasses → argparse flags that also read environment variables.

A field `kv_memory` becomes the flag `--kv-memory` and reads `LMQ_KV_MEMORY`; a field whose
metadata names an "env" (REDIS_URL, PORT) reads that variable instead. Flags win over the
environment, the environment over the dataclass default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, TypeVar

T = TypeVar("T")

_PARSERS = {"int": int, "float": float, "str": str}


def env_name(field: dataclasses.Field) -> str:
    return field.metadata.get("env", f"LMQ_{field.name.upper()}")


def flag_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _parser_for(field: dataclasses.Field):
    return _parse_bool if field.type == "bool" else _PARSERS[str(field.type)]


def add_flags(parser: argparse.ArgumentParser, settings_class: type, skip: set[str] = frozenset()) -> None:
    """Add one flag per field of `settings_class`; defaults stay unset so we know what was given."""
    group = parser.add_argument_group(settings_class.__name__)
    existing = {action.dest for action in parser._actions}
    for field in dataclasses.fields(settings_class):
        if field.name in skip or field.name in existing:
            continue
        help_text = f"{field.metadata.get('help', '')} [env {env_name(field)}]"
        group.add_argument(flag_name(field), dest=field.name, type=_parser_for(field), default=None, help=help_text)


def _from_environment(field: dataclasses.Field, text: str) -> Any:
    try:
        return _parser_for(field)(text)
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(f"{env_name(field)}={text!r} is not a valid {field.type}") from None


def build(settings_class: type[T], args: argparse.Namespace, environ: dict[str, str] | None = None) -> T:
    """Instantiate `settings_class` from flags, then environment, then defaults."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field in dataclasses.fields(settings_class):
        given = getattr(args, field.name, None)
        if given is not None:
            values[field.name] = given
        elif env_name(field) in environ:
            values[field.name] = _from_environment(field, environ[env_name(field)])
    return settings_class(**values)


def setting_name(settings_class: type, name: str) -> str:
    """How an operator sets a field, for messages: `LMQ_KV_MEMORY (--kv-memory)`."""
    field = next(f for f in dataclasses.fields(settings_class) if f.name == name)
    return f"{env_name(field)} ({flag_name(field)})"


def at_least(config: object, name: str, low: float, high: float | None = None) -> None:
    """Refuse a number below `low` (or above `high`), naming the setting."""
    value = getattr(config, name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise ValueError(f"{setting_name(type(config), name)} must be {bounds}, not {value!r}")
