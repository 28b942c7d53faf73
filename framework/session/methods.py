"""The methods one run compares: `CompareConfig` (``RunConfig.compare``) and how its names resolve.

A run decodes every prompt with each of its methods in rotated order. With ``compare.methods``
empty (``run.py``) the methods are the vanilla baseline and ``RunConfig.method``; ``bench.py`` names
them: ``vanilla`` (our autoregressive baseline, always run), a Hugging Face ``generate`` method
(`HF_METHODS`), a shipped preset, ``<preset>:raw`` (a gated preset with its gate off) or a preset
YAML file (`parse_methods`). Each preset method decodes with the run's model, data, generation and
runner sections and its own method section (`preset_run_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from framework.config_fields import ConfigError, check_range, param

if TYPE_CHECKING:
    from framework.session.run_config import MethodConfig, RunConfig

BASELINE = "vanilla"
#: The Hugging Face ``generate`` methods and what they run (`framework.benchmark.hf`).
HF_METHODS: dict[str, str] = {
    "hf_generate": "transformers model.generate, greedy",
    "hf_prompt_lookup": "model.generate with prompt_lookup_num_tokens (prompt lookup decoding)",
    "hf_early_exit": "model.generate with assistant_early_exit (the first E layers draft)",
}
#: What ``bench.py`` shows (README command 1): this framework's default layer-skip method with its
#: draft gate, the same with the gate off, and the hybrid drafter.
DEFAULT_METHODS = ("vanilla", "static_confidence", "static_confidence:raw", "hybrid")
#: The label suffix of a preset's gate-off companion (``--raw``).
RAW_SUFFIX = ":raw"


@dataclass(frozen=True)
class MethodSpec:
    """A method of a run: ``kind`` is ``baseline``, ``hf``, ``preset`` or ``custom``; ``source``
    the preset name or YAML path, or a method section (a `MethodConfig` given in Python); ``raw``:
    the gate-off companion of a gated preset."""

    label: str
    kind: str
    source: Any = ""
    raw: bool = False


def _presets() -> list[str]:
    from framework.session.presets import list_presets

    return list_presets()


def _method_section(source: Any) -> MethodConfig:
    from framework.session.run_config import MethodConfig, RunConfig

    return source if isinstance(source, MethodConfig) else RunConfig.from_preset(source).method


def allowed_methods() -> list[str]:
    """Every method name `parse_methods` accepts (besides preset YAML files)."""
    return [BASELINE, *HF_METHODS, *(p for p in _presets() if p != BASELINE)]


def _one(raw: Any, shipped: set[str]) -> MethodSpec | None:
    from framework.session.presets import load_preset
    from framework.session.run_config import MethodConfig

    if isinstance(raw, MethodConfig):  # a method section given in Python
        if raw.baseline_only or raw.label == BASELINE or raw.label in HF_METHODS:
            raise ConfigError("--methods", raw.label, "a method section with strategies and its own name")
        return MethodSpec(raw.label, "preset", raw)
    name = str(raw).strip()
    base = name[: -len(RAW_SUFFIX)] if name.endswith(RAW_SUFFIX) else None
    if not name:
        return None
    if name == BASELINE:
        return MethodSpec(BASELINE, "baseline")
    if name in HF_METHODS:
        return MethodSpec(name, "hf")
    if name in shipped:
        return MethodSpec(name, "preset", name)
    if base in shipped:
        if not _method_section(base).gate.enabled:
            raise ConfigError(
                "--methods", name, f"{base} without {RAW_SUFFIX}: its draft gate is already off"
            )
        return MethodSpec(name, "preset", base, raw=True)
    if Path(name).suffix in (".yaml", ".yml") and Path(name).is_file():
        label = Path(name).stem
        if label == BASELINE or label in HF_METHODS:
            raise ConfigError("--methods", name, f"a preset file whose name is not {label!r} (reserved)")
        if load_preset(name)["baseline_only"]:
            raise ConfigError("--methods", name, "a preset with strategies (vanilla is always run)")
        return MethodSpec(label, "preset", name)
    raise ConfigError(
        "--methods",
        name,
        f"a comma-separated list of {', '.join(allowed_methods())}, '<preset>{RAW_SUFFIX}' (a gated "
        "preset with its gate off), or preset YAML files",
    )


def parse_methods(methods: Sequence[Any], with_raw: bool = False) -> list[MethodSpec]:
    """Resolve method names, vanilla first when missing; with ``with_raw`` every gated preset is
    followed by its gate-off companion ``<label>:raw``.

    Raises:
        ConfigError: an unknown name (the message lists the allowed ones), a duplicate, a
            baseline-only preset file, or no method besides vanilla.
    """
    shipped = set(_presets())
    out: list[MethodSpec] = []
    for raw in methods:
        spec = _one(raw, shipped)
        if spec is None:
            continue
        if any(s.label == spec.label for s in out):
            raise ConfigError("--methods", spec.label, "each method once (two methods share the name)")
        out.append(spec)
        companion = spec.label + RAW_SUFFIX
        if with_raw and spec.kind == "preset" and not spec.raw and companion not in map(str, methods):
            if _method_section(spec.source).gate.enabled:
                out.append(MethodSpec(companion, "preset", spec.source, raw=True))
    if not any(s.kind == "baseline" for s in out):
        out.insert(0, MethodSpec(BASELINE, "baseline"))
    if len(out) < 2:
        raise ConfigError("--methods", ",".join(map(str, methods)), "at least one method besides vanilla")
    return out


def preset_overrides(method: str, given: str | Mapping[str, Any]) -> dict[str, Any]:
    """One ``--preset-args`` entry as overrides: a mapping as it is, or run.py flags
    (``"--selector.skip_ratio 0.3"``) read into ``{"selector.skip_ratio": "0.3"}``.

    Raises:
        ConfigError: a flag ``run.py`` does not have, a flag without its value, or neither a
            mapping nor a string.
    """
    from framework.session.flags import add_config_flags, config_overrides_from_args
    from framework.session.run_config import RunConfig

    where = f"--preset-args {method}"
    if isinstance(given, Mapping):
        return dict(given)
    if not isinstance(given, str):
        raise ConfigError(where, given, "run.py flags (a string) or a mapping of RunConfig overrides")
    parser = argparse.ArgumentParser(prog="--preset-args", add_help=False, exit_on_error=False)
    add_config_flags(parser, RunConfig, exclude=("output", "name", "compare"))
    try:
        args, unknown = parser.parse_known_args(shlex.split(given))
    except (argparse.ArgumentError, ValueError) as err:
        raise ConfigError(where, given, f"valid run.py flags ({err})") from None
    if unknown:
        raise ConfigError(where, " ".join(unknown), "run.py flags (see run.py --help)")
    return config_overrides_from_args(args)


@dataclass(frozen=True)
class CompareConfig:
    """The methods a run compares and what comparing them needs (``bench.py``'s options)."""

    methods: tuple[Any, ...] = param(
        (),
        help="comma-separated: vanilla, hf_generate, hf_prompt_lookup, hf_early_exit, any preset, a gated "
        "preset with ':raw' (its gate off), or preset YAML files; in Python also method sections "
        "(MethodConfig, named by their label); empty: vanilla and the method section (run.py)",
    )
    raw: bool = param(
        False,
        help="also run every preset whose draft gate is on with the gate off, as a '<method>:raw' row: "
        "the method's own alpha, M and speedup where the gate would decline",
    )
    repeats: int = param(1, help="repetitions of the whole interleaved run")
    preset_args: tuple[tuple[str, Any], ...] = param(
        (),
        help="(method, overrides) pairs: RunConfig overrides for one preset ({'selector.skip_ratio': 0.3}), "
        "or run.py flags, METHOD=FLAGS, e.g. 'swift=--selector.skip_ratio 0.3' (repeatable)",
    )
    skip_set: str | None = param(None, help="skip-set file for presets whose selector takes one (selfsd)")
    cost_model: str = param(
        "measure",
        help="'measure' (after the warm-up; saved as cost_model.json beside the results), 'none', or a "
        "CostModel / selfsd skip-set JSON file; prices each method's rounds in the report",
    )
    prompt_lookup_num_tokens: int = param(10, help="hf_prompt_lookup's candidate tokens per lookup")
    max_matching_ngram_size: int | None = param(None, help="hf_prompt_lookup's n-gram size (HF default 2)")
    early_exit_layer: int | None = param(None, help="hf_early_exit's layer E (default round(0.8 L))")
    hf_kernels: bool = param(
        False,
        help="run the HF methods with this framework's CPU kernels too (default: stock PyTorch, as users "
        "run them)",
    )
    command: str = param("", help="the command line, for the report")

    def __post_init__(self) -> None:
        check_range("--repeats", self.repeats, 1, integer=True)
        check_range("--prompt-lookup-num-tokens", self.prompt_lookup_num_tokens, 1, integer=True)
        for flag, val in (
            ("--max-matching-ngram-size", self.max_matching_ngram_size),
            ("--early-exit-layer", self.early_exit_layer),
        ):
            if val is not None:
                check_range(flag, val, 1, integer=True)
        for flag, val in (("--raw", self.raw), ("--hf-kernels", self.hf_kernels)):
            if not isinstance(val, bool):
                raise ConfigError(flag, val, "a boolean (true/false)")
        if not self.methods:
            if self.raw or self.preset_args:
                raise ConfigError("--raw" if self.raw else "--preset-args", True, "used with --methods")
            return
        specs = parse_methods(self.methods, self.raw)
        pairs = tuple((str(m), preset_overrides(str(m), given)) for m, given in self.preset_args)
        object.__setattr__(self, "preset_args", pairs)  # flags read once, into overrides
        presets = {s.label for s in specs if s.kind == "preset"}
        for method, _ in pairs:
            if method not in presets:
                raise ConfigError(
                    "--preset-args", method, f"a preset among --methods ({', '.join(sorted(presets))})"
                )

    def specs(self, run: RunConfig) -> list[MethodSpec]:
        """The run's methods: vanilla first, then ``methods`` (their ``--raw`` companions), or the
        method section of ``run`` when ``methods`` is empty (none for the ``vanilla`` preset)."""
        if self.methods:
            return parse_methods(self.methods, self.raw)
        method = [] if run.method.baseline_only else [MethodSpec(run.method.label, "preset", run.method)]
        return [MethodSpec(BASELINE, "baseline"), *method]


def preset_run_config(spec: MethodSpec, run: RunConfig) -> RunConfig:
    """The `RunConfig` a preset method decodes with: ``run`` with the method's own section (named
    after the method; the gate off for a ``:raw`` companion), ``compare.skip_set`` where its
    selector takes one, then its ``--preset-args``.

    Raises:
        ConfigError: a bad ``--preset-args`` value, or (comparing several methods) a preset whose
            verifier samples.
    """
    from framework.interfaces import REGISTRIES

    cmp = run.compare
    if not cmp.methods:
        return run
    method = dataclasses.replace(_method_section(spec.source), name=spec.label)
    if spec.raw:
        method = dataclasses.replace(method, gate=dataclasses.replace(method.gate, enabled=False))
    overrides: dict[str, Any] = {}
    fields = (
        {f.name for f in dataclasses.fields(method.selector.config or object)}
        if method.selector.config
        else set()
    )
    if cmp.skip_set and "skip_set" in fields:
        overrides["selector.skip_set"] = cmp.skip_set
    for label, given in cmp.preset_args:  # a raw companion takes its method's overrides too
        if label == spec.label or (spec.raw and label + RAW_SUFFIX == spec.label):
            overrides.update(given)
    out = dataclasses.replace(run, method=method)
    out = out.replace(**overrides) if overrides else out
    verifier = REGISTRIES["verifier"].get(out.method.verifier.name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.label if not isinstance(spec.source, str) else spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {out.method.verifier.name!r} samples)",
        )
    return out


__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "HF_METHODS",
    "RAW_SUFFIX",
    "CompareConfig",
    "MethodSpec",
    "allowed_methods",
    "parse_methods",
    "preset_overrides",
    "preset_run_config",
]
