"""Command-line flags generated from a config dataclass (the dataclass is the one source of truth).

`add_config_flags` adds one flag per field of a frozen config dataclass (``RunConfig``, a
benchmark's config, ...) to an ``argparse`` parser; `config_overrides_from_args` reads the flags
that were given back as a ``{key: value}`` dict of overrides, the form ``RunConfig.from_preset``
and ``RunConfig.replace`` take. Flags that were not given do not appear in the dict, so the
config's defaults (or a preset's values) stay in force.

How a field becomes flags:

- a plain field ``max_new_tokens`` becomes ``--max-new-tokens VALUE``; the value is kept as the
  string typed and parsed later with the field's type annotation (`framework.config_fields.parse_value`),
  so every error names the flag; ``Literal`` fields list their choices in ``--help``;
- a ``bool`` field ``kernels`` becomes ``--kernels [BOOL]`` / ``--no-kernels`` (``--kernels`` alone
  is true; a value is yes/no, true/false, on/off, 1/0); a ``bool | None`` field (``exact``: unset
  is an automatic choice) the same, and ``--exact auto`` unsets it;
- a tuple field with ``param(..., repeat=True)`` takes one item per flag (``--stop A --stop B``);
  other tuple fields take a comma-separated list (``--categories qa,rag``);
- a strategy field (metadata ``strategy=<kind>``, ``default_name`` and optional
  ``field_aliases``, as ``framework.session.run_config.strategy_field`` writes it) becomes
  ``--<kind> NAME`` plus ``--<kind>.<f> VALUE`` for every field ``f`` of every strategy
  registered for that kind
  (``--import`` modules must be imported first; the built-ins register themselves on the
  registries' first lookup), and the field's ``field_aliases`` (``--skip-set`` for
  ``--selector.skip_set``); the override keys are ``"<kind>"`` and ``"<kind>.<f>"``;
- a field whose type is itself a config dataclass (``gate: GateConfig``) becomes
  ``--<field>.<f> VALUE`` for each of its fields (a bool may omit its value: ``--gate.enabled``);
  the override keys are ``"<field>.<f>"``.

``param`` metadata covers what cannot be inferred: ``flag="--stop"`` (the flag's name),
``aliases=(...)``, ``metavar=...``, ``repeat=True``.

A string flag's metavar is the field's ``param(metavar=...)``, the choices of a ``Literal``, or the
field name in capitals. Fields of a config dataclass of another tool work the same way; a field
the generator should not expose goes in ``exclude``.

Example::

    parser = argparse.ArgumentParser()
    add_config_flags(parser, RunConfig, exclude=("output",))
    args = parser.parse_args(["--max-new-tokens", "64", "--selector.skip_ratio", "0.3"])
    config_overrides_from_args(args)   # {"generation.max_new_tokens": "64", "selector.skip_ratio": "0.3"}
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin

from framework.config_fields import field_defaults, field_help
from framework.interfaces import REGISTRIES

#: Prefix of the ``argparse`` destinations of generated flags (``config:max_new_tokens``), so that
#: `config_overrides_from_args` tells them from a tool's own flags.
DEST_PREFIX = "config:"


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a config field: its ``param(flag=...)``, else ``--<name>`` with
    dashes (``max_new_tokens`` -> ``--max-new-tokens``)."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _choices(tp: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal`` annotation (inside an ``Optional`` too), else ``None``."""
    if get_origin(tp) in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _choices(inner[0]) if len(inner) == 1 else None
    if get_origin(tp) is Literal:
        return get_args(tp)
    return None


def _is_bool(tp: Any) -> bool:
    """``bool``, or ``bool | None`` (unset: an automatic choice, ``--exact``)."""
    if get_origin(tp) in (Union, types.UnionType):
        return sorted(map(str, get_args(tp))) == sorted(map(str, (bool, type(None))))
    return tp is bool


def _nested_config(tp: Any) -> type | None:
    """The config dataclass a field's annotation names (``gate: GateConfig``), else ``None``."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == ():
        return ""
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _help(text: str, default: Any) -> str:
    shown = _default_text(default)
    text = text.replace("%", "%%")
    return f"{text} (default {shown})" if shown and "default" not in text else text


def add_config_flags(
    parser: argparse.ArgumentParser,
    cfg_cls: type,
    *,
    exclude: Iterable[str] = (),
    groups: Mapping[str, str] | None = None,
    _section: str = "",
    _title: str = "",
) -> None:
    """Add a flag for every field of the config dataclass ``cfg_cls`` to ``parser``.

    A field marked as a section (metadata ``section=True``: `RunConfig`'s ``model``, ``method``,
    ...) contributes its own fields' flags, unprefixed (``--max-new-tokens``), under a group named
    after the section; their override keys are dotted, ``"<section>.<field>"``.

    Args:
        parser: the parser to extend.
        cfg_cls: a (frozen) config dataclass whose fields carry ``param(help=...)``.
        exclude: field or section names that get no flag (a tool that sets them itself).
        groups: ``{field name: group title}``: fields shown together in ``--help`` (fields not
            named go to a group titled after their section and its help, or ``cfg_cls``; strategy
            and nested-config fields get a group of their own, titled by the field's help, unless
            named here). Without it the groups are the configuration's own sections.

    Every generated flag defaults to ``None`` (not given); read them back with
    `config_overrides_from_args`.
    """
    hints = typing.get_type_hints(cfg_cls)
    helps, defaults = field_help(cfg_cls), field_defaults(cfg_cls)
    groups = dict(groups or {})
    default_title = _title or cfg_cls.__name__
    made: dict[str, argparse._ArgumentGroup] = {}

    def group(title: str) -> argparse._ArgumentGroup:
        if title not in made:
            made[title] = parser.add_argument_group(title)
        return made[title]

    skip = set(exclude)
    for f in dataclasses.fields(cfg_cls):
        if f.name in skip:
            continue
        tp = hints[f.name]
        if f.metadata.get("section"):
            title = f"{f.name} ({f.metadata.get('help', '')})"
            add_config_flags(parser, tp, exclude=skip, groups=groups, _section=f.name, _title=title)
            continue
        kind = f.metadata.get("strategy")
        if kind is not None:
            _add_strategy_flags(group(groups.get(f.name, "strategies")), f, kind)
            continue
        nested = _nested_config(tp)
        if nested is not None:
            title = f"{f.name} ({f.metadata.get('help') or nested.__name__})"  # as a section's
            _add_nested_flags(group(groups.get(f.name, title)), f, nested)
            continue
        g = group(groups.get(f.name, default_title))
        dest = DEST_PREFIX + (f"{_section}.{f.name}" if _section else f.name)
        _add_field_flag(g, f, tp, dest, _help(helps[f.name], defaults.get(f.name)))


def _add_field_flag(
    g: argparse._ArgumentGroup, f: dataclasses.Field, tp: Any, dest: str, help_text: str
) -> None:
    """The flag of one plain field (see the module's docstring)."""
    flag = flag_name(f)
    names = [flag, *f.metadata.get("aliases", ())]
    if _is_bool(tp):  # --flag, --flag BOOL (yes/no, true/false, on/off; auto where unset means it), --no-flag
        g.add_argument(*names, dest=dest, nargs="?", const=True, default=None, metavar="BOOL", help=help_text)
        negative = ["--no-" + n[2:] for n in names]
        g.add_argument(
            *negative, dest=dest, action="store_const", const=False, default=None, help=f"turn {flag} off"
        )
    elif f.metadata.get("repeat"):
        g.add_argument(
            *names,
            dest=dest,
            action="append",
            default=None,
            metavar=f.metadata.get("metavar", "VALUE"),
            help=help_text + " (repeatable)",
        )
    else:
        choices = _choices(tp)
        metavar = f.metadata.get("metavar") or (
            "{" + ",".join(str(c) for c in choices) + "}" if choices else f.name.upper()
        )
        g.add_argument(*names, dest=dest, default=None, metavar=metavar, help=help_text)


def _add_strategy_flags(g: argparse._ArgumentGroup, f: dataclasses.Field, kind: str) -> None:
    reg = REGISTRIES[kind]
    g.add_argument(
        f"--{kind}",
        dest=DEST_PREFIX + kind,
        default=None,
        metavar="{" + ",".join(reg.names()) + "}",
        help=_help(f.metadata.get("help", ""), f.metadata.get("default_name")),
    )
    owners: dict[str, list[str]] = {}
    for e in reg.entries():
        for sf in dataclasses.fields(e.config):
            owners.setdefault(sf.name, []).append(e.name)
    for fname, names in sorted(owners.items()):
        g.add_argument(
            f"--{kind}.{fname}",
            dest=f"{DEST_PREFIX}{kind}.{fname}",
            default=None,
            metavar="V",
            help=f"({', '.join(names)})",
        )
    for alias, fname in f.metadata.get("field_aliases", {}).items():
        g.add_argument(
            alias, dest=f"{DEST_PREFIX}{kind}.{fname}", default=None, metavar="V", help=f"= --{kind}.{fname}"
        )


def _add_nested_flags(g: argparse._ArgumentGroup, f: dataclasses.Field, cfg_cls: type) -> None:
    hints = typing.get_type_hints(cfg_cls)
    helps, defaults = field_help(cfg_cls), field_defaults(cfg_cls)
    for sf in dataclasses.fields(cfg_cls):
        flag = f"--{f.name}.{sf.name}"
        kwargs: dict[str, Any] = {"metavar": "V"}
        if _is_bool(hints[sf.name]):
            kwargs = {"nargs": "?", "const": "true", "metavar": "BOOL"}
        g.add_argument(
            flag,
            dest=f"{DEST_PREFIX}{f.name}.{sf.name}",
            default=None,
            help=_help(helps[sf.name], defaults.get(sf.name)),
            **kwargs,
        )


def config_overrides_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The generated flags that were given, as overrides: ``{"generation.max_new_tokens": "64",
    "selector": "static", "selector.skip_ratio": "0.3", "gate.enabled": "true", "model.kernels":
    False, "generation.stop_strings": ("###",)}`` (a field of a section under its dotted key).
    Values stay as typed (strings, except booleans and repeated flags); the config parses them
    with its field types."""
    out: dict[str, Any] = {}
    for key, value in vars(namespace).items():
        if key.startswith(DEST_PREFIX) and value is not None:
            out[key[len(DEST_PREFIX) :]] = tuple(value) if isinstance(value, list) else value
    return out


__all__ = [
    "DEST_PREFIX",
    "add_config_flags",
    "config_overrides_from_args",
    "flag_name",
]
