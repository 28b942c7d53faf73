"""Building and loading the compiled CPU kernels of ``csrc/selfspec_kernels.cpp``.

The C++ source ships with the package (``framework/kernels/csrc/selfspec_kernels.cpp``) and is
compiled on first use with ``torch.utils.cpp_extension.load``. The build goes to
``$SELFSPEC_CACHE/kernels`` (default ``~/.cache/selfspec/kernels``), one directory per source,
compiler flags, CPU and torch version, and is reused silently: editing the ``.cpp`` file gives a
new directory, i.e. a rebuild. Without a compiler, a CPU with neither AVX2+FMA nor AVX-512, or on a
failed build, one line on stderr says so and `load_extension` returns ``None`` (the ops of
`framework.kernels.cpu` then use plain PyTorch).

Control: ``SELFSPEC_KERNEL=0`` (`ENV_VAR`) disables the kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from framework.utils import cache_dir

#: Environment variable: ``0`` (or ``false``, ``off``, ``no``) disables the kernels.
ENV_VAR = "SELFSPEC_KERNEL"
#: The C++ source of the kernels (package data).
SOURCE_PATH = Path(__file__).parent / "csrc" / "selfspec_kernels.cpp"

_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp")

#: The compiled module once `load_extension` has succeeded (``None`` before, and when the kernels
#: are disabled or unavailable). The ops read it directly: they run ~200 times per decoded token.
compiled: ModuleType | None = None
_tried = False
#: Why the kernels are not in use (``None`` while they are, or before the first attempt).
unavailable_reason: str | None = None


def enabled_by_env() -> bool:
    """False when ``SELFSPEC_KERNEL`` is ``0``, ``false``, ``off`` or ``no``."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _source() -> str:
    """The C++ source, as shipped with the package."""
    return SOURCE_PATH.read_text()


def _cpu_signature() -> str:
    """The CPU model and feature flags (a ``-march=native`` build is valid only on such a CPU)."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    sig += line
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        sig += platform.processor()
    return sig


def build_dir() -> Path:
    """Where the compiled kernels live: ``$SELFSPEC_CACHE/kernels/<name>``."""
    return cache_dir() / "kernels" / _module_name(_source())


def _module_name(source: str) -> str:
    """The extension's name: a hash of the source, the flags, the versions, the CPU and compiler."""
    key = "|".join(
        [
            source,
            " ".join(_FLAGS),
            torch.__version__,
            sys.version,
            _cpu_signature(),
            os.environ.get("CXX", ""),
        ]
    )
    return "selfspec_kernels_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _import_built(name: str, directory: Path) -> ModuleType | None:
    path = directory / f"{name}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str, directory: Path, source: str) -> ModuleType:
    """Compile ``source`` (copied into ``directory``, so the build there is of exactly the text its
    name was hashed from) and import it."""
    from torch.utils.cpp_extension import load

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not found)")
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > 900:
        lock.unlink(missing_ok=True)  # left by a build that was killed; torch would wait forever
    src = directory / f"{name}.cpp"
    if not src.exists() or src.read_text() != source:
        tmp = src.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(source)
        os.replace(tmp, src)
    print(f"[selfspec] compiling the CPU kernels once into {directory} (~30 s)", file=sys.stderr)
    return load(
        name=name,
        sources=[str(src)],
        build_directory=str(directory),
        extra_cflags=list(_FLAGS),
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def load_extension() -> ModuleType | None:
    """The compiled kernels, building them on first use; ``None`` if disabled or unavailable.

    A failure is reported once per process, in one line on stderr, and `unavailable_reason` says
    why; later calls return ``None`` at once.
    """
    global compiled, _tried, unavailable_reason
    if compiled is not None or _tried:
        return compiled
    _tried = True
    if not enabled_by_env():
        unavailable_reason = f"disabled by {ENV_VAR}"
        return None
    try:
        source = _source()
        name = _module_name(source)
        directory = cache_dir() / "kernels" / name
        try:
            ext = _import_built(name, directory)
        except ImportError:
            ext = None  # a broken earlier build: rebuild
        if ext is None:
            ext = _build(name, directory, source)
        if ext.isa == "scalar":
            raise RuntimeError("the CPU has neither AVX2+FMA nor AVX-512")
    except Exception as err:  # noqa: BLE001 - any build problem means: use plain PyTorch
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        unavailable_reason = first
        print(
            f"[selfspec] fast CPU kernels unavailable ({first}); using plain PyTorch "
            f"(set {ENV_VAR}=0 to skip the attempt)",
            file=sys.stderr,
        )
        return None
    compiled = ext
    unavailable_reason = None
    return ext


def available() -> bool:
    """Whether the kernels are compiled and enabled (builds them on first call)."""
    return load_extension() is not None


def isa() -> str | None:
    """The vector instruction set the kernels were compiled for (``avx512``, ``avx2``), or ``None``."""
    ext = load_extension()
    return None if ext is None else ext.isa
