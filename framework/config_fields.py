"""Config dataclass helpers: documented fields, range checks with clear messages, string parsing.

Every strategy owns a frozen dataclass of hyper-parameters. Fields are declared with
`param` (a default plus a one-line help that the CLI and the docs render); ``__post_init__``
validates: `check_types` first (every field against its annotation: booleans, ``Literal``
choices, strings), then `check_range` / `check_choice` for what a type does not say; each raises
`ConfigError` naming the field, the value received and what is allowed. `build_config` turns
CLI/YAML strings into a config and prefixes the field with the flag (``--selector.skip_ratio``)
in error messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

C = TypeVar("C")


class ConfigError(ValueError):
    """A config value is out of range or of the wrong type.

    Attributes:
        field: the config field (or CLI flag) at fault.
        value: the value received.
        allowed: a description of the allowed values.
    """

    def __init__(self, field: str, value: Any, allowed: str, hint: str = "") -> None:
        self.field, self.value, self.allowed, self.hint = field, value, allowed, hint
        super().__init__(f"{field} must be {allowed}, got {value!r}" + (f"; {hint}" if hint else ""))

    def with_flag(self, flag: str) -> ConfigError:
        return ConfigError(flag, self.value, self.allowed, self.hint)


def param(
    default: Any = dataclasses.MISSING,
    help: str = "",  # noqa: A002
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    repeat: bool = False,
    **kwargs: Any,
) -> Any:
    """A dataclass field with a help string (shown by ``--list``, ``--help`` and the docs).

    The keyword-only arguments are command-line metadata, read by the flag generator
    (``framework.session.flags``) where it cannot infer them from the field: ``flag`` the flag's
    name (default ``--<field-with-dashes>``), ``aliases`` further names of the same flag, ``metavar``
    its value's placeholder, ``repeat`` a tuple field whose flag is repeated once per item
    (``--stop A --stop B``) instead of taking a comma-separated list.
    """
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple or default_factory for mutable defaults")
    meta: dict[str, Any] = {"help": help}
    cli = {"flag": flag, "aliases": tuple(aliases), "metavar": metavar, "repeat": repeat}
    meta.update({k: v for k, v in cli.items() if v})
    return dataclasses.field(default=default, metadata=meta, **kwargs)


def check_range(
    field: str,
    value: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    integer: bool = False,
) -> None:
    """Raise `ConfigError` unless ``lo (<|<=) value (<|<=) hi`` (and an ``int`` when ``integer``)."""
    bad = isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value != value
    if not bad and lo is not None:
        bad = value <= lo if lo_open else value < lo
    if not bad and hi is not None:
        bad = value >= hi if hi_open else value > hi
    if bad:
        if lo is not None and hi is not None:
            allowed = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            allowed = f"{'>' if lo_open else '>='} {lo:g}"
        elif hi is not None:
            allowed = f"{'<' if hi_open else '<='} {hi:g}"
        else:
            allowed = "a number"
        if integer:
            allowed = "an integer " + (allowed if allowed != "a number" else "")
        raise ConfigError(field, value, allowed.strip())


def check_choice(field: str, value: Any, choices: typing.Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(field, value, "one of " + ", ".join(repr(c) for c in choices))


def field_help(cfg_cls: type) -> dict[str, str]:
    """``{field name: help}`` of a config dataclass."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cfg_cls)}


def field_defaults(cfg_cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cfg_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


#: Other spellings of a choice, taken where the choice is one of a field's values (``--dtype
#: bf16`` is ``--dtype bfloat16``, as torch and transformers users write it).
LITERAL_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def literal_alias(value: Any, choices: tuple[Any, ...]) -> Any:
    """``value``, or the choice it is another spelling of (`LITERAL_ALIASES`)."""
    if isinstance(value, str) and value not in choices and LITERAL_ALIASES.get(value) in choices:
        return LITERAL_ALIASES[value]
    return value


def parse_value(text: str, tp: Any, flag: str) -> Any:
    """Convert a CLI/YAML string to the annotated type ``tp`` (``Optional``, ``Literal``, tuples,
    bool, int, float, str); errors name ``flag``. A ``Literal``'s choice is returned as that
    choice (``--dtype bf16``: ``bfloat16``); whether the value is allowed is the config's to judge
    (`check_types`), not the parser's.

    Raises:
        ConfigError: the text does not parse as ``tp`` (a boolean or a number).
    """
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if text.strip().lower() in ("none", "null", "") or (
            args == [bool] and text.strip().lower() == "auto"
        ):
            return None  # an optional boolean's None is its automatic choice (``--exact``)
        return parse_value(text, args[0], flag)
    if origin is Literal:
        text = literal_alias(text, get_args(tp))
        return next((c for c in get_args(tp) if str(c) == text), text)
    if origin is tuple:
        inner = get_args(tp)[0] if get_args(tp) else str
        parts = [p for p in text.replace(" ", "").split(",") if p]
        return tuple(parse_value(p, inner, flag) for p in parts)
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(flag, text, "a boolean (true/false)")
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            raise ConfigError(flag, text, f"a number ({tp.__name__})") from None
    return text


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_error(tp: Any, value: Any) -> str | None:
    """What ``value`` should be for a field annotated ``tp``, or ``None`` when it is that (or the
    annotation is one this check leaves to the config: numbers have their ranges, `check_range`)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return _type_error(rest[0], value) if len(rest) == 1 else None
    if origin is Literal:
        ok = any(value == c and type(value) is type(c) for c in args)
        return None if ok else "one of " + ", ".join(str(c) for c in args)
    if tp is bool:
        return None if isinstance(value, bool) else "a boolean (true/false)"
    if tp is str:
        return None if isinstance(value, str) else "a string"
    if origin is tuple and args == (str, ...):
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        return None if ok else "a tuple of strings"
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return None if isinstance(value, tp) else f"a {tp.__name__}"
    return None


def check_types(cfg: Any, *, flags: bool = False) -> None:
    """Check every field of the config dataclass ``cfg`` against its annotation, once, wherever the
    config came from (the command line, YAML, a sweep or Python): booleans, ``Literal`` choices,
    strings, tuples of strings and nested configs (``Optional`` of each). Call it first in
    ``__post_init__``; the range checks (`check_range`) follow. ``flags``: name a field by its
    command-line flag (``--cuda-graphs``) instead of its name.

    Raises:
        ConfigError: the first field whose value is not of its type, naming what is allowed.
    """
    hints = _hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = _type_error(hints[f.name], value)
        if allowed is not None:
            name = (f.metadata.get("flag") or "--" + f.name.replace("_", "-")) if flags else f.name
            raise ConfigError(name, value, allowed)


def coerce_value(value: Any, tp: Any, flag: str) -> Any:
    """``value`` for a field annotated ``tp``: a string is parsed (`parse_value`, as on the command
    line); a typed value is taken as it is, except that a list becomes a tuple (its items coerced)
    and an integral float for an ``int`` field an int (YAML's ``8.0``). The config's own validation
    judges the result.

    Raises:
        ConfigError: a string that does not parse as ``tp``.
    """
    if isinstance(value, str):
        return parse_value(value, tp, flag)
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return value if value is None or len(args) != 1 else coerce_value(value, args[0], flag)
    if isinstance(value, (list, tuple)) and (origin is tuple or isinstance(value, list)):
        inner = get_args(tp)[0] if origin is tuple and get_args(tp) else None
        return tuple(v if inner is None else coerce_value(v, inner, flag) for v in value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def build_config(cfg_cls: type[C], values: dict[str, Any], flag_prefix: str = "") -> C:
    """Build ``cfg_cls`` from a dict of field values (strings are parsed with the field's type).

    Args:
        cfg_cls: a config dataclass.
        values: ``{field: value}``; string values are converted using the field annotations.
        flag_prefix: prepended to field names in error messages (``"--selector."``).

    Raises:
        ConfigError: unknown field, unparsable value, or a value rejected by the config's own
            validation; the message names the flag.
    """
    hints = typing.get_type_hints(cfg_cls)
    names = [f.name for f in dataclasses.fields(cfg_cls)]
    kwargs = {}
    for key, raw in values.items():
        flag = f"{flag_prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}?" if close else ""
            # the name is what is wrong, so the message quotes it (not the value it was given)
            raise ConfigError(
                flag, key, f"a field of {cfg_cls.__name__} ({', '.join(names) or 'none'})", hint
            )
        kwargs[key] = coerce_value(raw, hints[key], flag)
    try:
        return cfg_cls(**kwargs)
    except ConfigError as err:
        raise err.with_flag(f"{flag_prefix}{err.field}") from None
