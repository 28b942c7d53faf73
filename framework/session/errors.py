"""Bad input and exit statuses of the command-line tools (``run.py``, ``bench.py``, sweeps).

`USER_ERRORS` are the exceptions that mean bad input (a message naming the flag, the value and
what is allowed), never a bug; `guarded` turns them into one ``error:`` line and exit status 2,
and Ctrl-C into status 130. This module is light (no Lightning, no plotting), so that every
tool's command line can import it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from framework.config_fields import ConfigError
from framework.data.prompts import DataError
from framework.models.loading import ModelLoadError
from framework.registry import UnknownNameError
from framework.utils import FrameworkWarning, MissingDependencyError

USER_ERRORS = (ConfigError, UnknownNameError, DataError, ModelLoadError, MissingDependencyError)


#: Where this project's own code lives: frames outside it (and outside the Python installation)
#: are the user's (a strategy of their own, an ``--import`` module, a model's code).
_PROJECT = Path(__file__).resolve().parents[2]
_OWN = tuple(str(_PROJECT / d) + os.sep for d in ("framework", "strategies", "selfspec", "experiments"))
_LIBS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def guarded(
    body: Callable[[], int],
    interrupted: str | Callable[[], str],
    errors: tuple[type[BaseException], ...] = (),
    *,
    resume: Callable[[], str | None] | None = None,
    debug: bool | None = None,
) -> int:
    """Run a command's ``body`` and turn its failures into exit statuses.

    - Bad input (``USER_ERRORS``, ``errors``, and a ValueError raised by this project's own
      validation, such as ``--device cuda`` without CUDA): one ``error:`` line, status 2.
    - Any other exception, and a ValueError raised in the user's own code (a strategy of their own,
      an ``--import`` module, a model's code): a bug report, status 1: the exception, the
      traceback trimmed to the user's frames (file, line, code), and ``resume()``'s hint (the
      ``--resume`` command) when results exist.
    - Ctrl-C: ``interrupted: <interrupted>`` (a string, or a function that says what was kept),
      status 130.

    ``debug`` (default: ``SELFSPEC_DEBUG=1``; the CLIs' ``--debug``) re-raises instead, with the
    whole traceback.
    """
    debug = os.environ.get("SELFSPEC_DEBUG", "") not in ("", "0") if debug is None else debug
    try:
        with one_line_warnings():
            return body()
    except (*USER_ERRORS, *errors) as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        said = interrupted() if callable(interrupted) else interrupted
        print(f"\ninterrupted: {said}", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - every failure gets an exit status and a message
        if debug:
            raise
        frames = user_frames(err)
        if isinstance(err, ValueError) and not frames:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(bug_report(err, frames), file=sys.stderr)
        hint = resume() if resume is not None else None
        if hint:
            print(hint, file=sys.stderr)
        return 1


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """A `framework.utils.FrameworkWarning` raised inside prints as one ``warning:`` line on
    stderr, once per message; other warnings as Python prints them."""
    shown = warnings.showwarning
    said: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if isinstance(category, type) and issubclass(category, FrameworkWarning):
            text = str(message)
            if text not in said:
                said.add(text)
                print(f"warning: {text}", file=sys.stderr)
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def is_user_file(filename: str) -> bool:
    """Whether ``filename`` is the user's code: not this project's packages, not the Python
    installation (the standard library, installed packages), not ``<frozen ...>``."""
    path = os.path.abspath(filename)
    return not filename.startswith("<") and not path.startswith(_OWN) and not path.startswith(_LIBS)


def user_frames(err: BaseException) -> list[traceback.FrameSummary]:
    """The frames of ``err``'s traceback (and of the exceptions it was raised from) in the user's
    code, outermost first; a SyntaxError in a user's file counts as a frame at its line."""
    out: list[traceback.FrameSummary] = []
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out = [f for f in traceback.extract_tb(e.__traceback__) if is_user_file(f.filename)] + out
        if isinstance(e, SyntaxError) and e.filename and is_user_file(e.filename):
            out.append(traceback.FrameSummary(e.filename, e.lineno or 0, "<module>", line=e.text or ""))
        e = e.__cause__ or e.__context__
    return out


def bug_report(err: BaseException, frames: list[traceback.FrameSummary]) -> str:
    """The message of an exception that is not bad input: what was raised and where, in the
    user's frames (the last frames of the whole traceback when none is the user's)."""
    lines = [f"error: {type(err).__name__}: {err}".rstrip(": ")]
    shown = frames or traceback.extract_tb(err.__traceback__)[-3:]
    lines.append("raised in your code:" if frames else "raised in (no frame of your own code; a bug here?):")
    for f in shown:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
        if f.line:
            lines.append(f"    {f.line.strip()}")
    lines.append("(--debug or SELFSPEC_DEBUG=1 shows the whole traceback)")
    return "\n".join(lines)


def pop_debug(argv: list[str]) -> bool:
    """Remove ``--debug`` from ``argv`` (every CLI accepts it); whether it was there."""
    found = "--debug" in argv
    while "--debug" in argv:
        argv.remove("--debug")
    return found


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown flag, a missing value, two flags that exclude
    each other) are one ``error:`` line and status 2, not the whole usage first."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):  # a typo: the closest flags
            flags = sorted(self._option_string_actions)
            close = [
                match
                for word in message.split(":", 1)[1].split()
                if word.startswith("--")
                for match in difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.75)
            ]
            if close:
                message += f"; did you mean {' / '.join(close)}?"
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")
