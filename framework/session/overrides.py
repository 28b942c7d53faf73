"""The override rules of `RunConfig` (``from_preset``, ``replace``, ``of``, ``from_dict``, the
command line, presets and sweeps): a draft, ``{section: {field: value}}`` with the method section's
strategies as ``{"name": ..., field: value}`` and the gate as ``{field: value}``, is edited by flat
names and dotted keys (`apply`) and validated into a config (`build`). The spellings are described
in `framework.session.run_config`."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from framework.config_fields import ConfigError, build_config, coerce_value
from framework.drafting.gate import GateConfig
from framework.interfaces import REGISTRIES
from framework.registry import UnknownNameError
from framework.session.flags import flag_name
from framework.session.plugins import import_recorded
from framework.session.presets import PRESET_DIR, load_preset, preset_path
from framework.session.sections import SECTIONS, StrategySpec, UnknownStrategyError

# A draft is a mutable copy of a config: {section: {field: value}}, where the method section holds
# {"name": ..., field: value} for each strategy kind and {field: value} for the gate. Overrides
# edit the draft; `build` validates it into a RunConfig.

NESTED = {"gate": GateConfig}  # config dataclasses inside the method section
#: Flat keys that are not their field's name (the keys before the sections).
_RENAMED = {("model", "name_or_path"): "model", ("data", "path"): "data"}


def _flat_keys() -> dict[str, tuple[str, str]]:
    """``{flat key: (section, field)}`` of every plain field (strategies and the gate excluded)."""
    out: dict[str, tuple[str, str]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name in REGISTRIES or f.name in NESTED:
                continue
            out[_RENAMED.get((section, f.name), f.name)] = (section, f.name)
    return out


#: ``{flat key: (section, field)}``: the override keys of plain fields (`RunConfig.describe` uses
#: them as its keys).
FLAT_KEYS = _flat_keys()
#: Further spellings of flat keys: each field's flag without dashes (``stop`` for ``stop_strings``),
#: where that is not another field's own key (``synthetic_acceptance`` is the method's; bench.py's
#: ``--synthetic-acceptance`` for every preset is ``compare.synthetic``).
_ALIASES = {
    flag_name(f).lstrip("-").replace("-", "_"): key
    for key, (section, name) in FLAT_KEYS.items()
    for f in dataclasses.fields(SECTIONS[section])
    if f.name == name and flag_name(f).lstrip("-").replace("-", "_") not in FLAT_KEYS
}


def section_of(key: str) -> str | None:
    """The section an override key sets (``"generation"`` for ``max_new_tokens``, ``"method"``
    for ``selector.skip_ratio`` or ``gate``), or ``None`` for a key that is no override."""
    key = key.replace("-", "_")
    head = key.split(".", 1)[0]
    if head in REGISTRIES or head in NESTED:
        return "method"
    if "." in key:
        return head if head in SECTIONS else None
    flat = _ALIASES.get(key, key)
    if flat in FLAT_KEYS:
        return FLAT_KEYS[flat][0]
    return key if key in SECTIONS else None


def fields_of(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in fields_of(value).items()}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def _entry(kind: str, name: Any):
    """The registry entry of a strategy name (an `UnknownStrategyError` naming ``--<kind>``)."""
    if not isinstance(name, str):
        raise ConfigError(f"--{kind}", name, "a registered strategy name")
    try:
        return REGISTRIES[kind].entry(name)
    except UnknownNameError as err:
        raise UnknownStrategyError(f"--{kind}", name, err) from None


def config_of(kind: str, spec: StrategySpec) -> Any:
    if spec.config is not None:
        return spec.config
    return _entry(kind, spec.name).config()


def draft_of(cfg: Any) -> dict[str, dict[str, Any]]:
    """The draft of a config (a `RunConfig`, or anything with its sections as attributes)."""
    draft: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        values = fields_of(getattr(cfg, section))
        if section == "method":
            for kind in REGISTRIES:
                values[kind] = {"name": values[kind].name, **fields_of(values[kind].config)}
            for key in NESTED:
                values[key] = fields_of(values[key])
        draft[section] = values
    return draft


def _set_strategy(method: dict[str, Any], kind: str, name: Any) -> None:
    """Apply ``<kind>=name``: another strategy starts from its defaults (the fields set for the
    old one are dropped); the current one keeps its fields."""
    _entry(kind, name)
    if name != method[kind]["name"]:
        method[kind] = {"name": name}


def _changed_fields(obj: Any) -> dict[str, Any]:
    """The fields of a config object that differ from its class's defaults (all of them when the
    class has no defaults)."""
    try:
        default = fields_of(type(obj)())
    except TypeError:
        default = {}
    return {k: v for k, v in fields_of(obj).items() if k not in default or default[k] != v}


def _as_dotted(key: str, value: Any) -> dict[str, Any]:
    """The dotted keys that say what ``key=value`` said in a spelling that went."""
    if isinstance(value, StrategySpec):
        fields = _changed_fields(value.config) if value.config is not None else {}
        return {f"{key}.name": value.name, **{f"{key}.{k}": v for k, v in fields.items()}}
    if isinstance(value, Mapping):
        return {f"{key}.{k}": v for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f"{key}.{k}": v for k, v in _changed_fields(value).items()}
    return {}


def _spelling_gone(key: str, value: Any, wanted: str) -> ConfigError:
    """The error of a whole section, strategy or gate given as a mapping or an object: it names
    the dotted keys that say the same."""
    dotted = _as_dotted(key, value)
    example = ", ".join(f"{k}={v!r}" for k, v in dotted.items()) or f"{key}.<field>=VALUE"
    return ConfigError(
        f"--{key}",
        value,
        f"{wanted} (overrides are flat names or dotted keys: write {example})",
    )


def _unknown(raw_key: str, value: Any) -> ConfigError:
    known = [*FLAT_KEYS, *REGISTRIES, *NESTED]
    close = difflib.get_close_matches(raw_key.replace("-", "_"), known, n=1, cutoff=0.7)
    return ConfigError(
        "--" + raw_key.replace("_", "-"),
        value,
        "a RunConfig field ("
        + ", ".join(known)
        + "), <kind>.<field>, or <section>.<field> with section one of "
        + ", ".join(SECTIONS),
        f"did you mean {close[0]!r}?" if close else "",
    )


def _set_dotted(draft: dict[str, dict[str, Any]], key: str, value: Any) -> None:
    head, sub = key.split(".", 1)
    method = draft["method"]
    if head in REGISTRIES:
        if sub == "name":
            _set_strategy(method, head, value)
        else:
            method[head] = {**method[head], sub: value}
    elif head in NESTED:
        method[head] = {**method[head], sub: value}
    elif head in SECTIONS:
        if sub in draft[head]:
            draft[head][sub] = value
        else:
            names = ", ".join(draft[head])
            raise ConfigError(f"--{key}", sub, f"a field of the {head} section ({names})")
    else:
        raise ConfigError(
            f"--{key}",
            value,
            f"<kind>.<field> with kind one of {', '.join([*REGISTRIES, *NESTED])}, or <section>.<field> "
            f"with section one of {', '.join(SECTIONS)}",
        )


def _method_key(key: str) -> str:
    """``method.<kind>`` is ``<kind>.name``, and ``method.<kind>.<field>`` or ``method.gate...``
    the key without ``method.``; other keys are themselves."""
    head, _, sub = key.partition(".")
    if head != "method" or sub.split(".", 1)[0] not in (*REGISTRIES, *NESTED):
        return key
    return f"{sub}.name" if sub in REGISTRIES else sub


def apply(draft: dict[str, dict[str, Any]], overrides: Mapping[str, Any]) -> None:
    """Edit ``draft`` in place: flat keys first, then dotted keys (strategy names before their
    fields), so that ``selector="static"`` and ``**{"selector.skip_ratio": 0.3}`` combine in any
    order.

    Raises:
        ConfigError: an unknown key, or a spelling that went (a section, a strategy or the gate as
            a mapping or an object), with the dotted keys that say the same.
    """
    overrides = dict(overrides)
    for raw_key, value in list(overrides.items()):  # first: the strategies they register
        key = raw_key.replace("-", "_")
        if _ALIASES.get(key, key) == "imports" or key == "method.imports":
            overrides[raw_key] = import_recorded(value)
    dotted = []
    for raw_key, value in overrides.items():
        key = _method_key(raw_key.replace("-", "_"))
        flat = _ALIASES.get(key, key)
        if "." in key:
            dotted.append((key, value))
        elif key in REGISTRIES:
            if not isinstance(value, str):
                raise _spelling_gone(key, value, f"a registered {key} name")
            _set_strategy(draft["method"], key, value)
        elif key in NESTED or (key in SECTIONS and not isinstance(value, str | None)):
            raise _spelling_gone(key, value, "set field by field")
        elif flat in FLAT_KEYS:
            section, name = FLAT_KEYS[flat]
            draft[section][name] = value
        else:
            raise _unknown(raw_key, value)
    dotted.sort(key=lambda kv: not kv[0].endswith(".name"))  # names before their fields
    for key, value in dotted:
        _set_dotted(draft, key, value)


def build_section(cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = values[f.name]
        if f.name in REGISTRIES:
            values_ = dict(value)
            name = values_.pop("name")
            entry = _entry(f.name, name)
            kwargs[f.name] = StrategySpec(
                name, build_config(entry.config, values_, flag_prefix=f"--{f.name}.")
            )
        elif f.name in NESTED:
            kwargs[f.name] = build_config(NESTED[f.name], dict(value), flag_prefix=f"--{f.name}.")
        else:
            if isinstance(value, str) and f.metadata.get("repeat"):
                value = (value,)
            kwargs[f.name] = coerce_value(value, hints[f.name], flag_name(f))
    return cls(**kwargs)


def build(draft: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The sections of ``draft``, validated (``RunConfig(**build(draft))``)."""
    return {name: build_section(cls, draft[name]) for name, cls in SECTIONS.items()}


def preset_draft(name_or_path: str | None) -> dict[str, dict[str, Any]]:
    """The draft of a shipped preset or a preset YAML file (``None``: the defaults); an error in
    the preset names the file, not a flag."""
    draft = draft_of(types.SimpleNamespace(**{name: cls() for name, cls in SECTIONS.items()}))
    if name_or_path is None:
        return draft
    preset = load_preset(name_or_path)
    base: dict[str, Any] = {"name": preset["name"], "baseline_only": preset["baseline_only"]}
    for key in (*REGISTRIES, *NESTED):  # a preset file's blocks, as dotted keys
        base.update({f"{key}.{k}": v for k, v in preset.get(key, {}).items()})
    try:  # the preset alone first
        apply(draft, base)
        build(draft)
    except ConfigError as err:
        where = preset_path(name_or_path)
        where_text = where.name if where.parent == PRESET_DIR else str(where)
        raise err.with_flag(f"{where_text}: {str(err.field).lstrip('-')}") from None
    return draft


__all__ = [
    "FLAT_KEYS",
    "apply",
    "build",
    "config_of",
    "draft_of",
    "fields_of",
    "plain",
    "preset_draft",
    "section_of",
]
