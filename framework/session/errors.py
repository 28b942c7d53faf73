"""Bad input and exit statuses of the command-line tools (``run.py``, ``bench.py``, sweeps).

`USER_ERRORS` are the exceptions that mean bad input (a message naming the flag, the value and
what is allowed), never a bug; `guarded` turns them into one ``error:`` line and exit status 2,
and Ctrl-C into status 130. This module is light (no Lightning, no plotting), so that every
tool's command line can import it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from framework.config import ConfigError
from framework.data.prompts import DataError
from framework.models.loading import ModelLoadError
from framework.registry import UnknownNameError
from framework.utils import MissingDependencyError

USER_ERRORS = (ConfigError, UnknownNameError, DataError, ModelLoadError, MissingDependencyError)


def guarded(body: Callable[[], int], interrupted: str, errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run a command's ``body`` and turn its failures into exit statuses: bad input (``USER_ERRORS``,
    ``errors``, and ValueError such as ``--device cuda`` without CUDA) prints one ``error:`` line and
    returns 2; Ctrl-C prints ``interrupted: <interrupted>`` and returns 130."""
    try:
        return body()
    except (*USER_ERRORS, *errors, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {interrupted}", file=sys.stderr)
        return 130
