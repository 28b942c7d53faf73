"""What a run cannot do as configured, said up front and kept in its metadata (issue 29).

Two kinds of note:

- a strategy's own (`framework.interfaces.Strategy.run_notes`): SWIFT's search never starts when a
  turn is shorter than its context window, for one;
- where the run stands to the papers: a run named after a paper preset whose settings were
  overridden, and a run that uses a paper's selector (``--selector clasp_dp``) as a building block
  with this framework's defaults, each with the settings in which it differs from the method as
  published (`PAPER_PRESETS`).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from framework.interfaces import REGISTRIES
from framework.session.presets import load_preset
from framework.session.run_config import MethodConfig, RunConfig

#: The presets that run a seed paper's method as published (no draft gate, no work cap, the full
#: LM head, the model's own weights); their ``_safe`` variants add this framework's parts.
PAPER_PRESETS = (
    "selfsd",
    "selfsd_sampling",
    "swift",
    "clasp",
    "del",
    "layerskip_static",
    "layerskip_fs",
    "layerskip_dv",
)
#: Selectors shared by many methods: using them says nothing about a paper.
_GENERIC_SELECTORS = frozenset({"static"})


def run_notes(cfg: RunConfig, strategies: dict[str, Any]) -> list[str]:
    """Every note of a run of ``cfg`` decoded by ``strategies`` (kind -> instance)."""
    notes = [n for s in strategies.values() for n in s.run_notes(cfg.generation.max_new_tokens)]
    return notes + published_notes(cfg.method)


@cache
def _published(preset: str) -> MethodConfig:
    return RunConfig.from_preset(preset).method


def paper_name(preset: str) -> str:
    """The paper a preset runs, from its description (``"CLaSp (Chen et al., 2025)"``)."""
    return load_preset(preset)["description"].split(" - ")[0].strip()


def differences(method: MethodConfig, published: MethodConfig) -> list[str]:
    """``kind.field value (published: value)`` for every strategy setting and gate field in which
    ``method`` differs from ``published``; a different strategy is one entry."""
    out = []
    for kind in REGISTRIES:
        a, b = getattr(method, kind), getattr(published, kind)
        if a.name != b.name:
            out.append(f"--{kind} {a.name} (published: {b.name})")
            continue
        for f in dataclasses.fields(a.config):
            va, vb = getattr(a.config, f.name), getattr(b.config, f.name)
            if va != vb:
                out.append(f"--{kind}.{f.name} {va!r} (published: {vb!r})")
    for f in dataclasses.fields(method.gate):
        va, vb = getattr(method.gate, f.name), getattr(published.gate, f.name)
        if va != vb:
            out.append(f"--gate.{f.name} {va!r} (published: {vb!r})")
    return out


def published_notes(method: MethodConfig) -> list[str]:
    """How a run stands to the paper presets: overridden, or a paper's selector as a building block."""
    if method.baseline_only:
        return []
    if method.name in PAPER_PRESETS:
        diff = differences(method, _published(method.name))
        if not diff:
            return []
        return [
            f"{method.name} is not {paper_name(method.name)} as published in this run: it differs from "
            f"the preset in {'; '.join(diff)}"
        ]
    sel = method.selector.name
    if sel in _GENERIC_SELECTORS:
        return []
    for preset in PAPER_PRESETS:
        if _published(preset).selector.name == sel:
            diff = differences(method, _published(preset))
            if not diff:
                return []
            return [
                f"--selector {sel} is a building block with this framework's defaults, not "
                f"{paper_name(preset)} as published (that is --method {preset}); this run differs "
                f"from it in {'; '.join(diff)}"
            ]
    return []


def published_by(kind: str) -> dict[str, str]:
    """``{strategy name: its paper preset}`` for the strategies of ``kind`` that exactly one seed
    paper's presets name (``swift``, ``clasp_dp``, ``del_dynamic``, ``tree``, ...): building blocks
    whose defaults are this framework's, with the preset that runs them as the paper did. Shared
    ones (``static``, ``confidence``, ``greedy``) are nobody's in particular."""
    papers: dict[str, dict[str, str]] = {}  # strategy -> {paper: its first preset}
    for preset in PAPER_PRESETS:
        name = getattr(_published(preset), kind).name
        papers.setdefault(name, {}).setdefault(paper_name(preset).split(" (")[0].split(" with ")[0], preset)
    return {
        name: next(iter(by.values()))
        for name, by in papers.items()
        if len(by) == 1 and name not in _GENERIC_SELECTORS
    }
