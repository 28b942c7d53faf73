"""Presets: published methods as named bundles of the four strategies and their hyper-parameters.

A preset is a YAML file in ``framework/session/assets/presets/`` (or any path)::

    description: SWIFT (Xia et al., ICLR 2025): ...
    selector: {name: swift, skip_ratio: 0.45}
    length: {name: confidence, threshold: 0.8, max_length: 25}
    drafter: {name: layer_skip}
    verifier: {name: tree}

``--method swift`` selects it; every flag still overrides it (``--length.threshold 0.7`` changes
one field; ``--length fixed`` replaces the strategy and drops the preset's fields for it). A
preset may instead say ``baseline_only: true`` (the vanilla baseline alone), and may turn on the
draft gate with a top-level ``gate: {enabled: true}`` (fields of
``framework.drafting.gate.GateConfig``). A preset naming a strategy that is not registered fails
with a message naming the missing strategy.

``framework.session.run_config.RunConfig.from_preset`` turns a preset into a run configuration.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from framework.config_fields import ConfigError
from framework.interfaces import REGISTRIES

PRESET_DIR = Path(__file__).resolve().parent / "assets" / "presets"
#: A preset's keys; ``name`` (the method's label, default: the file's stem) as a saved
#: configuration's method section carries it.
_KEYS = {"name", "description", "baseline_only", "gate", *REGISTRIES}


class MissingStrategyError(ConfigError):
    """A preset names a strategy that is not registered (not implemented yet, or not imported)."""

    def __init__(self, preset: str, kind: str, name: str, registered: list[str]) -> None:
        self.kind, self.strategy = kind, name
        close = difflib.get_close_matches(str(name), registered, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        ValueError.__init__(
            self,
            f"--method {preset}: the preset needs {kind} {name!r}, which is not registered.{hint} "
            f"(registered {kind}s: {', '.join(registered)}; a strategy not implemented yet is not there, and "
            "out-of-tree strategies load with --import)",
        )
        self.field, self.value, self.allowed = "--method", preset, f"a preset whose {kind} is registered"


def list_presets() -> list[str]:
    """Names of the shipped presets (``framework/session/assets/presets/*.yaml``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """Resolve a preset name (``swift``) or a YAML path.

    Raises:
        ConfigError: neither a shipped preset nor an existing file.
    """
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    shipped = PRESET_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    close = difflib.get_close_matches(str(name_or_path), list_presets(), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else ""
    raise ConfigError(
        "--method", name_or_path, f"a preset ({', '.join(list_presets())}) or a YAML file", hint
    )


def yaml_problem(err: Exception) -> str:
    """A YAML parser error in one line: what is wrong and where (``found ':' at line 3, column
    9``), not PyYAML's several lines with a copy of the text."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(err).split())


def load_preset(name_or_path: str) -> dict[str, Any]:
    """Read and check a preset: ``{"name", "description", "baseline_only", kind: {"name", **fields},
    "gate": {**fields}}`` (kinds and ``gate`` only where the file has them).

    Strategy names are checked against the registries here; field values are validated later by
    the strategy's config dataclass (with the CLI flag in the message).

    Raises:
        ConfigError: unreadable or malformed YAML, an empty file, unknown keys, or a strategy that is
            not registered.
    """
    import yaml

    path = preset_path(name_or_path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError("--method", str(path), f"valid YAML ({yaml_problem(err)})") from None
    if not data:  # an empty file would silently run the defaults (issue 48, item 8)
        raise ConfigError(
            "--method",
            str(path),
            "a preset that says something (the file is empty: write `baseline_only: true` "
            "for plain decoding, or the strategies it runs)",
        )
    if not isinstance(data, dict):
        raise ConfigError(
            "--method", str(path), "a YAML mapping of description / selector / length / drafter / verifier"
        )
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"--method {path.name}", unknown, f"keys among {', '.join(sorted(_KEYS))}")
    label = data.get("name", path.stem)
    if not isinstance(label, str) or not label.strip():
        raise ConfigError(f"--method {path.name}: name", label, "a method's name (a non-empty string)")
    out: dict[str, Any] = {
        "name": label.strip(),
        "description": str(data.get("description", "")).strip(),
        "baseline_only": bool(data.get("baseline_only", False)),
    }
    for kind, reg in REGISTRIES.items():
        spec = data.get(kind)
        if spec is None:
            continue
        if isinstance(spec, str):
            spec = {"name": spec}
        if not isinstance(spec, dict) or "name" not in spec:
            raise ConfigError(f"--method {path.name}: {kind}", spec, "a mapping with a 'name' key")
        name = spec["name"]
        if name not in reg:
            raise MissingStrategyError(path.stem, kind, name, reg.names())
        out[kind] = dict(spec)
    gate = data.get("gate")
    if gate is not None:
        if not isinstance(gate, dict):
            raise ConfigError(f"--method {path.name}: gate", gate, "a mapping of GateConfig fields")
        out["gate"] = dict(gate)
    return out
