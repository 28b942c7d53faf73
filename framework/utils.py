"""Small shared helpers: the user cache directory and optional-dependency imports with install hints."""

from __future__ import annotations

import importlib
import os
from pathlib import Path
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


def cache_dir() -> Path:
    """The project's cache directory: ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else
    ``~/.cache/selfspec`` (converted models, compiled kernels, token rankings)."""
    root = os.environ.get("SELFSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "selfspec"
    )
    return Path(root)
