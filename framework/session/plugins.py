"""User modules that register their own strategies (``--import``).

The built-in strategies need no loading call: the registries import the shipped ``strategies``
package on their first lookup (`framework.interfaces.BUILTIN_STRATEGIES`).
"""

from __future__ import annotations

import hashlib
import importlib
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from framework.config_fields import ConfigError
from framework.utils import FrameworkWarning


def import_user_modules(modules: Iterable[str], flag: str = "--import") -> None:
    """Import out-of-tree modules that register their own strategies.

    Raises:
        ConfigError: a module that is not there (named with ``flag``). An exception raised while
            the module runs propagates: a bug in it, which the CLIs report with its file and line.
    """
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as err:
            if err.name is None or not (mod == err.name or mod.startswith(err.name + ".")):
                raise  # the module exists and failed inside: a bug report with its file and line
            raise ConfigError(flag, mod, f"an importable module ({err})") from None


def source_hash(module: str) -> str | None:
    """The first 16 hex digits of the sha256 of an imported module's source file (``None`` when it
    has no file)."""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if not path:
        return None
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def recorded_imports(modules: Iterable[str]) -> list[dict[str, Any]]:
    """What a saved configuration and a run's metadata record of each ``--import`` module: its
    name and the hash of its source (`source_hash`)."""
    return [{"module": m, "sha256": source_hash(m)} for m in modules]


class SourceChangedWarning(FrameworkWarning):
    """An ``--import`` module's source differs from the one a saved configuration recorded."""


#: ``(module, sha256 then, sha256 now)`` already warned about in this process.
_WARNED: set[tuple[str, str, str]] = set()


def import_recorded(entries: Any, flag: str = "--import") -> tuple[str, ...]:
    """Import the ``--import`` modules of a configuration (names, or `recorded_imports` records as
    a saved configuration holds them) and return their names. A module whose source changed since
    its hash was recorded is imported with a warning naming it.

    Raises:
        ConfigError: a module that cannot be found: one line naming the ``--import`` to pass (and
            that its folder must be importable).
    """
    if isinstance(entries, (str, Mapping)):
        entries = [entries]
    names: list[str] = []
    for entry in entries or ():
        name = entry.get("module") if isinstance(entry, Mapping) else entry
        if not isinstance(name, str) or not name:
            raise ConfigError(
                flag, entry, "a module name (or {module, sha256} as a saved configuration holds it)"
            )
        try:
            import_user_modules([name], flag)
        except ConfigError:
            raise ConfigError(
                flag,
                name,
                f"an importable module: the configuration registers strategies from it; put the folder that "
                f"holds it on PYTHONPATH and pass --import {name}",
            ) from None
        want = entry.get("sha256") if isinstance(entry, Mapping) else None
        have = source_hash(name)
        if want and have and want != have and (name, want, have) not in _WARNED:
            _WARNED.add((name, want, have))  # once: a command reads its configuration twice
            warnings.warn(
                SourceChangedWarning(
                    f"--import {name}: its source changed since the configuration was saved "
                    f"(sha256 {want} then, {have} now); the run may not repeat"
                ),
                stacklevel=2,
            )
        names.append(name)
    return tuple(names)
