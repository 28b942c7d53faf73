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
from pathlib import Path
from typing import Any

from framework.config_fields import ConfigError
from framework.interfaces import REGISTRIES
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.overrides import build, preset_draft
from framework.session.presets import list_presets, load_preset
from framework.session.sections import (
    BASELINE,
    DEFAULT_METHODS,
    HF_METHODS,
    RAW_SUFFIX,
    CompareConfig,
    MethodConfig,
    MethodSpec,
)


def method_section(source: Any) -> MethodConfig:
    """The method section of a preset name or YAML file (a `MethodConfig` is itself)."""
    if isinstance(source, MethodConfig):
        return source
    return build(preset_draft(source))["method"]


def allowed_methods() -> list[str]:
    """Every method name `parse_methods` accepts (besides preset YAML files)."""
    return [BASELINE, *HF_METHODS, *(p for p in list_presets() if p != BASELINE)]


def _one(raw: Any, shipped: set[str]) -> MethodSpec | None:
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
        if not method_section(base).gate.enabled:
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
    shipped = set(list_presets())
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
            if method_section(spec.source).gate.enabled:
                out.append(MethodSpec(companion, "preset", spec.source, raw=True))
    if not any(s.kind == "baseline" for s in out):
        out.insert(0, MethodSpec(BASELINE, "baseline"))
    if len(out) < 2:
        raise ConfigError("--methods", ",".join(map(str, methods)), "at least one method besides vanilla")
    return out


def preset_overrides(method: str, given: str | Mapping[str, Any], run_cls: type) -> dict[str, Any]:
    """One ``--preset-args`` entry as overrides: a mapping as it is, or run.py flags
    (``"--selector.skip_ratio 0.3"``, flags of ``run_cls``, `RunConfig`) read into
    ``{"selector.skip_ratio": "0.3"}``.

    Raises:
        ConfigError: a flag ``run.py`` does not have, a flag without its value, or neither a
            mapping nor a string.
    """
    where = f"--preset-args {method}"
    if isinstance(given, Mapping):
        return dict(given)
    if not isinstance(given, str):
        raise ConfigError(where, given, "run.py flags (a string) or a mapping of RunConfig overrides")
    parser = argparse.ArgumentParser(prog="--preset-args", add_help=False, exit_on_error=False)
    add_config_flags(parser, run_cls, exclude=("output", "name", "compare"))
    try:
        args, unknown = parser.parse_known_args(shlex.split(given))
    except (argparse.ArgumentError, ValueError) as err:
        raise ConfigError(where, given, f"valid run.py flags ({err})") from None
    if unknown:
        raise ConfigError(where, " ".join(unknown), "run.py flags (see run.py --help)")
    return config_overrides_from_args(args)


def checked(compare: CompareConfig, run_cls: type) -> CompareConfig:
    """``compare`` with its methods resolved (`parse_methods`) and its ``--preset-args`` read into
    overrides (``run_cls``: `RunConfig`, whose flags they are).

    Raises:
        ConfigError: an unknown method (the message lists the allowed ones), a bad ``--preset-args``
            entry, one for a method that is not a preset among ``methods``, or a preset whose
            verifier samples.
    """
    if not compare.methods:
        return compare
    found = parse_methods(compare.methods, compare.raw)
    pairs = tuple((str(m), preset_overrides(str(m), given, run_cls)) for m, given in compare.preset_args)
    presets = {s.label for s in found if s.kind == "preset"}
    for method, _ in pairs:
        if method not in presets:
            raise ConfigError(
                "--preset-args", method, f"a preset among --methods ({', '.join(sorted(presets))})"
            )
    given = dict(pairs)
    for s in found:  # before any model loads or any method prepares (`preset_run_config` checks again)
        if s.kind == "preset":
            base = s.label.removesuffix(RAW_SUFFIX) if s.raw else s.label
            overrides = {**given.get(base, {}), **given.get(s.label, {})}
            _require_greedy(s, overrides.get("verifier", method_section(s.source).verifier.name))
    return dataclasses.replace(compare, preset_args=pairs)


def specs(run: Any) -> list[MethodSpec]:
    """The methods of ``run`` (a `RunConfig`): vanilla first, then ``compare.methods`` (with their
    ``--raw`` companions), or ``run``'s method section when ``compare.methods`` is empty (none for
    the ``vanilla`` preset)."""
    if run.compare.methods:
        return parse_methods(run.compare.methods, run.compare.raw)
    method = [] if run.method.baseline_only else [MethodSpec(run.method.label, "preset", run.method)]
    return [MethodSpec(BASELINE, "baseline"), *method]


def preset_run_config(spec: MethodSpec, run: Any) -> Any:
    """The `RunConfig` a preset method decodes with: ``run`` (a `RunConfig`) with the method's own section (named
    after the method; the gate off for a ``:raw`` companion), ``compare.skip_set`` where its
    selector takes one, then its ``--preset-args``.

    Raises:
        ConfigError: a bad ``--preset-args`` value, or (comparing several methods) a preset whose
            verifier samples.
    """
    cmp = run.compare
    if not cmp.methods:
        return run
    method = dataclasses.replace(method_section(spec.source), name=spec.label)
    if cmp.synthetic is not None:  # bench.py --synthetic-acceptance: every preset at one acceptance
        method = dataclasses.replace(method, synthetic_acceptance=cmp.synthetic)
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
    _require_greedy(spec, out.method.verifier.name)
    return out


def _require_greedy(spec: MethodSpec, verifier_name: Any) -> None:
    """A compared method must verify greedily: the comparison checks each method's tokens against
    vanilla greedy decoding (a name the registry does not know is left to the full check)."""
    if not isinstance(verifier_name, str) or verifier_name not in REGISTRIES["verifier"]:
        return
    verifier = REGISTRIES["verifier"].get(verifier_name)
    if getattr(verifier, "lossless", "greedy") != "greedy":
        raise ConfigError(
            "--methods",
            spec.label if not isinstance(spec.source, str) else spec.source,
            f"a greedy preset (the benchmark is greedy; its verifier {verifier_name!r} samples)",
        )


__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "HF_METHODS",
    "RAW_SUFFIX",
    "CompareConfig",
    "MethodSpec",
    "allowed_methods",
    "checked",
    "method_section",
    "parse_methods",
    "preset_overrides",
    "preset_run_config",
    "specs",
]
