"""Fixtures of the sweep tests: W&B offline under ``tmp_path`` (no server is ever contacted), a
tiny random model, a small prompt file, and helpers that write sweep files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from framework.testing import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # W&B keeps process-wide settings (the run directory): read this test's again
    yield
    wandb.teardown()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", num_layers=4, vocab_size=128, max_position_embeddings=256), tiny_tokenizer()


@pytest.fixture
def prompts(tmp_path):
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["w7 w8 w9 w10"]},
        {"question_id": 2, "category": "writing", "turns": ["w1 w2 w3"]},
    ]
    p = tmp_path / "q.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.fixture
def write_sweep(tmp_path):
    """``write_sweep(data, name="s.yaml")``: the sweep file ``data`` written under ``tmp_path``."""

    def write(data: dict, name: str = "s.yaml") -> Path:
        p = tmp_path / name
        p.write_text(yaml.safe_dump(data, sort_keys=False))
        return p

    return write


@pytest.fixture
def written():
    """``written(path, marker)``: the file's bytes once ``marker`` is in them: W&B's service process
    writes a finished run's log asynchronously (``run.finish()`` can return before the last records
    reach the file)."""

    def wait(path: Path, marker: bytes, timeout: float = 60.0) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in (data := path.read_bytes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return data

    return wait
