"""User modules that register their own strategies (``--import``).

The built-in strategies need no loading call: the registries import the shipped ``strategies``
package on their first lookup (`framework.interfaces.BUILTIN_STRATEGIES`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from framework.config import ConfigError


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
