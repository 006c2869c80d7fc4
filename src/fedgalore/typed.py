"""Typed dataclasses from plain data (YAML / JSON mappings) and back, with one-line errors.

The one parser behind the run configuration (:mod:`fedgalore.job.config`) and the methods'
option dataclasses (:mod:`fedgalore.methods.base`): library code takes the dataclasses, and only
this module turns plain values into them (docs/design.md §2, "Library functions take typed
objects"). Each value is checked against its field's type — ``bool``, ``int`` (an integral
float is accepted), ``float`` (a numeric string such as YAML 1.1's ``5e-5`` too), ``str``,
``Literal[...]`` (one of the listed values), ``X | Y`` (the first that fits), ``tuple``,
``dict``, nested dataclasses and ``Any`` — and a bad one raises :class:`ConfigError` with one line
naming the key and what it must be.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

_UNIONS = (Union, types.UnionType)  # Optional[X] / Union[X, Y] and X | Y

__all__ = ["ConfigError", "to_plain", "from_plain", "coerce", "describe_type"]


class ConfigError(ValueError):
    """An invalid configuration value; the message is one line with the fix."""


def to_plain(obj: Any) -> Any:
    """Dataclasses, tuples and mappings as plain dicts and lists (YAML/JSON-able)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


def from_plain(cls: type, data: Any, path: str = "") -> Any:
    """An instance of dataclass ``cls`` from a mapping; unknown keys and values of the wrong type
    are :class:`ConfigError`, and so is a ``ValueError`` / ``TypeError`` of the dataclass's own
    validation (``__post_init__``). ``path`` names the mapping in messages (``"federation"``)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        removed = getattr(cls, "_removed_keys", {})  # a key of an earlier version: say what replaced it
        for key in unknown:
            if key in removed:
                raise ConfigError(f"{where}{key} {removed[key]}")
        raise ConfigError(f"unknown config key {where}{unknown[0]}; valid keys here: {', '.join(sorted(names))}")
    kwargs = {name: coerce(hints[name], value, f"{path}.{name}" if path else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # a dataclass's own validation (e.g. PartitionConfig)
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def coerce(tp: Any, value: Any, path: str) -> Any:
    """``value`` as type ``tp`` (module doc); ``path`` names the value in the error."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_plain(tp, value, path)
    if origin is None and tp is Any:
        return value
    args = get_args(tp)
    if origin is Literal:
        if value in args and not (isinstance(value, bool) and not any(isinstance(a, bool) for a in args)):
            return value
        raise ConfigError(f"{path}={value!r} must be one of {', '.join(repr(a) for a in args)}")
    if origin in _UNIONS:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:
            try:
                return coerce(a, value, path)
            except ConfigError:
                continue
        if len(inner) == 1:
            return coerce(inner[0], value, path)  # its own message
        raise ConfigError(f"{path} must be {describe_type(tp)}, got {value!r}")
    if origin is dict:
        if value is None:  # `method.options=null` clears the mapping
            return {}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return dict(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            raise ConfigError(f"{path} must be a list of {len(args)} values, got {value!r}")
        return tuple(coerce(a, v, path) for a, v in zip(args, value)) if args[-1] is not Ellipsis else tuple(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, bool):  # true is not 1.0: a number key given a switch is a mistake
            raise ConfigError(f"{path} must be a number, got {value!r}")
        if not isinstance(value, (int, float)):
            try:
                return float(value)  # "5e-5" from a YAML 1.1 string
            except (TypeError, ValueError):
                raise ConfigError(f"{path} must be a number, got {value!r}") from None
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    return value


def describe_type(tp: Any) -> str:
    """A type in words, as the messages and ``fedgalore methods`` say it (``"an integer or 'auto'"``)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in _UNIONS:
        return " or ".join(describe_type(a) for a in args)
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null"}.get(
        tp, getattr(tp, "__name__", str(tp)))
