"""A local sweep (framework/sweep/local.py) on the tiny random model: the results table, the offline
W&B runs, failing and interrupted trials."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import framework.sweep.local as local
from framework.sweep.cli import main


def _yaml(params, method="grid", **extra):
    return {
        "method": method,
        "metric": {"name": "speedup", "goal": "maximize"},
        "parameters": params,
        **extra,
    }


def test_bayes_says_how_it_runs_and_validates_its_draws(write_sweep):
    path = write_sweep(
        {
            "method": "bayes",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {"selector.skip_ratio": {"min": 0.1, "max": 0.5}},
        },
    )
    lines: list[str] = []
    res = local.run_sweep(path, count=3, dry_run=True, log=lines.append)
    assert any(
        "bayes (a BoTorch GP proposes each trial by log expected improvement" in line for line in lines
    )
    assert len(res.trials) == 3 and all(0.1 <= t["selector.skip_ratio"] <= 0.5 for t in res.trials)
    assert any("trial 3: python experiments/run.py --selector.skip_ratio 0." in line for line in lines)


def test_bayes_runs_the_gp_proposals(write_sweep, tmp_path, monkeypatch):
    """After the random start every trial is the proposer's proposal, its row says so, and the
    proposer saw the finished trials' metrics (a synthetic metric with its peak at 0.3)."""
    path = write_sweep(
        {
            "method": "bayes",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {"selector.skip_ratio": {"min": 0.05, "max": 0.9}, "max_new_tokens": {"value": 4}},
        },
    )

    def fake_train(params, **kw):
        r = params["selector.skip_ratio"]
        return {"metrics": {"speedup": 1.0 - (r - 0.3) ** 2}, "output": kw["output"], "wandb_dir": None}

    proposed: list[dict] = []
    real = local.BayesProposer.propose

    def spy(self, history):
        assert all(v is not None for _, v in history)  # every finished trial's metric
        out = real(self, history)
        proposed.append(out)
        return out

    monkeypatch.setattr(local, "train", fake_train)
    monkeypatch.setattr(local.BayesProposer, "propose", spy)
    res = local.run_sweep(path, count=9, out_dir=tmp_path / "b", mode="disabled", log=lambda _l: None)
    assert [r["proposed_by"] for r in res.rows] == ["random"] * 4 + ["gp"] * 5
    # the file says so too, as docs/howto/sweeps.md promises (issue 39, item 6)
    written_rows = [json.loads(x) for x in (tmp_path / "b" / "trials.jsonl").read_text().splitlines()]
    assert [r.get("proposed_by") for r in written_rows] == ["random"] * 4 + ["gp"] * 5
    table = (tmp_path / "b" / "results.md").read_text().splitlines()
    head = next(line for line in table if line.startswith("| trial |"))
    assert head.startswith("| trial | proposed by |")  # and results.md (issue 48, item 8)
    by = [
        line.split(" | ")[1] for line in table if line.startswith("| ") and line.split(" | ")[0][2:].isdigit()
    ]
    assert sorted(by) == sorted(["random"] * 4 + ["gp"] * 5)
    assert [r["params"] for r in res.rows[4:]] == proposed
    best = max(res.rows, key=lambda r: r["metrics"]["speedup"])
    assert abs(best["params"]["selector.skip_ratio"] - 0.3) < 0.05


def test_local_sweep_on_the_tiny_model_writes_the_table_and_offline_runs(
    tiny, prompts, tmp_path, write_sweep, written
):
    model, tok = tiny
    path = write_sweep(
        _yaml(
            {
                "data": {"value": str(prompts)},
                "max_new_tokens": {"value": 6},
                "threads": {"value": 1},
                "selector.skip_ratio": {"values": [0.3, 0.5]},
                "length.threshold": {"values": [0.6]},
            },
            name="tiny",
        ),
    )
    out = tmp_path / "out"
    lines: list[str] = []
    res = local.run_sweep(path, out_dir=out, model=model, tokenizer=tok, log=lines.append)
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [1, 2] and all(r["status"] == "ok" for r in rows)
    assert [r["params"]["selector.skip_ratio"] for r in rows] == [0.3, 0.5]
    for r in rows:
        m = r["metrics"]
        assert m["speedup"] > 0 and m["mean_accepted_tokens"] >= 1 and 0 <= m["alpha"] <= 1
        assert m["lossless"] == m["lossless_checked"] == 2 and m["prompts"] == 2
        assert "qa/speedup" in m and "mt_bench/speedup" in m
        assert Path(r["output"]).is_file()
    table = (out / "results.md").read_text()
    body = [line for line in table.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(body) == 2, table
    assert "| trial | selector.skip_ratio | speedup | M | alpha |" in table
    speeds = [float(line.split("|")[3].strip().rstrip("x")) for line in body]
    assert speeds == sorted(speeds, reverse=True), "sorted by the metric, best first"
    assert res.table in "\n".join(lines) and "wandb sync" in lines[-1]

    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {r["wandb"] for r in rows} == {str(p) for p in runs}
    for run_dir in runs:
        (wandb_file,) = run_dir.glob("run-*.wandb")
        data = written(wandb_file, b"mean_accepted_tokens")
        assert data.startswith(b":W&B")  # W&B's transaction log header
        assert b"selector.skip_ratio" in data and b"mean_accepted_tokens" in data
    sync = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "sync", "--dry-run", *map(str, runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sync.returncode == 0 and "Would sync 2 run(s)" in sync.stdout + sync.stderr, sync


def test_without_wandb_a_failing_trial_is_a_row_and_the_sweep_goes_on(tiny, prompts, tmp_path, write_sweep):
    model, tok = tiny
    path = write_sweep(
        _yaml(
            {
                "data": {"value": str(prompts)},
                "max_new_tokens": {"value": 4},
                "warmup": {"value": 0},
                "selector.skip_attn": {
                    "values": [[7], [1]]
                },  # block 7 does not exist: only the model says so
            }
        ),
    )
    out = tmp_path / "out"
    res = local.run_sweep(path, out_dir=out, mode="disabled", model=model, tokenizer=tok, log=lambda s: None)
    assert [r["status"] for r in res.rows] == ["failed", "ok"] and res.failed == 1
    assert "--selector.skip_attn must be block indices in [0, 3]" in res.rows[0]["error"]
    lines = res.table.splitlines()
    assert lines[2].startswith("| 2 | 1 |") and lines[3].startswith("| 1 | 7 |"), "failed trials sort last"
    assert not (tmp_path / "wandb").exists()


def test_an_interrupted_sweep_keeps_the_finished_trials(tmp_path, monkeypatch, prompts, write_sweep):
    path = write_sweep(
        _yaml({"data": {"value": str(prompts)}, "length.threshold": {"values": [0.5, 0.6, 0.7]}})
    )
    calls = []

    def fake_train(params, **kw):
        calls.append(params)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"params": params, "metrics": {"speedup": 1.5}, "output": "x.jsonl", "wandb_dir": None}

    monkeypatch.setattr(local, "train", fake_train)
    out = tmp_path / "out"
    assert main([str(path), "--out", str(out), "--no-wandb"]) == 130
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [1]
    assert "1 of 3 trials (interrupted)" in (out / "results.md").read_text()
    assert "| 1 | 0.5 | 1.500x |" in (out / "results.md").read_text()
    assert main([str(path), "--out", str(out), "--no-wandb"]) == 2, "an earlier sweep's directory"


def test_each_row_records_what_ran_after_set(write_sweep, tmp_path, monkeypatch):
    """``--set`` replaces a run option of the file: the row's ``params`` are what the trial ran
    with, not the file's value (issue 39, item 6)."""
    path = write_sweep(
        {
            "method": "grid",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {"length.threshold": {"values": [0.5, 0.7]}, "max_new_tokens": {"value": 128}},
        },
    )
    ran: list[dict] = []

    def fake_train(params, **kw):
        ran.append({**params, **kw["overrides"]})
        return {"metrics": {"speedup": 1.0}, "output": kw["output"], "wandb_dir": None}

    monkeypatch.setattr(local, "train", fake_train)
    out = tmp_path / "s"
    local.run_sweep(path, out_dir=out, mode="disabled", overrides={"max_new_tokens": 16}, log=lambda _l: None)
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["params"]["max_new_tokens"] for r in rows] == [16, 16]
    assert [r["params"] for r in rows] == ran
    assert [r["params"]["length.threshold"] for r in rows] == [0.5, 0.7]
    assert all("proposed_by" not in r for r in rows)  # a grid: nobody proposed anything


def test_a_smoke_sweep_names_the_tiny_model_keeps_its_prompts_and_leaves_no_temporary_folder(
    tmp_path, write_sweep, monkeypatch
):
    """Issue 48, item 3: a smoke trial's metadata and saved configuration name ``tiny-random`` (so
    that ``--config`` reruns what ran), its prompt file stays with the sweep, and the temporary
    folder is gone."""
    import tempfile

    from framework.session.run_config import RunConfig

    made = []
    real = tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(Path(real(**kw)))
        return str(made[-1])

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    path = write_sweep(
        {
            "method": "grid",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {"selector.skip_ratio": {"values": [0.2]}, "logger": {"value": "none"}},
        }
    )
    out = tmp_path / "smoke"
    res = local.run_sweep(path, out_dir=out, mode="disabled", smoke=True, log=lambda _l: None)
    assert res.rows[0]["status"] == "ok", res.rows
    assert made and not any(p.exists() for p in made)  # the temporary folder is gone
    prompts = out / "smoke-prompts.jsonl"
    assert prompts.is_file()
    trial = Path(res.rows[0]["output"])
    meta = json.loads((trial.parent / "meta.json").read_text())
    assert meta["config"]["model"] == "tiny-random" and meta["config"]["data"] == str(prompts)
    saved = RunConfig.load(trial.parent / "config.yaml")
    assert saved.model.name_or_path == "tiny-random" and saved.data.path == str(prompts)
    assert "smoke-prompts.jsonl" in (out / "results.md").read_text()
