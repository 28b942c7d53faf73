"""What produced a run: the model (its id, local path, the file it was converted from and that
file's quantisation, a hash of the weights), the code (git commit, dirty tree) and the device and
dtype, for every run's ``meta.json`` and its W&B config.

Anyone comparing our numbers with a paper must know, for instance, that the default model is
SmolLM2-135M-Instruct from a Q4_1 GGUF de-quantised to float32, not the original checkpoint: the
conversion record (``selfspec-source.json``, written by `framework.models.loading.convert_gguf`)
says so, and `model_provenance` carries it.

The weights hash is the sha256 of the model directory's ``*.safetensors`` files (in name order),
computed once per file version and kept in ``<file>.selfspec-sha256.json`` next to it where the
directory is writable (else recomputed: about 1 s per 500 MB); a model built in process (the tiny
test models) is hashed from its parameters. Models whose weights are in neither form get ``None``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from framework.models.loading import DEFAULT_MODEL, MODELS, model_name

#: Parameters up to which a model without weight files is hashed from memory.
MAX_IN_MEMORY_HASH = 50_000_000
_QUANT = re.compile(r"[.-](i?q\d(?:_[a-z0-9]+)*|f16|f32|bf16)\.gguf$", re.IGNORECASE)


def run_provenance(configured: str | None, model: Any, *, device: Any, dtype: str) -> dict[str, Any]:
    """``{"model": ..., "code": ..., "device": ..., "dtype": ...}`` for a run of ``model`` (loaded
    from ``configured``, the ``--model`` value; ``None``: the default model)."""
    return {
        "model": model_provenance(configured, model),
        "code": git_state(),
        "device": str(device),
        "dtype": dtype,
    }


def model_provenance(configured: str | None, model: Any) -> dict[str, Any]:
    """The model's id, local path, architecture and size, where its weights came from (the GGUF
    file, its sha256 and quantisation, for converted models) and ``weights_sha256``."""
    config = getattr(model, "config", None)
    path = getattr(config, "_name_or_path", "") or None
    named = [n for n, m in MODELS.items() if m.cache_name and path and Path(path).name == m.cache_name]
    out: dict[str, Any] = {
        "id": configured or (named[0] if named else model_name(None, model) or DEFAULT_MODEL),
        "path": path,
        "architecture": getattr(config, "model_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "source": None,
    }
    local = Path(path) if path and Path(path).is_dir() else None
    record = local / "selfspec-source.json" if local is not None else None
    if record is not None and record.is_file():
        src = json.loads(record.read_text())
        quant = _QUANT.search(str(src.get("gguf", "")))
        out["source"] = {
            "file": src.get("gguf"),
            "sha256": src.get("sha256"),
            "quantisation": quant.group(1).upper() if quant else None,
            "conversion": src.get("source") or "GGUF de-quantised to float32 by framework.models.loading",
        }
    elif out["id"] in MODELS and MODELS[out["id"]].source is None:
        out["source"] = {"conversion": MODELS[out["id"]].description}
    out["weights_sha256"] = weights_sha256(local, model)
    return out


def weights_sha256(directory: Path | None, model: Any) -> str | None:
    """sha256 of the directory's ``*.safetensors`` files in name order, else of a small model's
    parameters (in ``state_dict`` order, as float32 bytes), else ``None``."""
    files = sorted(directory.glob("*.safetensors")) if directory is not None else []
    if files:
        h = hashlib.sha256()
        for f in files:
            h.update(_file_sha256(f).encode())
        return h.hexdigest() if len(files) > 1 else _file_sha256(files[0])
    if sum(p.numel() for p in model.parameters()) > MAX_IN_MEMORY_HASH:
        return None
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _file_sha256(path: Path) -> str:
    """sha256 of one file, cached beside it by (size, mtime)."""
    stat = path.stat()
    key = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    side = path.with_name(path.name + ".selfspec-sha256.json")
    try:
        cached = json.loads(side.read_text())
        if {k: cached.get(k) for k in key} == key:
            return str(cached["sha256"])
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        side.write_text(json.dumps({**key, "sha256": digest}) + "\n")
    except OSError:
        pass
    return digest


def git_state(root: Path | None = None) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the checkout holding the framework
    (``None`` for both outside a git checkout, e.g. an installed wheel)."""
    root = root or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """The machine and the versions, for every run's ``meta.json`` (``run.py``'s and
    ``bench.py``'s) and the benchmark's report: one definition for both."""
    import transformers

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
