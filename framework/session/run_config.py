"""The configuration of a run: `RunConfig`, the single source of truth, in six sections
(`framework.session.sections`: the model, the method, the data, the generation, the runner, and
the methods compared). `selfspec.Decoder` takes the model, method and generation sections only;
a run of several methods (``bench.py``) shares its sections with every method and swaps the
method section per method (`framework.session.methods`).

Every way of configuring a run ends in one frozen `RunConfig`: Python code
(``RunConfig.from_preset("swift", max_new_tokens=64)``), a preset YAML, a saved config
(``RunConfig.load``), and the command line, whose flags are generated from the sections' fields
(``framework.session.flags``; one flag per field, the sections do not show on the command line)
and applied with the same override rules.

Override keys (`RunConfig.from_preset`, `RunConfig.replace`, `RunConfig.of`) come in two
spellings, the same for flags, presets, sweeps and Python:

- a flat name, the flag without dashes: ``max_new_tokens=64``, ``model="tiny-random"``,
  ``data="q.jsonl"``, ``categories="qa,rag"``, ``stop=("###",)``; a strategy kind names its
  strategy: ``selector="static"`` (its fields are reset to the strategy's defaults unless the
  name is the current one);
- a dotted key, ``<section>.<field>`` or ``<kind>.<field>``: ``**{"generation.max_new_tokens":
  64}``, ``**{"selector.skip_ratio": 0.3}``, ``**{"gate.enabled": True}``,
  ``**{"length.name": "fixed"}``.

A whole section, a strategy or the gate given as a mapping or an object (``gate={"enabled":
True}``, ``selector=StaticSelectorConfig(...)``, ``generation=GenerationConfig(...)``) is refused
with an error that spells it in dotted keys. Code that holds a section object swaps it in with
``dataclasses.replace(cfg, method=...)``.

Strings are parsed with the field's type, as on the command line (``"64"``, ``"true"``,
``"3,5"``); typed values are coerced (`framework.config_fields.coerce_value`: lists to tuples, YAML's
``8.0`` to an int), never spelled back as text. Every error is a `ConfigError` that names the key
as its flag: ``--selector.skip_ratio must be in [0, 1), got 1.5``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from framework.config_fields import ConfigError
from framework.interfaces import REGISTRIES
from framework.session import methods
from framework.session import overrides as ov
from framework.session.overrides import FLAT_KEYS, section_of
from framework.session.plugins import recorded_imports
from framework.session.presets import yaml_problem
from framework.session.sections import (
    DTYPE_NAMES,
    LOGGERS,
    SECTIONS,
    CompareConfig,
    DataConfig,
    GenerationConfig,
    MethodConfig,
    ModelConfig,
    RunnerConfig,
    StrategySpec,
    UnknownStrategyError,
    strategy_field,
)


def _section(name: str, help: str) -> Any:  # noqa: A002
    return field(default_factory=SECTIONS[name], metadata={"help": help, "section": True})


@dataclass(frozen=True)
class RunConfig:
    """Everything one experiment needs, in five sections (see the module docstring for building
    one): ``model``, ``method``, ``data``, ``generation`` and ``runner``."""

    model: ModelConfig = _section("model", "the model and how it executes")
    method: MethodConfig = _section("method", "the four strategies and the draft gate")
    data: DataConfig = _section("data", "the prompts")
    generation: GenerationConfig = _section("generation", "one generation's budget and stops")
    runner: RunnerConfig = _section("runner", "how the runner executes and records the run")
    compare: CompareConfig = _section("compare", "the methods compared (bench.py) and their pricing")

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"--{name}", getattr(self, name), f"a {cls.__name__}")
        # the methods resolve (the message lists the allowed ones), --preset-args flags read once
        object.__setattr__(self, "compare", methods.checked(self.compare, type(self)))
        if self.model.device_map and self.runner.devices * self.runner.num_nodes > 1:
            raise ConfigError(
                "--device-map",
                self.model.device_map,
                "used with one process (--devices 1): it splits one model across devices; --devices N "
                "runs N whole copies",
            )
        if self.method.synthetic_acceptance is not None and self.runner.specbench_answers:
            raise ConfigError(
                "--specbench-answers",
                self.runner.specbench_answers,
                "off with --synthetic-acceptance (its output is not the model's: no answer files)",
            )
        if self.model.device.startswith("cuda:") and self.runner.devices * self.runner.num_nodes > 1:
            raise ConfigError(
                "--device",
                self.model.device,
                "auto or cuda with --devices > 1 (cuda:N names one GPU; --devices N uses GPUs 0..N-1)",
            )

    def for_rank(self, device: str, dtype: str | None = None) -> RunConfig:
        """This process's own configuration in a run of several (``--devices``/``--num-nodes``):
        the device the trainer gave the rank (``cuda:r``, or ``cpu``), one process, and the dtype
        ``auto`` resolved for that device (``dtype``, from
        `framework.models.loading.resolve_dtype`; ``None`` keeps the configured one).

        The user's ``--device cuda:N`` with ``--devices > 1`` is refused (one GPU cannot host
        several processes); a rank's ``cuda:r`` comes from the trainer, not from the user, and is
        valid because the rank's configuration describes that one process.
        """
        model = dataclasses.replace(self.model, device=device, dtype=dtype or self.model.dtype)
        runner = dataclasses.replace(self.runner, devices=1, num_nodes=1)
        return dataclasses.replace(self, model=model, runner=runner)

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name_or_path: str | None = None, /, **overrides: Any) -> RunConfig:
        """The config of a shipped preset (``"swift"``) or a preset YAML file, with overrides.

        Args:
            name_or_path: a preset name (``framework/session/assets/presets/<name>.yaml``), a
                YAML path, or ``None`` for the defaults.
            **overrides: flat names and dotted keys, see the module docstring
                (``max_new_tokens=64``, ``selector="static"``, ``**{"selector.skip_ratio": 0.3}``,
                ``**{"gate.enabled": True}``).

        Raises:
            ConfigError: a bad preset, an unknown key, a value that does not parse or is out of
                range, a strategy name that is not registered (the message names the flag).
        """
        return cls._layered(name_or_path, overrides)

    @classmethod
    def _layered(cls, name_or_path: str | None, *layers: Mapping[str, Any]) -> RunConfig:
        """The preset's draft (`from_preset`'s ``name_or_path``) with each layer of overrides
        applied in order, validated once."""
        draft = ov.preset_draft(name_or_path)
        for overrides in layers:
            ov.apply(draft, overrides)
        return cls(**ov.build(draft))

    @classmethod
    def of(cls, **overrides: Any) -> RunConfig:
        """The defaults with ``overrides`` (``RunConfig.of(max_new_tokens=32, dtype="float64")``)."""
        return cls.from_preset(None, **overrides)

    def replace(self, **overrides: Any) -> RunConfig:
        """A copy with ``overrides`` applied, with the rules of `from_preset`."""
        draft = ov.draft_of(self)
        ov.apply(draft, overrides)
        return type(self)(**ov.build(draft))

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict by section (JSON/YAML-able): ``{"model": {...}, "method":
        {"selector": {"name": ..., <field>: <value>, ...}, ..., "gate": {...}, ...}, ...}``; tuples
        become lists. `from_dict` inverts it."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {}
            for f in dataclasses.fields(section):
                value = getattr(section, f.name)
                if isinstance(value, StrategySpec):
                    fields = ov.fields_of(ov.config_of(f.name, value))
                    out[name][f.name] = {"name": value.name, **ov.plain(fields)}
                elif name == "method" and f.name == "imports":  # with the hash of each source
                    out[name][f.name] = recorded_imports(value)
                else:
                    out[name][f.name] = ov.plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /, **overrides: Any) -> RunConfig:
        """The config `to_dict` wrote (keys left out keep their defaults); a flat dict of override
        keys (a config saved before the sections) is read too. ``overrides`` (as `from_preset`'s)
        apply on top, validated once with the rest.

        Raises:
            ConfigError: not a mapping, an unknown key, or an invalid value (named as its flag).
        """
        if not isinstance(data, Mapping):
            raise ConfigError("--config", data, "a mapping of RunConfig sections")
        keys: dict[str, Any] = {}
        for key, value in data.items():  # the file's nesting, as dotted keys
            block = key in SECTIONS or key in REGISTRIES or key in ov.NESTED
            if block and isinstance(value, Mapping):
                for sub, v in value.items():
                    nested = key == "method" and sub in (*REGISTRIES, *ov.NESTED) and isinstance(v, Mapping)
                    keys.update({f"{sub}.{k}": x for k, x in v.items()} if nested else {f"{key}.{sub}": v})
            else:
                keys[key] = value
        return cls._layered(None, keys, overrides)  # the command line's after the file's

    def save(self, path: str | Path) -> Path:
        """Write `to_dict` as YAML (JSON when ``path`` ends in ``.json``); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        if path.suffix == ".json":
            path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
        else:
            path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path, /, **overrides: Any) -> RunConfig:
        """A config written by `save` (YAML or JSON), with ``overrides`` as `from_dict`'s.

        Raises:
            ConfigError: a missing or unreadable file, or invalid contents (named as their flags).
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "a saved RunConfig file (YAML or JSON)")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError("--config", str(path), f"valid YAML or JSON ({yaml_problem(err)})") from None
        return cls.from_dict(data, **overrides)

    # ---- reading ----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """The run's metadata form (``.meta.json``, logger config, the ``--resume`` check): every
        field flat by its override key (``model``, ``max_new_tokens``, ...), each strategy as
        ``{"name", "config"}``, the gate as a dict."""
        out: dict[str, Any] = {}
        for key, (section, name) in FLAT_KEYS.items():
            value = getattr(getattr(self, section), name)
            out[key] = list(value) if isinstance(value, tuple) else value
        method = self.method
        out["imports"] = recorded_imports(method.imports)
        out.update({kind: spec.describe() for kind, spec in method.strategies().items()})
        out["gate"] = dataclasses.asdict(method.gate)
        return out


__all__ = [
    "DTYPE_NAMES",
    "FLAT_KEYS",
    "LOGGERS",
    "SECTIONS",
    "DataConfig",
    "GenerationConfig",
    "MethodConfig",
    "ModelConfig",
    "RunConfig",
    "RunnerConfig",
    "CompareConfig",
    "StrategySpec",
    "UnknownStrategyError",
    "section_of",
    "strategy_field",
]
