"""The benchmark's configuration: the methods to compare and the benchmark's own knobs, around one
`RunConfig` whose sections every method shares (`SHARED_SECTIONS`: the model, the data, the
generation; of the runner section, `RUNNER_FIELDS`). Each preset method swaps in its own method
section (`method_run_config`).

A method is ``vanilla`` (our autoregressive baseline, always run), one of the Hugging Face
``generate`` methods (`HF_METHODS`), a shipped preset, or a preset YAML file (`parse_methods`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.benchmark.hf import HF_METHODS
from framework.config_fields import ConfigError, check_range, param, parse_value
from framework.interfaces import REGISTRIES
from framework.session.flags import add_config_flags, config_overrides_from_args, flag_of
from framework.session.presets import list_presets, load_preset
from framework.session.run_config import FLAT_KEYS, MethodConfig, RunConfig

BASELINE = "vanilla"
#: What a first run shows (README command 1): this framework's default layer-skip method with its
#: draft gate, the same with the gate off (what drafting by layer skipping does on this model), and
#: the hybrid drafter (copies from the context where it can). Hugging Face's methods: ``--methods``.
DEFAULT_METHODS = ("vanilla", "static_confidence", "static_confidence:raw", "hybrid")
#: The `RunConfig` sections every method shares: the vanilla baseline and every preset decode the
#: same model, prompts and generation budget; a preset brings its own ``method`` section.
SHARED_SECTIONS = ("model", "data", "generation")
#: The runner section's fields the benchmark uses (its own output and processes are ``--out``,
#: ``--specbench-answers`` and one process; it logs to the tracker as the runner does).
RUNNER_FIELDS = ("warmup", "threads", "plots", "logger", "wandb_project")


def preset_flags_parser() -> argparse.ArgumentParser:
    """A parser of ``--preset-args`` flags: every run option of ``run.py`` (generated from
    `RunConfig`; strategy flags for the registered strategies) except the ones the benchmark
    decides (``--output``, ``--name``)."""
    parser = argparse.ArgumentParser(prog="--preset-args", add_help=False, exit_on_error=False)
    add_config_flags(parser, RunConfig, exclude=("output", "name"))
    return parser


def preset_overrides(method: str, given: str | Mapping[str, Any]) -> dict[str, Any]:
    """The typed overrides of one ``--preset-args`` entry: a mapping as it is, or run.py flags
    (``"--selector.skip_ratio 0.3 --length.k 4"``) read into ``{"selector.skip_ratio": "0.3",
    "length.k": "4"}`` (values parsed later with the fields' types).

    Raises:
        ConfigError: a flag ``run.py`` does not have, a flag without its value, or neither a
            mapping nor a string.
    """
    where = f"--preset-args {method}"
    if isinstance(given, Mapping):
        return dict(given)
    if not isinstance(given, str):
        raise ConfigError(where, given, "run.py flags (a string) or a mapping of RunConfig overrides")
    try:
        args, unknown = preset_flags_parser().parse_known_args(shlex.split(given))
    except (argparse.ArgumentError, ValueError) as err:
        raise ConfigError(where, given, f"valid run.py flags ({err})") from None
    if unknown:
        raise ConfigError(where, " ".join(unknown), "run.py flags (see run.py --help)")
    return config_overrides_from_args(args)


def method_section(source: str | MethodConfig) -> MethodConfig:
    """The method section of a preset name or YAML file (or the section itself)."""
    return source if isinstance(source, MethodConfig) else RunConfig.from_preset(source).method


def allowed_methods() -> list[str]:
    """Every method name `parse_methods` accepts (besides preset YAML files)."""
    return [BASELINE, *HF_METHODS, *(p for p in list_presets() if p != BASELINE)]


@dataclass(frozen=True)
class MethodSpec:
    """A method of the benchmark: ``kind`` is ``baseline``, ``hf``, ``preset`` or ``custom``."""

    label: str
    kind: str
    #: the preset name or YAML path, or the method section itself (a `MethodConfig` given in Python)
    source: str | MethodConfig = ""
    #: a ``RAW_SUFFIX`` companion of a gated preset: the same method with the draft gate off
    raw: bool = False


#: The label suffix of a preset's gate-off companion row (``--raw``).
RAW_SUFFIX = ":raw"


def parse_methods(methods: Sequence[str], with_raw: bool = False) -> list[MethodSpec]:
    """Resolve method names; vanilla is added first when missing. Optionally, every preset whose
    draft gate is on is followed by its gate-off companion ``<label>:raw`` (``with_raw``; the method as
    published: its own alpha, M and speedup, also where the gate would decline).

    Raises:
        ConfigError: an unknown name (the message lists the allowed ones), a duplicate, or a
            baseline-only preset file.
    """
    shipped = set(list_presets())
    out: list[MethodSpec] = []
    for raw in methods:
        if isinstance(raw, MethodConfig):  # a method section given in Python
            spec = MethodSpec(raw.label, "preset", raw)
            if raw.baseline_only or spec.label == BASELINE or spec.label in HF_METHODS:
                raise ConfigError(
                    "--methods", spec.label, "a method section with strategies and its own name"
                )
            if any(s.label == spec.label for s in out):
                raise ConfigError("--methods", spec.label, "each method once (two methods share the name)")
            out.append(spec)
            continue
        name = raw.strip()
        if not name:
            continue
        if name == BASELINE:
            spec = MethodSpec(BASELINE, "baseline")
        elif name in HF_METHODS:
            spec = MethodSpec(name, "hf")
        elif name in shipped:
            spec = MethodSpec(name, "preset", name)
        elif name.endswith(RAW_SUFFIX) and name[: -len(RAW_SUFFIX)] in shipped:
            base = name[: -len(RAW_SUFFIX)]
            if not RunConfig.from_preset(base).method.gate.enabled:
                raise ConfigError(
                    "--methods", name, f"{base} without {RAW_SUFFIX}: its draft gate is already off"
                )
            spec = MethodSpec(name, "preset", base, raw=True)
        elif Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
            label = Path(name).stem
            if label == BASELINE or label in HF_METHODS:
                raise ConfigError("--methods", name, f"a preset file whose name is not {label!r} (reserved)")
            spec = MethodSpec(label, "preset", name)
            if load_preset(name)["baseline_only"]:
                raise ConfigError("--methods", name, "a preset with strategies (vanilla is always run)")
        else:
            raise ConfigError(
                "--methods",
                name,
                f"a comma-separated list of {', '.join(allowed_methods())}, '<preset>{RAW_SUFFIX}' (a "
                "gated preset with its gate off), or preset YAML files",
            )
        if any(s.label == spec.label for s in out):
            raise ConfigError("--methods", name, "each method once (two methods share the name)")
        out.append(spec)
    if with_raw:
        paired: list[MethodSpec] = []
        labels = {s.label for s in out}
        for s in out:
            paired.append(s)
            raw_label = s.label + RAW_SUFFIX
            if (
                s.kind == "preset"
                and not s.raw
                and raw_label not in labels
                and method_section(s.source).gate.enabled
            ):
                paired.append(MethodSpec(raw_label, "preset", s.source, raw=True))
        out = paired
    if not any(s.kind == "baseline" for s in out):
        out.insert(0, MethodSpec(BASELINE, "baseline"))
    if len(out) < 2:
        raise ConfigError("--methods", ",".join(methods), "at least one method besides vanilla")
    return out


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark needs (built by `framework.benchmark.cli.main`, or directly in Python).

    ``run`` holds what every method shares (its `SHARED_SECTIONS` and `RUNNER_FIELDS`; each preset
    method brings its own method section, `method_run_config`); the other fields are the
    benchmark's own.

    Example:
        ``BenchConfig(methods=("vanilla", "swift"), run=RunConfig.of(max_new_tokens=64, limit=1), repeats=2)``
    """

    run: RunConfig = field(
        default_factory=RunConfig,
        metadata={"help": "the run options every method shares (model, data, max_new_tokens, ...)"},
    )
    methods: tuple[str | MethodConfig, ...] = param(
        DEFAULT_METHODS,
        help="comma-separated: vanilla, hf_generate, hf_prompt_lookup, hf_early_exit, any preset, a gated "
        "preset with ':raw' (its gate off), or preset YAML files; in Python also method sections "
        "(MethodConfig, named by their label)",
    )
    repeats: int = param(1, help="repetitions of the whole interleaved run")
    out: str | None = param(None, help="output directory (default runs/bench-<time>)")
    prompt_lookup_num_tokens: int = param(10, help="hf_prompt_lookup's candidate tokens per lookup")
    max_matching_ngram_size: int | None = param(None, help="hf_prompt_lookup's n-gram size (HF default 2)")
    early_exit_layer: int | None = param(None, help="hf_early_exit's layer E (default round(0.8 L))")
    hf_kernels: bool = param(
        False,
        help="run the HF methods with this framework's CPU kernels too (default: stock PyTorch, as users "
        "run them)",
    )
    cost_model: str = param(
        "measure",
        help="'measure' (~15 s; saved as <out>/cost_model.json), 'none', or a CostModel / selfsd skip-set "
        "JSON file",
    )
    skip_set: str | None = param(None, help="skip-set file for presets whose selector takes one (selfsd)")
    preset_args: tuple[tuple[str, Any], ...] = param(
        (),
        help="(method, overrides) pairs: typed RunConfig overrides for one preset ({'selector.skip_ratio': "
        "0.3}), or run.py flags as typed on the command line, METHOD=FLAGS, e.g. "
        "'swift=--selector.skip_ratio 0.3' (repeatable), read once into overrides",
    )
    raw: bool = param(
        False,
        help="also run every preset whose draft gate is on with the gate off, as a '<method>:raw' row: "
        "the method's own alpha, M and speedup where the gate would decline",
    )
    specbench_answers: str = param(
        "",
        help="also write Spec-Bench answer files (one per method, vanilla.jsonl the baseline; run_<r>/ per "
        "repeat) into DIR, for Spec-Bench's evaluation/speed.py and equal.py; default: off",
        metavar="DIR",
    )
    command: str = param("", help="the command line, for the report")

    def __post_init__(self) -> None:
        if not isinstance(self.run, RunConfig):
            raise ConfigError("run", self.run, "a RunConfig")
        check_range("--repeats", self.repeats, 1, integer=True)
        check_range("--prompt-lookup-num-tokens", self.prompt_lookup_num_tokens, 1, integer=True)
        for flag, val in (
            ("--max-matching-ngram-size", self.max_matching_ngram_size),
            ("--early-exit-layer", self.early_exit_layer),
        ):
            if val is not None:
                check_range(flag, val, 1, integer=True)
        if not isinstance(self.specbench_answers, str) or (
            self.specbench_answers and not self.specbench_answers.strip()
        ):
            raise ConfigError("--specbench-answers", self.specbench_answers, "a directory path, or '' (off)")
        specs = parse_methods(self.methods, self.raw)
        labels = {s.label for s in specs}
        normalized = tuple((method, preset_overrides(method, given)) for method, given in self.preset_args)
        object.__setattr__(self, "preset_args", normalized)  # flags read once, into typed overrides
        for method, _ in self.preset_args:
            spec = next((s for s in specs if s.label == method), None)
            if spec is None or spec.kind != "preset":
                raise ConfigError(
                    "--preset-args", method, f"a preset among --methods ({', '.join(sorted(labels))})"
                )

    @classmethod
    def from_overrides(cls, **overrides: Any) -> BenchConfig:
        """A config from flat overrides, as the command line gives them: `BenchConfig` fields by
        name, everything else a `RunConfig` override (``max_new_tokens``, ``data``, ...; see
        `RunConfig.from_preset`) applied to ``run`` (given, or the defaults). String values are
        parsed with the field's type (``repeats="3"``, ``methods="vanilla,swift"``).

        Raises:
            ConfigError: a bad value; the message names the flag (``--repeats``).
        """
        own = {f.name for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in own:
                rest[key] = value
            elif isinstance(value, str) and key != "run":
                kwargs[key] = parse_value(value, hints[key], flag_of(cls, key))
            else:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
        run = kwargs.pop("run", None)
        run = run.replace(**rest) if run is not None else RunConfig.from_preset(None, **rest)
        return cls(run=run, **kwargs)

    @property
    def method_specs(self) -> list[MethodSpec]:
        """The resolved methods, vanilla first when it was not named (and the ``--raw`` companions)."""
        return parse_methods(self.methods, self.raw)

    def method_run_config(
        self, method: MethodConfig, overrides: Mapping[str, Any] | None = None
    ) -> RunConfig:
        """The `RunConfig` one method decodes with: ``run``'s sections with ``method`` swapped in,
        then ``overrides`` (typed, dotted: `RunConfig.replace`)."""
        cfg = dataclasses.replace(self.run, method=method)
        return cfg.replace(**overrides) if overrides else cfg

    def shared(self) -> dict[str, Any]:
        """What every method takes from ``run``, flat as `RunConfig.describe` names it: the
        `SHARED_SECTIONS` and `RUNNER_FIELDS`."""
        keys = {k for k, (section, name) in FLAT_KEYS.items() if section in SHARED_SECTIONS}
        keys |= {
            k for k, (section, name) in FLAT_KEYS.items() if section == "runner" and name in RUNNER_FIELDS
        }
        return {k: v for k, v in self.run.describe().items() if k in keys}

    def replace(self, **changes: Any) -> BenchConfig:
        """A copy with ``changes`` (BenchConfig fields), validated again."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready view (``meta.json``): the benchmark's fields, the shared run options flat."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "run"}
        d.update(self.shared())
        d["methods"] = [s.label for s in self.method_specs]
        d["preset_args"] = [[m, dict(o)] for m, o in self.preset_args]
        return d


def preset_run_config(spec: MethodSpec, cfg: BenchConfig) -> RunConfig:
    """The `RunConfig` of a preset method: the benchmark's shared sections with the preset's method
    section (`BenchConfig.method_run_config`), the gate off for a ``--raw`` companion,
    ``--skip-set`` when the preset's selector takes one, then the method's ``--preset-args``
    overrides; named after the method.

    Raises:
        ConfigError: a bad ``--preset-args`` value, or a preset whose verifier samples.
    """
    method = dataclasses.replace(method_section(spec.source), name=spec.label)
    if spec.raw:
        method = dataclasses.replace(method, gate=dataclasses.replace(method.gate, enabled=False))
    overrides: dict[str, Any] = {}
    selector_cfg = method.selector.config
    if (
        cfg.skip_set
        and selector_cfg is not None
        and "skip_set" in {f.name for f in dataclasses.fields(selector_cfg)}
    ):
        overrides["selector.skip_set"] = cfg.skip_set
    for label, given in cfg.preset_args:  # a raw companion takes its method's overrides too
        if label == spec.label or (spec.raw and label + RAW_SUFFIX == spec.label):
            overrides.update(given)
    run_cfg = cfg.method_run_config(method, overrides)
    verifier = REGISTRIES["verifier"].get(run_cfg.method.verifier.name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.label if isinstance(spec.source, MethodConfig) else spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {run_cfg.method.verifier.name!r} samples)",
        )
    return run_cfg


__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "RUNNER_FIELDS",
    "SHARED_SECTIONS",
    "BenchConfig",
    "MethodSpec",
    "allowed_methods",
    "parse_methods",
    "preset_run_config",
]
