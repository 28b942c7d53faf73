"""framework/runner/pipeline.py: the helpers of the one pipeline behind run.py and bench.py (the
runs themselves: test_lightning.py and tests/framework/benchmark)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from framework.config_fields import ConfigError
from framework.runner import pipeline


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_seeds_python_numpy_and_torch():
    pipeline.seed_everything(7)
    first = _draws()
    pipeline.seed_everything(7)
    assert _draws() == first
    pipeline.seed_everything(8)
    second = _draws()
    for a, b in zip(first, second, strict=True):
        assert a != b


def test_stamped_names_are_file_safe_and_under_runs():
    path = pipeline.stamped("my method/v2:x", ".jsonl")
    assert path.parent == Path("runs")
    assert path.name.startswith("my_method_v2_x-") and path.suffix == ".jsonl"
    assert "/" not in path.name and ":" not in path.name


def test_layout_is_one_folder_whatever_the_number_of_methods(tmp_path):
    """Issue 56: run.py's one method and bench.py's several write the same folder."""
    one = pipeline.Layout(tmp_path / "b")
    assert (one.records, one.meta, one.config, one.report) == (
        tmp_path / "b" / "records.jsonl",
        tmp_path / "b" / "meta.json",
        tmp_path / "b" / "config.yaml",
        tmp_path / "b" / "bench.md",
    )
    assert (one.plots, one.tracker, one.stem("swift")) == (
        tmp_path / "b",
        tmp_path / "b" / "tracking",
        tmp_path / "b" / "swift",
    )


def test_write_json_writes_what_json_cannot_hold_as_text(tmp_path):
    pipeline.write_json(tmp_path / "m.json", {"path": tmp_path, "n": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"path": str(tmp_path), "n": 1}


def test_answer_files_are_checked_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="specbench"):
        pipeline.AnswerFiles(str(tmp_path / "file"), ["vanilla"], [], "tiny-random")
    results = tmp_path / "out" / "vanilla.jsonl"
    with pytest.raises(ConfigError, match="specbench"):  # would overwrite the results
        pipeline.AnswerFiles(str(tmp_path / "out"), ["vanilla"], [results], "tiny-random")


def test_answer_files_off_write_nothing_and_on_write_one_file_per_method(tmp_path):
    lines: list[str] = []
    assert pipeline.AnswerFiles(None, ["vanilla"], [], "m", lines.append).write([{"method": "vanilla"}]) == {}
    assert lines == []
    turn = {"tokens": [1, 2], "text": "a b", "new_tokens": 2, "wall_time": 0.1, "accept_lengths": [1, 1]}
    rec = {"question_id": 1, "category": "qa", "method": "vanilla", "turns": [turn]}
    files = pipeline.AnswerFiles(str(tmp_path / "a"), ["vanilla"], [], "tiny-random", lines.append)
    paths = files.write([rec])
    assert list(paths) == ["vanilla"] and paths["vanilla"].is_file()
    answer = json.loads(paths["vanilla"].read_text())
    assert answer["model_id"] == "tiny-random-vanilla" and answer["choices"][0]["turns"] == ["a b"]
    assert lines == [f"[selfspec] Spec-Bench answer files: {paths['vanilla']}"]
