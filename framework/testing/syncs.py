"""Counting device-to-host reads (the host-device synchronisations of a GPU run) on any device.

On CUDA every ``.item()``, ``.tolist()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``t.cpu()``,
``t.numpy()`` or ``torch.equal(a, b)`` of a device tensor waits for the queued kernels to finish:
one synchronisation.
`count_host_reads` counts those calls on any device, CPU included (where they cost nothing), by the
line of project code that made them, and the blocking uploads (``torch.tensor(..., device=...)``)
beside them, so a test on CPU can hold the decode loop to a budget of reads
per round and a GPU session can see where the waits come from. On CPU it also counts reads of
tensors that would stay on the host on a GPU (a strategy's own CPU statistics): read its table by
call site.

    with count_host_reads() as reads:
        decoder.generate(prompt, stop)
    print(reads.total, reads.by_site.most_common(5))
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

#: The tensor methods that read device memory on the host.
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class HostReads:
    """What `count_host_reads` saw: ``by_site[(method, "path:line")]`` counts at the line each read
    is charged to (`_site`: the first frame outside ``framework/``, a path relative to the
    project root when the file is inside it)."""

    by_site: Counter = field(default_factory=Counter)
    #: ``torch.tensor(..., device=...)`` / ``torch.as_tensor(..., device=...)`` calls by site: a
    #: blocking host-to-device copy on CUDA (`framework.utils.upload` queues it instead).
    uploads: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Device-to-host reads (uploads not included)."""
        return sum(self.by_site.values())

    def at(self, path_fragment: str) -> int:
        """Reads made from files whose path contains ``path_fragment``."""
        return sum(c for (_, site), c in self.by_site.items() if path_fragment in site)

    def table(self, per: int = 1, top: int = 12) -> str:
        """The busiest sites, one per line, counts divided by ``per`` (e.g. the rounds)."""
        return "\n".join(
            f"{c / max(1, per):7.2f}  {method:<9} {site}"
            for (method, site), c in self.by_site.most_common(top)
        )


#: Where the framework's own code lives; a frame outside it is an author's (a strategy, a test).
_FRAMEWORK = str(Path(__file__).resolve().parents[1]) + os.sep
#: The engine's decode loop: an operation reached from it through framework code alone is the
#: engine's own, reported at its innermost framework line.
_LOOP = str(Path(__file__).resolve().parents[1] / "engine" / "decoding.py")
#: The counting modules themselves (never a site).
_COUNTERS = (str(Path(__file__).resolve()), str(Path(__file__).resolve().with_name("host_work.py")))
_LIBRARIES = tuple(
    {
        str(Path(p).resolve()) + os.sep
        for p in (sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))
    }
)


def _library(name: str) -> bool:
    """An installed package's file, the standard library's, or frozen import machinery."""
    return (
        name.startswith(_LIBRARIES)
        or "site-packages" in name
        or "dist-packages" in name
        or name.startswith("<frozen")
    )


def _where(name: str, line: int) -> str:
    """``path:line``, the path relative to the project root when the file is inside it."""
    if name.startswith(_ROOT + os.sep):
        name = name[len(_ROOT) + 1 :]
    return f"{name}:{line}"


def _site() -> str | None:
    """The line an operation or a read is charged to: the first frame outside ``framework/`` on
    the call stack (a strategy's line, wherever its file lives: the project's ``strategies/``,
    an author's own folder, a test), installed packages and the standard library skipped. Work
    the engine does of its own accord (reached from the decode loop through framework code
    alone) is charged to its innermost framework line. ``None``: no such frame."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        name = f.f_code.co_filename
        if _library(name) or name in _COUNTERS:
            f = f.f_back
            continue
        if not name.startswith(_FRAMEWORK):
            return _where(name, f.f_lineno)
        if first is None:
            first = f
        if name == _LOOP:
            break
        f = f.f_back
    return None if first is None else _where(first.f_code.co_filename, first.f_lineno)


@contextlib.contextmanager
def count_host_reads(
    device_type: str | None = None, *, skip: Callable[[], bool] | None = None
) -> Iterator[HostReads]:
    """Count device-to-host reads made by project code inside the block (see the module docstring).

    Args:
        device_type: count only tensors on this device type (``"cuda"``); ``None`` counts all.
        skip: while it returns ``True``, reads are not counted (the model's forwards, for
            `framework.testing.host_work`).

    Not thread-safe: it patches `torch.Tensor` methods for the duration of the block.
    """
    out = HostReads()
    saved = {name: getattr(torch.Tensor, name) for name in READS}
    makers = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def wrap(name: str):
        original = saved[name]

        def read(self, *args, **kwargs):
            if (skip is None or not skip()) and (device_type is None or self.device.type == device_type):
                site = _site()
                if site is not None:
                    out.by_site[(name, site)] += 1
            return original(self, *args, **kwargs)

        return read

    def wrap_maker(name: str):
        original = makers[name]

        def make(*args, **kwargs):
            dev = kwargs.get("device")
            if (
                dev is not None
                and (skip is None or not skip())
                and (device_type is None or torch.device(dev).type == device_type)
            ):
                site = _site()
                if site is not None:
                    out.uploads[(name, site)] += 1
            return original(*args, **kwargs)

        return make

    equal = torch.equal

    def compare(a, b, *args, **kwargs):  # ``torch.equal`` answers a host bool: a read
        if (skip is None or not skip()) and (device_type is None or a.device.type == device_type):
            site = _site()
            if site is not None:
                out.by_site[("equal", site)] += 1
        return equal(a, b, *args, **kwargs)

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        for name in makers:
            setattr(torch, name, wrap_maker(name))
        torch.equal = compare
        yield out
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in makers.items():
            setattr(torch, name, original)
        torch.equal = equal
