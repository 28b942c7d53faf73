"""The packages a configuration needs beyond the engine's, checked before any model loads.

Every package named here is a base dependency; an environment installed before it became one, or
pruned by hand, may still lack it. A run that needs it then stops at the configuration check, with
one line and the command that installs it, instead of failing late (after the model loaded, in a
traceback). What needs what:

- a grammar (``--json-schema``, ``--regex``, ``--grammar``; a prompt's own ``json_schema``): llguidance;
- a strategy's `framework.interfaces.Strategy.requires` (``selfsd_bo`` and ``swift``: botorch and
  gpytorch);
- ``--plots``: matplotlib; ``--logger wandb``: wandb.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from typing import Any

from framework.config_fields import ConfigError
from framework.engine.grammar import INSTALL as GRAMMAR_INSTALL
from framework.interfaces import REGISTRIES

#: What installs a package, by import name (the PyPI name where it differs).
INSTALLS = {"llguidance": GRAMMAR_INSTALL}


def installed(module: str) -> bool:
    """``module`` can be imported (found without importing it)."""
    return importlib.util.find_spec(module) is not None


def needed(
    cfg: Any, methods: Iterable[Any] = (), prompts: Iterable[Any] = ()
) -> Iterator[tuple[str, Any, str]]:
    """``(flag, value, module)`` for every package the run needs: ``cfg`` (a `RunConfig`), the
    method sections of its other methods (``methods``: a benchmark's) and its ``prompts``."""
    for section in (cfg.method, *methods):
        for kind in REGISTRIES:
            name = getattr(section, kind).name
            if name in REGISTRIES[kind]:
                for module in getattr(REGISTRIES[kind].get(name), "requires", ()):
                    yield f"--{kind}", name, module
    gen = cfg.generation
    for field in ("json_schema", "regex", "grammar"):
        if getattr(gen, field) is not None:
            yield "--" + field.replace("_", "-"), getattr(gen, field), "llguidance"
    if any(getattr(p, "json_schema", None) for p in prompts):
        yield "--data", cfg.data.path or "the built-in suite", "llguidance"
    if cfg.runner.plots:
        yield "--plots", True, "matplotlib"
    if cfg.runner.logger == "wandb":
        yield "--logger", "wandb", "wandb"


def check_dependencies(cfg: Any, methods: Iterable[Any] = (), prompts: Iterable[Any] = ()) -> None:
    """Raise a `ConfigError` naming the flag and the install command of the first package the run
    needs (`needed`) that is not installed."""
    for flag, value, module in needed(cfg, methods, prompts):
        if not installed(module):
            how = INSTALLS.get(
                module, f"pip install {module} (a base dependency: pip install -e . installs it)"
            )
            raise ConfigError(flag, value, f"used with {module} installed", how)


__all__ = ["INSTALLS", "check_dependencies", "installed", "needed"]
