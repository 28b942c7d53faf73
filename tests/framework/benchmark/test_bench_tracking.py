"""framework/benchmark/tracking.py: the benchmark logs to the tracker as the runner does (issue 29):
W&B offline without a key (config with provenance, per-method metrics, the results table, the
report), csv, or nothing."""

from __future__ import annotations

import time

import pytest

from framework.runner.cli import bench_main as main
from framework.runner.tracking import method_metrics

ARGS = ["--model", "tiny-random", "--limit", "1", "--categories", "qa", "--max-new-tokens", "6"]
ARGS += ["--methods", "vanilla,static_confidence", "--no-plots"]


def test_flat_config_and_method_metrics():
    summary = {
        "methods": {
            "m": {
                "speedup": {"qa": 1.2, "overall": 1.1},
                "M": 2.0,
                "alpha": 0.5,
                "tokens_per_s": {"overall": 9.0},
                "gate": {"rounds": 8, "declined": 2},
            }
        }
    }
    assert method_metrics(summary) == {
        "m/speedup/qa": 1.2,
        "m/speedup/overall": 1.1,
        "m/M": 2.0,
        "m/alpha": 0.5,
        "m/tokens_per_s": 9.0,
        "m/gate_declined": 0.25,
    }


def test_the_benchmark_writes_an_offline_wandb_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert main([*ARGS, "--out", str(tmp_path / "b")]) == 0
    assert "[selfspec] W&B offline run:" in capsys.readouterr().out
    (run,) = (tmp_path / "b" / "tracking" / "wandb").glob("offline-run-*")
    data = b""
    deadline = time.monotonic() + 60
    while b"static_confidence/speedup/overall" not in data and time.monotonic() < deadline:
        data = b"".join(p.read_bytes() for p in run.glob("*.wandb"))
        time.sleep(0.2)
    for key in (
        b"static_confidence/speedup/overall",
        b"static_confidence/gate_declined",  # issue 39, item 6
        b'"threshold"',  # what the preset resolved to (config "methods", per method)
        b"weights_sha256",  # config "provenance"
        b"results",
        b"report",
    ):
        assert key in data, key


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_the_benchmark_logs_to_csv_or_nowhere(tmp_path, logger):
    assert main([*ARGS, "--logger", logger, "--out", str(tmp_path / "b")]) == 0
    csvs = list((tmp_path / "b").rglob("metrics.csv"))
    if logger == "none":
        assert not (tmp_path / "b" / "tracking").exists()
    else:
        assert len(csvs) == 1 and "static_confidence/speedup/overall" in csvs[0].read_text()
