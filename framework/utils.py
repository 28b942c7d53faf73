"""Small shared helpers: optional-dependency imports with install hints."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingDependencyError(ModuleNotFoundError):
    """An optional dependency is not installed; the message has the install command."""


def require(module: str, package: str | None = None, extra: str | None = None) -> ModuleType:
    """Import ``module`` or fail with the exact command that installs it.

    Args:
        module: the import name (``"botorch"``).
        package: the PyPI name if it differs.
        extra: this project's extra that brings it (``"experiments"``).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and err.name.split(".")[0] != module.split(".")[0]:
            raise
        hint = f"pip install {package or module}"
        if extra:
            hint += f"   (or: pip install -e '.[{extra}]')"
        raise MissingDependencyError(
            f"{module} is required for this feature but is not installed: {hint}"
        ) from None
