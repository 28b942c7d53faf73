"""The sweep command line (framework/sweep/cli.py, experiments/sweep.py): bad input, the command
`wandb agent` runs, and the tutorial's commands."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import framework.sweep as sweep
import framework.sweep.local as local
from framework.sweep.cli import main
from framework.sweep.trial import SMOKE_ENV

ROOT = Path(__file__).resolve().parents[3]


def _yaml(params, method="grid", **extra):
    return {
        "method": method,
        "metric": {"name": "speedup", "goal": "maximize"},
        "parameters": params,
        **extra,
    }


BAD = {
    "missing file": (None, "cannot read sweep file"),
    "malformed": ("method: grid\nparameters: {limit: {value: 1}\n", "not valid YAML"),
    "not a mapping": ("- method\n- grid\n", "expected a YAML mapping"),
    "no parameters": ({"method": "grid"}, "missing 'parameters'"),
    "unknown method": (
        _yaml({"limit": {"value": 1}}, method="hyperband"),
        "method must be one of grid, random, bayes",
    ),
    "unknown key": (_yaml({"limit": {"value": 1}}, early_stop=True), "unknown key(s) early_stop"),
    "unknown metric": (
        {"method": "grid", "metric": {"name": "loss"}, "parameters": {"limit": {"value": 1}}},
        "metric.name 'loss' is not logged",
    ),
    "not an option": (
        _yaml({"skip_ratio": {"values": [0.3]}}),
        "sweep parameter 'skip_ratio' is not a run option (did you mean selector.skip_ratio",
    ),
    "output": (_yaml({"output": {"value": "x.jsonl"}}), "the sweep sets each trial's output itself"),
    "not a field": (
        _yaml({"selector.threshold": {"values": [0.5]}}),
        "sweep parameter 'selector.threshold': --selector.threshold must be a field of StaticSelectorConfig "
        "(skip_ratio, skip_attn, skip_mlp, keep_first_last)",
    ),
    "field of another strategy": (
        _yaml({"selector": {"value": "swift"}, "selector.interval": {"values": [4]}}),
        "--selector.interval must be a field of SwiftConfig (skip_ratio, context_window",
    ),
    "bad value": (
        _yaml({"selector.skip_ratio": {"values": [0.3, 1.5]}, "length.threshold": {"values": [0.6]}}),
        "trial 2 of 2 (selector.skip_ratio=1.5): sweep parameter 'selector.skip_ratio': "
        "--selector.skip_ratio must be in [0, 1), got 1.5",
    ),
    "bad int": (
        _yaml({"max_new_tokens": {"values": [0, 8]}}),
        "--max-new-tokens must be an integer >= 1, got 0",
    ),
    "unknown preset": (_yaml({"method": {"value": "nope"}}), "--method must be a preset"),
    "unknown strategy": (_yaml({"selector": {"value": "nope"}}), "unknown selector 'nope'"),
    "unsupported distribution": (
        _yaml({"length.threshold": {"distribution": "beta", "a": 1, "b": 2}}, method="random"),
        "distribution 'beta' is not supported by the local runner",
    ),
    "grid over a continuous range": (
        _yaml({"length.threshold": {"min": 0.5, "max": 0.9}}),
        "method grid needs discrete values",
    ),
    "random without count": (
        _yaml({"length.threshold": {"min": 0.5, "max": 0.9}}, method="random"),
        "--count N",
    ),
    "nested": (_yaml({"selector": {"parameters": {"skip_ratio": {"value": 0.3}}}}), "nested 'parameters'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_a_message(case, tmp_path, capsys, monkeypatch):
    content, message = BAD[case]
    path = tmp_path / "bad.yaml"
    if isinstance(content, str):
        path.write_text(content)
    elif content is not None:
        path.write_text(yaml.safe_dump(content))
    called = []
    monkeypatch.setattr(local, "train", lambda *a, **k: called.append(1))
    assert main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not called and not (tmp_path / "out").exists(), "nothing may run or be written"


def test_the_agent_command_runs_one_trial_from_wandb_config(tmp_path, monkeypatch, written):
    """What `wandb agent` does per trial: write the trial's parameters to a YAML file, point
    WANDB_SWEEP_PARAM_PATH at it, and run the sweep file's `command` (here in-process, in smoke mode)."""
    import wandb

    params = tmp_path / "wandb" / "sweep-abc" / "config-run42.yaml"
    params.parent.mkdir(parents=True)
    params.write_text(
        "wandb_version: 1\n\nmethod:\n  value: static_confidence\nlimit:\n  value: 1\n"
        "selector.skip_ratio:\n  value: 0.5\nlength.threshold:\n  value: 0.6\n"
    )
    monkeypatch.chdir(tmp_path)
    for key, value in {
        "WANDB_SWEEP_ID": "abc",
        "WANDB_RUN_ID": "run42",
        "WANDB_SWEEP_PARAM_PATH": str(params),
        SMOKE_ENV: "1",
    }.items():
        monkeypatch.setenv(key, value)
    command = yaml.safe_load((ROOT / "experiments" / "sweeps" / "static.yaml").read_text())["command"]
    wandb.teardown()  # the agent starts a fresh process: settings are read from the environment again
    try:
        assert main(command[3:]) == 0
    finally:
        monkeypatch.delenv("WANDB_SWEEP_PARAM_PATH")
        wandb.teardown()
    meta = json.loads((tmp_path / "runs" / "sweeps" / "abc" / "run42" / "meta.json").read_text())
    assert meta["config"]["selector"]["config"]["skip_ratio"] == 0.5
    assert meta["config"]["length"]["config"]["threshold"] == 0.6
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-run42")
    assert b"mean_accepted_tokens" in written(next(run_dir.glob("*.wandb")), b"mean_accepted_tokens")


_MARK = "<!-- test: run -->"
TUTORIAL = ROOT / "docs" / "tutorials" / "sweep.md"


def test_tutorial_offline_commands_run(tmp_path, monkeypatch, capsys):
    """The commands the tutorial marks run as written (outputs under tmp): the sweep script
    in-process (to pay the imports once), the others in bash."""
    blocks = re.findall(re.escape(_MARK) + r"\s*```bash\n(.*?)```", TUTORIAL.read_text(), re.S)
    assert len(blocks) >= 3, "the tutorial marks its offline commands"
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("WANDB_DIR")  # the runs go next to the results, as on a fresh machine
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = ""
    for line in "\n".join(blocks).replace("runs/", f"{tmp_path}/runs/").splitlines():
        if line.startswith("python experiments/sweep.py "):
            code = main(shlex.split(line)[2:])
            captured = capsys.readouterr()
            out += captured.out + captured.err
            assert code == 0, out
        elif line.strip():
            proc = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True, timeout=120)
            out += proc.stdout + proc.stderr
            assert proc.returncode == 0, out
    assert "20 trials validated; nothing was run" in out
    assert "## Sweep static-confidence: 2 of 2 trials" in out
    assert "Would sync 2 run(s)" in out


def test_tutorial_sweep_file_is_valid(write_sweep):
    """The example sweep file of the tutorial's last step validates."""
    (block,) = [
        b for b in re.findall(r"```yaml\n(.*?)```", TUTORIAL.read_text(), re.S) if "name: fixed-k" in b
    ]
    s = sweep.load_sweep(write_sweep(yaml.safe_load(block)))
    trials = sweep.expand_trials(s)
    assert len(trials) == 6 and len(sweep.validate_trials(s, trials)) == 6


def test_set_and_limit_shrink_a_sweep_without_copying_its_file(tmp_path, monkeypatch, capsys):
    """--set KEY=VALUE (typed as YAML) and --limit override every trial's fixed options: the runs
    get them, the header says so; a swept parameter cannot be set."""
    seen: list[dict] = []

    def fake_train(params, **kw):
        seen.append({**params, **kw["overrides"]})
        return {"metrics": {"speedup": 1.0}, "output": kw["output"], "wandb_dir": None}

    monkeypatch.setattr(local, "train", fake_train)
    out = tmp_path / "s"
    code = main(
        ["experiments/sweeps/static.yaml", "--count", "2", "--no-wandb", "--out", str(out)]
        + ["--set", "max_new_tokens=16", "--set", "warmup=0", "--limit", "1"]
    )
    assert code == 0, capsys.readouterr().err
    assert [(s["max_new_tokens"], s["limit"], s["warmup"]) for s in seen] == [(16, 1, 0)] * 2
    assert (
        "Set on the command line: max_new_tokens=16, warmup=0, limit=1." in (out / "results.md").read_text()
    )
    code = main(["experiments/sweeps/static.yaml", "--dry-run", "--set", "selector.skip_ratio=0.3"])
    assert code == 2 and "swept by" in capsys.readouterr().err
    code = main(["experiments/sweeps/static.yaml", "--dry-run", "--set", "max_new_tokens"])
    assert code == 2 and "expected KEY=VALUE" in capsys.readouterr().err
    code = main(["experiments/sweeps/static.yaml", "--dry-run", "--set", "max_new_tokens=0"])
    assert code == 2 and "max_new_tokens" in capsys.readouterr().err  # validated like any run option
