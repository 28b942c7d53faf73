"""The configuration of a run: `RunConfig`, the single source of truth.

Every way of configuring a run ends in one frozen `RunConfig`: Python code
(``RunConfig.from_preset("swift", max_new_tokens=64)``), a preset YAML, a saved config
(``RunConfig.load``), and the command line, whose flags are generated from the dataclass fields
(``framework.session.flags``) and applied with the same override rules.

Override keys (`RunConfig.from_preset`, `RunConfig.replace`):

- any field: ``max_new_tokens=64``, ``model="tiny-random"``, ``categories="qa,rag"``;
- a strategy kind with a name: ``selector="static"`` replaces the strategy (its fields are reset
  to the strategy's defaults unless the name is the current one), or with a mapping:
  ``selector={"skip_ratio": 0.3}`` sets fields of the current strategy,
  ``selector={"name": "static", "skip_ratio": 0.3}`` does both; a `StrategySpec` or a strategy's
  config object is taken as it is;
- a dotted key: ``**{"selector.skip_ratio": 0.3}``, ``**{"gate.enabled": True}``;
- ``gate={"enabled": True}`` or a ``GateConfig``.

Strings are parsed with the field's type, as on the command line (``"64"``, ``"true"``,
``"3,5"``); typed values are taken as they are. Every error is a `ConfigError` that names the
key as its flag: ``--selector.skip_ratio must be in [0, 1), got 1.5``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from framework.config import ConfigError, build_config, check_range, param, parse_value
from framework.drafting.gate import GateConfig
from framework.interfaces import REGISTRIES
from framework.registry import UnknownNameError
from framework.session.flags import flag_of
from framework.session.presets import load_preset

#: Values of ``--logger``.
LOGGERS = ("wandb", "csv", "none")
#: Values of ``--phase-timing`` (``auto``: on for a CPU, off for CUDA).
PHASE_TIMING = ("auto", "on", "off")
#: Values of ``--dtype`` (``framework.models.loading.DTYPES`` maps them to torch dtypes).
#: ``auto`` is resolved where the device is (`framework.models.loading.resolve_dtype`): bfloat16 on
#: CUDA, float32 on CPU.
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "auto")


@dataclass(frozen=True)
class StrategySpec:
    """A registered strategy name and its (validated) config object (``None``: its defaults)."""

    name: str
    config: Any = None

    def build(self, kind: str):
        """A fresh instance of the strategy, from the ``kind`` registry."""
        cls = REGISTRIES[kind].get(self.name)
        return cls(self.config if self.config is not None else cls.Config())

    def describe(self) -> dict[str, Any]:
        cfg = dataclasses.asdict(self.config) if self.config is not None else {}
        return {"name": self.name, "config": cfg}


class UnknownStrategyError(ConfigError, UnknownNameError):
    """A strategy name that is not registered (``--selector statik``); the message lists the
    registered names and a close match. Both a `ConfigError` and the registry's
    `UnknownNameError`."""

    def __init__(self, flag: str, value: str, lookup: UnknownNameError) -> None:
        ConfigError.__init__(self, flag, value, "a registered name")
        self.args = (f"{flag}: {lookup}",)

    def __str__(self) -> str:
        return str(self.args[0])


def strategy_field(
    kind: str,
    default_name: str,
    help: str = "",  # noqa: A002
    field_aliases: Mapping[str, str] | None = None,
) -> Any:
    """A `RunConfig` field holding the `StrategySpec` of ``kind`` (default: ``default_name`` with
    its default config); the flag generator turns it into ``--<kind>`` and ``--<kind>.<field>``.

    Args:
        kind: the registry (``selector``, ``length``, ``drafter``, ``verifier``).
        default_name: the registered name used when nothing else names one.
        help: the help of ``--<kind>``.
        field_aliases: short flags of strategy fields: ``{"--skip-set": "skip_set"}`` makes
            ``--skip-set F`` mean ``--<kind>.skip_set F``.
    """
    return field(
        default_factory=lambda: StrategySpec(default_name),
        metadata={
            "help": help,
            "strategy": kind,
            "default_name": default_name,
            "field_aliases": dict(field_aliases or {}),
        },
    )


@dataclass(frozen=True)
class RunConfig:
    """Everything one experiment needs: the model, the data, the four strategies, the draft gate,
    the output and how the run is executed (see the module docstring for building one)."""

    model: str | None = param(
        None,
        help="a named model (smollm2-135m-instruct, qwen2.5-coder-0.5b: see --list), a local .gguf file, an "
        "HF model directory or hub id; tiny-random: a tiny random Llama (smoke runs); default: "
        "smollm2-135m-instruct",
    )
    dtype: Literal["float32", "float16", "bfloat16", "float64", "auto"] = param(
        "float32",
        help="float32 (exact greedy equality on CPU), float16, bfloat16, float64, or auto (bfloat16 on CUDA, "
        "float32 on CPU)",
    )
    device: str = param("auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    data: str | None = param(None, help="Spec-Bench-format JSONL; default: the built-in suite")
    categories: tuple[str, ...] = param((), help="comma-separated categories to keep (e.g. mt_bench,qa)")
    limit: int | None = param(None, help="at most N prompts per category")
    max_new_tokens: int = param(128, help="new tokens per turn; >= 1", metavar="N")
    selector: StrategySpec = strategy_field(
        "selector",
        "static",
        help="the layer selector",
        field_aliases={
            "--skip-set": "skip_set",
            "--calib-data": "calib_data",
            "--calib-limit": "calib_limit",
        },
    )
    length: StrategySpec = strategy_field("length", "confidence", help="the draft-length controller")
    drafter: StrategySpec = strategy_field("drafter", "layer_skip", help="the drafter")
    verifier: StrategySpec = strategy_field("verifier", "greedy", help="the verifier")
    gate: GateConfig = field(
        default_factory=GateConfig,
        metadata={"help": "the draft gate around the length controller (framework.drafting.gate)"},
    )
    output: str | None = param(None, help="results JSONL (appended); default runs/<method>-<time>.jsonl")
    specbench_answers: str = param(
        "",
        help="also write Spec-Bench answer files (one per method, vanilla.jsonl the baseline) into DIR at "
        "the end, for Spec-Bench's evaluation/speed.py and equal.py; default: off",
        metavar="DIR",
    )
    seed: int = param(0, help="torch seed")
    warmup: int = param(1, help="warm-up generations per method before timing")
    threads: int | None = param(None, help="torch CPU threads (default: torch's choice)")
    stop_strings: tuple[str, ...] = param(
        (), help="an extra string that ends a turn", flag="--stop", metavar="STRING", repeat=True
    )
    name: str | None = param(None, help="method name in the results (default <selector>+<length>)")
    baseline_only: bool = param(False, help="decode with the vanilla baseline only (the `vanilla` preset)")
    kernels: bool = param(
        True, help="the batch-invariant CPU kernels (framework.kernels.cpu) for float32 on CPU"
    )
    phase_timing: Literal["auto", "on", "off"] = param(
        "auto",
        help="time each phase of a round and the LM head in the records: on, off, or auto (on for a CPU; "
        "off for CUDA, where every phase boundary waits for the device, about ten times a round)",
    )
    cuda_graphs: bool = param(
        False,
        help="run every forward of up to 64 tokens after the prefill (draft steps, plain steps, chain "
        "and tree verifications) through CUDA graphs of each attention and MLP branch "
        "(framework.kernels.graphs; CUDA only): about 2x faster plain decoding on a 7B model at "
        "batch 1 (docs/performance.md)",
    )
    logger: Literal["wandb", "csv", "none"] = param(
        "wandb", help="wandb (offline without an API key; upload later with `wandb sync`), csv or none"
    )
    wandb_project: str = param("selfspec", help="W&B project of --logger wandb")
    plots: bool = param(True, help="save PNG plots in the run directory (and log them)")
    resume: bool = param(False, help="skip prompts already in --output (same configuration only)")
    devices: int = param(1, help="processes per node (GPUs, or CPU processes); > 1 splits the prompts (DDP)")
    num_nodes: int = param(1, help="nodes of a multi-node run (Lightning's DDP environment)")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError("--dtype", self.dtype, f"one of {', '.join(DTYPE_NAMES)}")
        if self.phase_timing not in PHASE_TIMING:
            raise ConfigError("--phase-timing", self.phase_timing, f"one of {', '.join(PHASE_TIMING)}")
        if self.logger not in LOGGERS:
            raise ConfigError("--logger", self.logger, f"one of {', '.join(LOGGERS)}")
        check_range("--max-new-tokens", self.max_new_tokens, 1, integer=True)
        check_range("--warmup", self.warmup, 0, integer=True)
        check_range("--seed", self.seed, integer=True)
        if self.limit is not None:
            check_range("--limit", self.limit, 1, integer=True)
        if self.threads is not None:
            check_range("--threads", self.threads, 1, integer=True)
        check_range("--devices", self.devices, 1, integer=True)
        check_range("--num-nodes", self.num_nodes, 1, integer=True)
        for flag, value in (
            ("--baseline-only", self.baseline_only),
            ("--kernels", self.kernels),
            ("--cuda-graphs", self.cuda_graphs),
            ("--plots", self.plots),
            ("--resume", self.resume),
        ):
            if not isinstance(value, bool):
                raise ConfigError(flag, value, "a boolean (true/false)")
        if not isinstance(self.specbench_answers, str) or (
            self.specbench_answers and not self.specbench_answers.strip()
        ):
            raise ConfigError("--specbench-answers", self.specbench_answers, "a directory path, or '' (off)")
        for flag, value in (("--categories", self.categories), ("--stop", self.stop_strings)):
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise ConfigError(flag, value, "a tuple of strings")
        if self.device.startswith("cuda:") and self.devices * self.num_nodes > 1:
            raise ConfigError(
                "--device",
                self.device,
                "auto or cuda with --devices > 1 (cuda:N names one GPU; --devices N uses GPUs 0..N-1)",
            )
        if self.name == "vanilla" and not self.baseline_only:
            raise ConfigError("--name", self.name, "a name other than 'vanilla' (the baseline's name)")
        for kind in REGISTRIES:
            spec = getattr(self, kind)
            if not isinstance(spec, StrategySpec):
                raise ConfigError(f"--{kind}", spec, "a StrategySpec")
        if not isinstance(self.gate, GateConfig):
            raise ConfigError("--gate", self.gate, "a GateConfig")

    @property
    def phase_timing_flag(self) -> bool | None:
        """``--phase-timing`` for the decoders and the adapter: ``None`` (auto), ``True`` or ``False``."""
        return {"auto": None, "on": True, "off": False}[self.phase_timing]

    def for_rank(self, device: str, dtype: str | None = None) -> RunConfig:
        """This process's own configuration in a run of several (``--devices``/``--num-nodes``):
        the device the trainer gave the rank (``cuda:r``, or ``cpu``), one process, and the dtype
        ``auto`` resolved for that device (``dtype``, from
        `framework.models.loading.resolve_dtype`; ``None`` keeps the configured one).

        The user's ``--device cuda:N`` with ``--devices > 1`` is refused (one GPU cannot host
        several processes); a rank's ``cuda:r`` comes from the trainer, not from the user, and is
        valid because the rank's configuration describes that one process.
        """
        return dataclasses.replace(self, device=device, dtype=dtype or self.dtype, devices=1, num_nodes=1)

    # ---- building ---------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name_or_path: str | None = None, /, **overrides: Any) -> RunConfig:
        """The config of a shipped preset (``"swift"``) or a preset YAML file, with overrides.

        Args:
            name_or_path: a preset name (``framework/session/assets/presets/<name>.yaml``), a
                YAML path, or ``None`` for the defaults.
            **overrides: see the module docstring (``max_new_tokens=64``,
                ``selector="static"``, ``**{"selector.skip_ratio": 0.3}``, ``gate={"enabled": True}``).

        Raises:
            ConfigError: a bad preset, an unknown key, a value that does not parse or is out of
                range, a strategy name that is not registered (the message names the flag).
        """
        draft = _draft_of(cls())
        if name_or_path is not None:
            preset = load_preset(name_or_path)
            base: dict[str, Any] = {"name": preset["name"], "baseline_only": preset["baseline_only"]}
            base.update({k: preset[k] for k in (*REGISTRIES, "gate") if k in preset})
            _apply(draft, base)
        _apply(draft, overrides)
        return _build(cls, draft)

    def replace(self, **overrides: Any) -> RunConfig:
        """A copy with ``overrides`` applied, with the rules of `from_preset`."""
        draft = _draft_of(self)
        _apply(draft, overrides)
        return _build(type(self), draft)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (JSON/YAML-able): ``{"model": ..., "selector": {"name": ...,
        <field>: <value>, ...}, "gate": {...}, ...}``; tuples become lists. `from_dict` inverts it."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, StrategySpec):
                out[f.name] = {"name": value.name, **_plain(_fields_of(_config_of(f.name, value)))}
            else:
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunConfig:
        """The config `to_dict` wrote (keys left out keep their defaults).

        Raises:
            ConfigError: not a mapping, an unknown key, or an invalid value (named as its flag).
        """
        if not isinstance(data, Mapping):
            raise ConfigError("--config", data, "a mapping of RunConfig fields")
        return cls.from_preset(None, **dict(data))

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
    def load(cls, path: str | Path) -> RunConfig:
        """A config written by `save` (YAML or JSON).

        Raises:
            ConfigError: a missing or unreadable file, or invalid contents (named as their flags).
        """
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "a saved RunConfig file (YAML or JSON)")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as err:
            raise ConfigError("--config", str(path), f"valid YAML or JSON ({err})") from None
        return cls.from_dict(data)

    # ---- reading ----------------------------------------------------------------------------
    @property
    def method_name(self) -> str:
        if self.baseline_only:
            return "vanilla"
        return self.name or f"{self.selector.name}+{self.length.name}"

    def describe(self) -> dict[str, Any]:
        """The run's metadata form (``.meta.json``, logger config, the ``--resume`` check): every
        field, each strategy as ``{"name", "config"}``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in REGISTRIES}
        out.update({kind: getattr(self, kind).describe() for kind in REGISTRIES})
        out["gate"] = dataclasses.asdict(self.gate)
        out["categories"] = list(self.categories)
        out["stop_strings"] = list(self.stop_strings)
        return out


# ---- the override machinery -----------------------------------------------------------------
# A draft is a mutable copy of a config: {field: value} for plain fields, {"name": ..., field:
# value} for each strategy kind, {field: value} for the gate. Overrides edit the draft; `_build`
# validates it into a RunConfig.

_SECTIONS = {"gate": GateConfig}


def _fields_of(obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in _fields_of(value).items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _entry(kind: str, name: Any):
    """The registry entry of a strategy name (an `UnknownStrategyError` naming ``--<kind>``)."""
    if not isinstance(name, str):
        raise ConfigError(f"--{kind}", name, "a registered strategy name")
    try:
        return REGISTRIES[kind].entry(name)
    except UnknownNameError as err:
        raise UnknownStrategyError(f"--{kind}", name, err) from None


def _config_of(kind: str, spec: StrategySpec) -> Any:
    if spec.config is not None:
        return spec.config
    return _entry(kind, spec.name).config()


def _draft_of(cfg: RunConfig) -> dict[str, Any]:
    draft: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in REGISTRIES:
            draft[f.name] = {"name": value.name, **_fields_of(value.config)}
        elif f.name in _SECTIONS:
            draft[f.name] = _fields_of(value)
        else:
            draft[f.name] = value
    return draft


def _name_of_config(kind: str, config: Any) -> str | None:
    for e in REGISTRIES[kind].entries():
        if type(config) is e.config:
            return e.name
    return None


def _set_strategy(draft: dict[str, Any], kind: str, value: Any) -> None:
    """Apply ``<kind>=value`` (a name, a StrategySpec, a config object, or a mapping)."""
    current = draft[kind]
    if isinstance(value, StrategySpec):
        draft[kind] = {"name": value.name, **_fields_of(value.config)}
        return
    if isinstance(value, str):
        value = {"name": value}
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = _name_of_config(kind, value)
        if name is None:
            raise ConfigError(f"--{kind}", value, f"the config of a registered {kind}")
        draft[kind] = {"name": name, **_fields_of(value)}
        return
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"--{kind}", value, "a strategy name, a StrategySpec, a config or a mapping of fields"
        )
    value = dict(value)
    name = value.pop("name", current["name"])
    _entry(kind, name)
    if name != current["name"]:
        current = {"name": name}  # another strategy: the fields set for the old one are dropped
    draft[kind] = {**current, **value}


def _set_section(draft: dict[str, Any], key: str, value: Any) -> None:
    cls = _SECTIONS[key]
    if isinstance(value, cls):
        draft[key] = _fields_of(value)
    elif isinstance(value, Mapping):
        draft[key] = {**draft[key], **value}
    else:
        raise ConfigError(f"--{key}", value, f"a {cls.__name__} or a mapping of its fields")


def _apply(draft: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Edit ``draft`` in place: whole strategies and sections first, then dotted keys, so that
    ``selector="static"`` and ``**{"selector.skip_ratio": 0.3}`` combine in any order."""
    dotted = []
    for raw_key, value in overrides.items():
        key = raw_key.replace("-", "_")
        if "." in key:
            dotted.append((key, value))
        elif key in REGISTRIES:
            _set_strategy(draft, key, value)
        elif key in _SECTIONS:
            _set_section(draft, key, value)
        elif key in draft:
            draft[key] = value
        else:
            plain = [k for k in draft if k not in REGISTRIES and k not in _SECTIONS]
            raise ConfigError(
                "--" + raw_key.replace("_", "-"),
                value,
                "a RunConfig field ("
                + ", ".join(plain + list(REGISTRIES) + list(_SECTIONS))
                + ") or <kind>.<field>",
            )
    for key in [k for k, _ in dotted if k.endswith(".name")]:  # names before their fields
        kind = key.split(".", 1)[0]
        if kind in REGISTRIES:
            _set_strategy(draft, kind, {"name": dict(dotted)[key]})
    for key, value in dotted:
        head, sub = key.split(".", 1)
        if head in REGISTRIES:
            if sub != "name":
                draft[head] = {**draft[head], sub: value}
        elif head in _SECTIONS:
            draft[head] = {**draft[head], sub: value}
        else:
            raise ConfigError(
                f"--{key}", value, f"<kind>.<field> with kind one of {', '.join([*REGISTRIES, *_SECTIONS])}"
            )


def _build(cls: type[RunConfig], draft: dict[str, Any]) -> RunConfig:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = draft[f.name]
        if f.name in REGISTRIES:
            values = dict(value)
            name = values.pop("name")
            entry = _entry(f.name, name)
            kwargs[f.name] = StrategySpec(
                name, build_config(entry.config, values, flag_prefix=f"--{f.name}.")
            )
        elif f.name in _SECTIONS:
            kwargs[f.name] = build_config(_SECTIONS[f.name], dict(value), flag_prefix=f"--{f.name}.")
        else:
            flag = flag_of(cls, f.name)
            if isinstance(value, str) and f.metadata.get("repeat"):
                value = (value,)
            elif isinstance(value, str):
                value = parse_value(value, hints[f.name], flag)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
    return cls(**kwargs)


__all__ = [
    "DTYPE_NAMES",
    "LOGGERS",
    "RunConfig",
    "StrategySpec",
    "UnknownStrategyError",
    "strategy_field",
]
