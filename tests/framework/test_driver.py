"""framework/driver.py: what every run does once, for run.py and bench.py alike."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from framework import driver
from framework.config_fields import ConfigError
from framework.session.run_config import RunConfig
from framework.session.session import Session


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_seeds_python_numpy_and_torch():
    driver.seed_everything(7)
    first = _draws()
    driver.seed_everything(7)
    assert _draws() == first
    driver.seed_everything(8)
    second = _draws()
    for a, b in zip(first, second, strict=True):
        assert a != b


def test_start_seeds_sets_threads_and_loads_the_filtered_prompts():
    before = torch.get_num_threads()
    cfg = RunConfig.from_preset("vanilla", seed=3, threads=1, limit=1, categories=["qa", "rag"])
    try:
        prompts = driver.start(cfg)
        assert torch.get_num_threads() == 1
        drawn = _draws()
        driver.seed_everything(3)
        assert _draws() == drawn  # start seeded with the configured seed
    finally:
        torch.set_num_threads(before)
    assert [p.category for p in prompts] == ["qa", "rag"]


def test_stamped_names_are_file_safe_and_under_runs():
    path = driver.stamped("my method/v2:x", ".jsonl")
    assert path.parent == Path("runs")
    assert path.name.startswith("my_method_v2_x-") and path.suffix == ".jsonl"
    assert "/" not in path.name and ":" not in path.name


def test_metadata_has_the_machine_and_with_a_session_its_provenance_and_notes(tiny):
    tiny_session = Session(
        RunConfig.from_preset("static_confidence", model="tiny"), *tiny, log=lambda _m: None
    )
    bare = driver.metadata({"a": 1}, method="m")
    assert list(bare) == ["config", "environment", "method", "started"]
    assert bare["environment"]["torch"] == torch.__version__
    full = driver.metadata({"a": 1}, tiny_session)
    assert full["provenance"]["model"]["id"] == "tiny"
    assert full["provenance"]["device"] == "cpu"
    assert full["notes"] == tiny_session.notes


def test_write_json_writes_what_json_cannot_hold_as_text(tmp_path):
    driver.write_json(tmp_path / "m.json", {"path": tmp_path, "n": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"path": str(tmp_path), "n": 1}


def test_answer_files_are_checked_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="specbench"):
        driver.AnswerFiles(str(tmp_path / "file"), ["vanilla"], [], "tiny-random")
    results = tmp_path / "out" / "vanilla.jsonl"
    with pytest.raises(ConfigError, match="specbench"):  # would overwrite the results
        driver.AnswerFiles(str(tmp_path / "out"), ["vanilla"], [results], "tiny-random")


def test_answer_files_off_write_nothing_and_on_write_one_file_per_method(tmp_path):
    lines: list[str] = []
    assert driver.AnswerFiles(None, ["vanilla"], [], "m", lines.append).write([{"method": "vanilla"}]) == {}
    assert lines == []
    turn = {"tokens": [1, 2], "text": "a b", "new_tokens": 2, "wall_time": 0.1, "accept_lengths": [1, 1]}
    rec = {"question_id": 1, "category": "qa", "method": "vanilla", "turns": [turn]}
    files = driver.AnswerFiles(str(tmp_path / "a"), ["vanilla"], [], "tiny-random", lines.append, "[t]")
    paths = files.write([rec])
    assert list(paths) == ["vanilla"] and paths["vanilla"].is_file()
    answer = json.loads(paths["vanilla"].read_text())
    assert answer["model_id"] == "tiny-random-vanilla" and answer["choices"][0]["turns"] == ["a b"]
    assert lines == [f"[t] Spec-Bench answer files: {paths['vanilla']}"]


def test_tracker_none_is_no_logger_and_csv_writes_under_the_folder(tmp_path):
    assert driver.tracker(RunConfig.from_preset("vanilla", logger="none"), tmp_path, "n", {}) is None
    logger = driver.tracker(RunConfig.from_preset("vanilla", logger="csv"), tmp_path, "n", {"a": 1})
    logger.log_metrics({"m": 1.0}, step=0)
    logger.save()
    assert (tmp_path / "csv" / "metrics.csv").is_file()
