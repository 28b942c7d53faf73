"""Tracking: W&B mode choice, the CSV and offline W&B loggers of a real run, logged values, plots."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.benchmark.report import summarize
from framework.runner.pipeline import run
from framework.runner.tracking import method_metrics, prompt_metrics, round_rows
from framework.session.loggers import wandb_mode
from framework.session.run_config import RunConfig


@pytest.fixture
def data(tmp_path):
    rows = [
        {"question_id": 1, "category": "qa", "turns": ["w1 w2 w3"]},
        {"question_id": 2, "category": "rag", "turns": ["w4 w5 w6 w7"]},
    ]
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.fixture
def no_wandb_account(tmp_path, monkeypatch):
    """A fresh machine: no API key, no ~/.netrc, no WANDB_MODE; W&B files under tmp_path."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_SWEEP_ID", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    return home


def cfg_for(data, out, **kw):
    base = dict(
        data=str(data),
        output=str(out),
        max_new_tokens=8,
        warmup=0,
        logger="none",  # the tests that log pass logger="csv" / "wandb"
    )
    if "selector" not in kw:  # the tests' method: static at 0.3, fixed k = 3
        base |= {"selector": "static", "selector.skip_ratio": 0.3}
    if "length" not in kw:
        base |= {"length": "fixed", "length.k": 3}
    base.update(kw)
    return RunConfig.of(**base)


def test_wandb_mode_offline_without_credentials(no_wandb_account, monkeypatch):
    assert wandb_mode() == "offline"
    (no_wandb_account / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (no_wandb_account / ".netrc").chmod(0o600)
    assert wandb_mode() == "online"
    (no_wandb_account / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_csv_logger_writes_per_prompt_and_summary_metrics(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "r"
    res = run(cfg_for(data, out, logger="csv"), log=lambda s: None, model=model, tokenizer=tok)
    rows = list(csv.DictReader((out / "tracking" / "csv" / "metrics.csv").open()))
    (label,) = [m for m in res["summary"]["methods"] if m != "vanilla"]
    per_prompt = [r for r in rows if r[f"prompt/{label}_speedup"]]
    assert len(per_prompt) == 2 and all(float(r[f"prompt/{label}_lossless"]) == 1.0 for r in per_prompt)
    summary = [r for r in rows if r[f"{label}/speedup/overall"]]
    assert len(summary) == 1
    entry = res["summary"]["methods"][label]
    assert float(summary[0][f"{label}/speedup/overall"]) == pytest.approx(entry["speedup"]["overall"])
    assert float(summary[0][f"{label}/mismatches"]) == 0


def test_a_failure_after_the_report_closes_the_logger_once_and_raises(tiny, data, tmp_path, monkeypatch):
    """The logger is closed after everything else: a failure while writing the answer files
    closes it once (as failed), not a second time after a successful close."""
    from framework.runner import pipeline

    model, tok = tiny
    closes: list[bool] = []
    real_close = pipeline.close_logger
    monkeypatch.setattr(
        pipeline,
        "close_logger",
        lambda lg, log, failed=False: (closes.append(failed), real_close(lg, log, failed=failed)),
    )

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pipeline._Run, "write_answers", broken)
    with pytest.raises(OSError, match="disk full"):
        run(cfg_for(data, tmp_path / "r.jsonl", logger="csv"), log=lambda s: None, model=model, tokenizer=tok)
    assert closes == [True]


def test_offline_wandb_run_directory_is_found_by_wandb_sync(tiny, data, tmp_path, no_wandb_account):
    model, tok = tiny
    out = tmp_path / "r.jsonl"
    lines: list[str] = []
    res = run(cfg_for(data, out, logger="wandb"), log=lines.append, model=model, tokenizer=tok)
    runs = list((tmp_path / "r" / "tracking" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    run_dir = runs[0]
    assert list(run_dir.glob("run-*.wandb")) and (run_dir / "files").is_dir()
    assert any(f"wandb sync {run_dir}" in s for s in lines)
    tables = {p.name.split("_")[0] for p in (run_dir / "files" / "media" / "table").glob("*.table.json")}
    assert {"prompts", "rounds", "selector"} <= tables
    images = list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert len(images) == len(res["plots"]) >= 3
    # `wandb sync --dry-run` lists the unsynced offline run without uploading anything.
    wandb_cli = [sys.executable, "-c", "from wandb.cli.cli import cli; cli()"]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SILENT"}  # conftest silences W&B
    proc = subprocess.run(
        [*wandb_cli, "sync", "--dry-run"],
        cwd=tmp_path / "r" / "tracking",
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert "Would sync 1 run" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_plots_are_written_as_png(tiny, data, tmp_path):
    model, tok = tiny
    res = run(cfg_for(data, tmp_path / "p"), log=lambda s: None, model=model, tokenizer=tok)
    (label,) = [m for m in res["summary"]["methods"] if m != "vanilla"]
    names = sorted(Path(p).name for p in res["plots"].values())
    assert names == sorted(["accept_lengths.png", "speedup_by_category.png", "skip_static_fixed.png"])
    assert label == "static+fixed"  # bench.py's names: one plot of the plan per method
    for p in res["plots"].values():
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    none = run(cfg_for(data, tmp_path / "n", plots=False), log=lambda s: None, model=model, tokenizer=tok)
    assert none["plots"] == {} and not list((tmp_path / "n").glob("*.png"))


def _rec(qid, cat, method, tokens, wall, accept, drafted=0, accepted=0, **turn):
    t = {"text": "x", "accept_lengths": accept, **turn}
    return {
        "question_id": qid,
        "category": cat,
        "method": method,
        "new_tokens": tokens,
        "wall_time": wall,
        "accept_lengths": accept,
        "drafted": drafted,
        "accepted": accepted,
        "turns": [t],
        "lossless": True if method != "vanilla" else None,
        "timings": {},
    }


def test_summary_and_prompt_metrics_by_hand():
    recs = [
        _rec(1, "qa", "vanilla", 10, 1.0, [1] * 9),
        _rec(1, "qa", "m", 10, 0.5, [3, 3, 3], drafted=9, accepted=6, skip_ratios=[0.2] * 3),
        _rec(2, "rag", "vanilla", 20, 4.0, [1] * 19),
        _rec(2, "rag", "m", 20, 2.0, [2] * 10, drafted=20, accepted=10, skip_ratios=[0.2] * 10),
    ]
    for r in recs:
        r["repeat"] = 0
    s = method_metrics(summarize(recs, ["vanilla", "m"]))
    # ratio of means: ((10/0.5 + 20/2) / 2) / ((10/1 + 20/4) / 2) = 15 / 7.5
    assert s["m/speedup/overall"] == pytest.approx(2.0)
    assert s["m/speedup/qa"] == pytest.approx(2.0) and s["m/speedup/rag"] == pytest.approx(2.0)
    assert s["m/M"] == pytest.approx((9 + 20) / 13)
    assert s["m/alpha"] == pytest.approx(16 / 29)
    assert s["m/mismatches"] == 0 and s["m/tokens_per_s"] == pytest.approx(15.0)
    p = prompt_metrics(recs[:2])
    assert p["prompt/m_speedup"] == pytest.approx(2.0) and p["prompt/vanilla_tokens_per_s"] == 10.0
    assert p["prompt/m_M"] == 3.0 and p["prompt/m_alpha"] == pytest.approx(6 / 9)
    assert p["prompt/m_lossless"] == 1.0 and "prompt/vanilla_speedup" not in p
    assert p["prompt/question_id"] == "1" and p["prompt/category"] == "qa"  # which prompt a row is
    none = prompt_metrics([recs[0], _rec(1, "qa", "m", 10, 0.9, [1] * 9, drafted=0, accepted=0)])
    assert "prompt/m_alpha" not in none  # nothing drafted: n/a, not 0


def test_a_resumed_csv_logger_keeps_the_earlier_rows_and_hparams_load_safely(tmp_path):
    """Lightning's CSV logger deletes an existing metrics.csv; a resumed run keeps its rows (new
    columns included), and hparams.yaml holds plain YAML (no Python tags)."""
    import csv

    import yaml

    from framework.session.loggers import make_logger

    config = {"stop": ("a", "b"), "gate": {"margin": 0.05}, "imports": []}
    first = make_logger("csv", tmp_path, "run", "p", config)
    first.log_metrics({"prompt/speedup": 1.5, "prompt/question_id": "q1"}, step=0)
    first.save()
    again = make_logger("csv", tmp_path, "run", "p", config)  # --resume: the same run directory
    again.log_metrics({"prompt/speedup": 2.0, "prompt/question_id": "q2", "prompt/new": 1.0}, step=0)
    again.save()
    rows = list(csv.DictReader((tmp_path / "csv" / "metrics.csv").open()))
    assert [r["prompt/question_id"] for r in rows] == ["q1", "q2"]
    assert rows[1]["prompt/new"] == "1.0" and rows[0]["prompt/new"] == ""
    hparams = yaml.safe_load((tmp_path / "csv" / "hparams.yaml").read_text())
    assert hparams["stop"] == ["a", "b"]


def test_round_rows_align_plans_with_drafting_rounds():
    rec = _rec(
        7,
        "qa",
        "m",
        5,
        1.0,
        [2, 1, 2],
        draft_lengths=[3, 0, 2],
        plans=["0110", "0011"],
        exit_layers=[None, 1],
    )
    assert round_rows([rec]) == [
        ["7", "qa", 0, 0, 3, 2, "0110", None],
        ["7", "qa", 0, 1, 0, 1, None, None],
        ["7", "qa", 0, 2, 2, 2, "0011", 1],
    ]


def test_wandb_logger_does_not_pass_the_deprecated_anonymous_setting(tmp_path, no_wandb_account):
    """Lightning hands wandb.init ``anonymous=None``; wandb >= 0.19 prints "WARNING The anonymous
    setting has no effect ..." for any value it is given, so the logger must not pass it."""
    from framework.session.loggers import make_logger

    logger = make_logger("wandb", tmp_path / "run", "run", "selfspec-test", {"a": 1})
    try:
        assert "anonymous" not in logger._wandb_init
        assert logger._wandb_init["project"] == "selfspec-test"
    finally:
        logger.experiment.finish()
