"""Small shared helpers: the user cache directory, optional-dependency imports with install hints, and
aligned markdown tables."""

from __future__ import annotations

import importlib
import os
import re
import time
from pathlib import Path
from types import ModuleType


class MissingDependencyError(ModuleNotFoundError):
    """An optional dependency is not installed; the message has the install command."""


class FrameworkWarning(UserWarning):
    """A warning of this framework meant for the person running it (the command-line tools print
    it as one ``warning:`` line, once, instead of Python's file-and-line form)."""


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


_CELL_SEP = re.compile(r"(?<!\\)\|")


def align_markdown(table: str) -> str:
    """Pad the cells of a markdown table so that its columns line up in a terminal; a markdown
    renderer shows it exactly as before (the cells' text and the alignment row's colons are kept).

    Lines that are not table rows (not starting with ``|``) pass through unchanged; escaped pipes
    (``\\|``) stay inside their cell. Right-aligned columns (``---:``) are padded on the left.
    """
    lines = table.split("\n")
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    if len(rows) < 2:
        return table
    cells = {i: [c.strip() for c in _CELL_SEP.split(lines[i].strip())[1:-1]] for i in rows}
    ncol = max(len(c) for c in cells.values())
    sep = next((i for i in rows if all(re.fullmatch(r":?-+:?", c) for c in cells[i])), None)
    marks = [("", "")] * ncol  # (left colon, right colon) of each column's alignment cell
    if sep is not None:
        for j, c in enumerate(cells[sep]):
            marks[j] = (":" if c.startswith(":") else "", ":" if c.endswith(":") else "")
    right = [m == ("", ":") for m in marks]
    widths = [3] * ncol
    for i in rows:
        if i != sep:
            for j, c in enumerate(cells[i]):
                widths[j] = max(widths[j], len(c))
    for i in rows:
        row = cells[i] + [""] * (ncol - len(cells[i]))
        if i == sep:
            out = [m[0] + "-" * (widths[j] - len(m[0]) - len(m[1])) + m[1] for j, m in enumerate(marks)]
        else:
            out = [c.rjust(widths[j]) if right[j] else c.ljust(widths[j]) for j, c in enumerate(row)]
        lines[i] = "| " + " | ".join(out) + " |"
    return "\n".join(lines)


def device_sync(device: object) -> None:
    """Wait for the work queued on ``device`` (a `torch.device` or its name) before a clock is read:
    CUDA runs kernels asynchronously, so ``time.perf_counter()`` after a launch measures the launch,
    not the work. A no-op on CPU (and any synchronous device), where nothing is queued: CUDA is not
    touched there."""
    import torch

    dev = torch.device(device) if isinstance(device, str) else device
    if getattr(dev, "type", None) == "cuda":
        torch.cuda.synchronize(dev)


def no_clock() -> float:
    """The clock of an untimed section (a phase timer turned off): no reading, no device wait."""
    return 0.0


def upload(data: object, device: object, dtype: object = None):
    """``torch.tensor(data, dtype=dtype)`` on ``device`` without waiting for the device.

    ``torch.tensor(..., device="cuda")`` copies with ``non_blocking=False``, which makes the host
    wait until every kernel queued before the copy has run: a host-device synchronisation. Host
    data built from values already on the host (a tree's node tokens and positions, an accepted
    path) need no such wait: the copy is queued behind the kernels instead. On CPU this is
    ``torch.tensor``."""
    import torch

    t = torch.tensor(data, dtype=dtype)
    dev = torch.device(device) if isinstance(device, str) else device
    if getattr(dev, "type", "cpu") == "cpu":
        return t
    return t.to(dev, non_blocking=True)


def synced_clock(device: object):
    """``time.perf_counter`` for ``device``: itself on CPU (no overhead), and on CUDA a clock that
    calls `device_sync` first, so that a phase timer measures the work, not its launch."""
    import torch

    dev = torch.device(device) if isinstance(device, str) else device
    if getattr(dev, "type", None) != "cuda":
        return time.perf_counter

    def clock() -> float:
        device_sync(dev)
        return time.perf_counter()

    return clock


class PhaseTimer:
    """Adds the time between laps to named phases: ``timer.lap("draft")`` charges the time since
    the previous lap (or since the timer started) to ``timings["draft"]``.

    The one way the decoding loops time phases. Turned off (``enabled=False``) a lap does nothing:
    no clock reading and, on CUDA, no device wait.

    Args:
        timings: seconds per phase, added to in place.
        device: the device whose queued work a lap waits for (`synced_clock`).
        enabled: whether laps time anything.
    """

    __slots__ = ("_clock", "_last", "enabled", "timings")

    def __init__(self, timings: dict[str, float], device: object, *, enabled: bool = True) -> None:
        self.timings = timings
        self.enabled = enabled
        self._clock = synced_clock(device) if enabled else no_clock
        self._last = self._clock()

    def mark(self) -> None:
        """Start timing anew from now: the time since the previous lap is charged to no phase."""
        if self.enabled:
            self._last = self._clock()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        if self.enabled:
            now = self._clock()
            self.timings[phase] += now - self._last
            self._last = now


def release_free_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's ``malloc_trim(0)``; a no-op
    elsewhere). Building a compressed copy frees many float32 temporaries of a few MB each, which
    glibc serves from its heap once its mmap threshold has grown; the copies allocated between them
    pin that heap, so without a trim the freed temporaries stay resident (measured on SmolLM2-135M:
    the peak RSS of a run with int8 drafts varied between 1.43 and 1.56 GB, against 1.27 GB with
    float32 drafts)."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


_LIBC: object = None
