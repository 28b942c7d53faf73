"""User modules that register their own strategies (``--import``).

The built-in strategies need no loading call: the registries import the shipped ``strategies``
package on their first lookup (`framework.interfaces.BUILTIN_STRATEGIES`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from framework.config_fields import ConfigError


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
