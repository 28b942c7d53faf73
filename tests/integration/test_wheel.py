"""The built wheel works on its own: package data (presets, prompts, kernel sources) is inside it,
and a run from outside the repository uses the installed package, not the checkout.

The wheel goes into a fresh virtual environment that sees the current environment's
site-packages for the dependencies (a ``.pth`` file listing them; ``.pth`` files inside them, such
as the editable install of this project, are not processed) but not the project itself.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What a wheel is built from (a copy, so that the build leaves nothing in the checkout).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "framework", "strategies", "selfspec")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_repository(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif path.is_file():
            shutil.copy2(path, src / name)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(wheels)], tmp_path, env)
    (wheel,) = wheels.glob("selfspec-*.whl")

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env
        ).stdout.strip()
    )
    (purelib / "outer_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([*pip, "--python", str(python), "install", "--no-deps", str(wheel)], tmp_path, env)

    work = tmp_path / "work"
    work.mkdir()
    where = _run([str(python), "-c", "import framework; print(framework.__file__)"], work, env).stdout.strip()
    assert Path(where).resolve().is_relative_to(env_dir.resolve()), where
    _run(
        [
            str(python),
            "-m",
            "framework.runner.cli",
            "--method",
            "swift",
            "--limit",
            "1",
            "--max-new-tokens",
            "8",
            "--model",
            "tiny-random",
            "--logger",
            "none",
            "--no-plots",
            "--output",
            "out",
        ],
        work,
        env,
        timeout=300,
    )
    records = [
        json.loads(line) for line in (work / "out" / "records.jsonl").read_text().splitlines() if line.strip()
    ]
    assert records and {r["method"] for r in records} == {"vanilla", "swift"}
    assert (work / "out" / "config.yaml").is_file()
