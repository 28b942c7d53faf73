"""The composition root: the one place that loads the built-in strategies (and user modules).

The API and the engine know strategies only through the registries in `framework.interfaces`;
tooling (the CLI, the Python API, the benchmark, sweeps, tests) calls `load_builtin_strategies`
before it looks a name up.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from framework.config import ConfigError


def load_builtin_strategies() -> None:
    """Import the shipped `strategies` package so that every built-in strategy registers itself
    (idempotent: Python imports a module once)."""
    importlib.import_module("strategies")


def import_user_modules(modules: Iterable[str], flag: str = "--import") -> None:
    """Import out-of-tree modules that register their own strategies.

    Raises:
        ConfigError: a module that cannot be imported (named with ``flag``).
    """
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as err:
            raise ConfigError(flag, mod, f"an importable module ({err})") from None
