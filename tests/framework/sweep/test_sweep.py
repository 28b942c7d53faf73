"""framework.sweep.sweep (experiments/sweep.py): sweep files, trial expansion, the local runner and the W&B paths.

Everything runs on the tiny random model (passed in, or the script's smoke mode) with W&B offline
under ``tmp_path``; nothing is downloaded and no W&B server is contacted.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from framework.testing import tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "experiments" / "sweeps").glob("*.yaml"))


import framework.sweep.sweep as sweep  # noqa: E402


def _written(path: Path, marker: bytes, timeout: float = 60.0) -> bytes:
    """The file's bytes once ``marker`` is in them: W&B's service process writes a finished run's
    log asynchronously (``run.finish()`` can return before the last records reach the file)."""
    deadline = time.monotonic() + timeout
    while marker not in (data := path.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return data


def _write(tmp_path: Path, data: dict, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


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


# ----------------------------------------------------------------------------- expansion


def test_grid_is_the_cartesian_product_in_file_order(tmp_path):
    path = _write(
        tmp_path,
        {
            "method": "grid",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {
                "limit": {"value": 1},
                "selector.skip_ratio": {"values": [0.1, 0.2, 0.3]},
                "length.threshold": {"values": [0.6, 0.7]},
                "length.max_length": {"distribution": "int_uniform", "min": 4, "max": 5},
            },
        },
    )
    s = sweep.load_sweep(path)
    trials = sweep.expand_trials(s)
    assert len(trials) == 3 * 2 * 2
    assert trials[0] == {
        "limit": 1,
        "selector.skip_ratio": 0.1,
        "length.threshold": 0.6,
        "length.max_length": 4,
    }
    assert trials[1]["length.max_length"] == 5 and trials[2]["length.threshold"] == 0.7
    assert [t["selector.skip_ratio"] for t in trials] == [0.1] * 4 + [0.2] * 4 + [0.3] * 4
    assert s.swept == ["selector.skip_ratio", "length.threshold", "length.max_length"]
    assert s.constants == {"limit": 1}
    assert sweep.expand_trials(s, count=5) == trials[:5]
    q = sweep.parse_param("x", {"distribution": "q_uniform", "min": 0.3, "max": 0.6, "q": 0.05})
    assert q.grid_values() == [0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]


def test_random_sampling_respects_ranges_and_is_seeded(tmp_path):
    path = _write(
        tmp_path,
        {
            "method": "random",
            "run_cap": 7,
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {
                "method": {"value": "swift"},
                "selector.skip_ratio": {"min": 0.3, "max": 0.6},
                "selector.bo_interval": {"values": [5, 10, 25, 50]},
                "selector.patience": {"min": 10, "max": 20},
                "length.threshold": {"distribution": "q_uniform", "min": 0.5, "max": 0.9, "q": 0.1},
                "selector.kappa": {"distribution": "log_uniform_values", "min": 0.1, "max": 10.0},
                "length.max_length": {"values": [8, 25], "probabilities": [0.9, 0.1]},
            },
        },
    )
    s = sweep.load_sweep(path)
    assert len(sweep.expand_trials(s)) == 7  # run_cap
    trials = sweep.expand_trials(s, count=300, seed=3)
    assert trials == sweep.expand_trials(s, count=300, seed=3)
    assert trials != sweep.expand_trials(s, count=300, seed=4)
    for t in trials:
        assert t["method"] == "swift"
        assert 0.3 <= t["selector.skip_ratio"] <= 0.6
        assert t["selector.bo_interval"] in (5, 10, 25, 50)
        assert isinstance(t["selector.patience"], int) and 10 <= t["selector.patience"] <= 20
        assert t["length.threshold"] in (0.5, 0.6, 0.7, 0.8, 0.9)
        assert 0.1 <= t["selector.kappa"] <= 10.0
    assert {t["selector.patience"] for t in trials} == set(range(10, 21))
    kappas = sorted(math.log10(t["selector.kappa"]) for t in trials)
    assert kappas[len(kappas) // 2] == pytest.approx(0.0, abs=0.25)  # log-uniform: median near 1
    assert 0.8 < sum(t["length.max_length"] == 8 for t in trials) / len(trials) < 0.97
    sweep.validate_trials(s, trials[:20])  # every draw is a valid configuration


def test_bayes_runs_locally_as_random_with_a_notice(tmp_path):
    path = _write(
        tmp_path,
        {
            "method": "bayes",
            "metric": {"name": "speedup", "goal": "maximize"},
            "parameters": {"selector.skip_ratio": {"min": 0.1, "max": 0.5}},
        },
    )
    lines: list[str] = []
    res = sweep.run_sweep(path, count=3, dry_run=True, log=lines.append)
    assert any("bayes runs locally as random search" in line for line in lines)
    assert len(res.trials) == 3 and all(0.1 <= t["selector.skip_ratio"] <= 0.5 for t in res.trials)
    assert any("trial 3: python experiments/run.py --selector.skip_ratio 0." in line for line in lines)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_sweep_files_are_valid(path):
    """Each parses, every parameter is a run option or a field of the chosen strategy's config,
    every trial validates (no model is loaded), and the agent command calls --trial."""
    s = sweep.load_sweep(path)
    assert (s.metric, s.goal) == ("speedup", "maximize")
    trials = sweep.expand_trials(s)
    configs = sweep.validate_trials(s, trials)
    assert len(configs) == len(trials) >= 4
    raw = yaml.safe_load(path.read_text())
    assert raw["program"] == "experiments/sweep.py" and (ROOT / raw["program"]).is_file()
    assert raw["command"] == ["${env}", "${interpreter}", "${program}", "--trial"]
    assert len(s.swept) == 2, "two hyper-parameters per shipped sweep"


def test_shipped_sweeps_sweep_the_published_knobs():
    names = {p.stem: set(sweep.load_sweep(p).swept) for p in SHIPPED}
    assert names["static"] == {"selector.skip_ratio", "length.threshold"}
    assert names["swift"] == {"selector.skip_ratio", "selector.bo_interval"}
    assert names["clasp"] == {"selector.num_skip", "selector.interval"}


def test_parameters_are_spelled_as_on_the_command_line():
    cfg = sweep.build_run_config(
        {
            "selector.skip_attn": [1, 2],  # a list is comma-joined
            "categories": ["qa", "code"],
            "stop": ["END", "STOP"],  # a repeatable flag
            "length.max_length": 8.0,  # an integral float (q_uniform) for an int field
            "max-new-tokens": 16,  # the flag's own spelling works too
            "selector.keep_first_last": False,
        },
        output="x.jsonl",
    )
    assert cfg.selector.config.skip_attn == (1, 2) and cfg.selector.config.keep_first_last is False
    assert cfg.categories == ("qa", "code") and cfg.stop_strings == ("END", "STOP")
    assert cfg.length.config.max_length == 8 and cfg.max_new_tokens == 16 and cfg.output == "x.jsonl"
    # a nested wandb.config (W&B's nested parameters) is flattened
    nested = sweep.build_run_config({"selector": {"name": "swift", "skip_ratio": 0.4}, "limit": 1})
    assert nested.selector.name == "swift" and nested.selector.config.skip_ratio == 0.4


# ----------------------------------------------------------------------------- bad input


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
    monkeypatch.setattr(sweep, "train", lambda *a, **k: called.append(1))
    assert sweep.main([str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not called and not (tmp_path / "out").exists(), "nothing may run or be written"


# ----------------------------------------------------------------------------- running


def test_local_sweep_on_the_tiny_model_writes_the_table_and_offline_runs(tiny, prompts, tmp_path):
    model, tok = tiny
    path = _write(
        tmp_path,
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
    res = sweep.run_sweep(path, out_dir=out, model=model, tokenizer=tok, log=lines.append)
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
        data = _written(wandb_file, b"mean_accepted_tokens")
        assert data.startswith(b":W&B")  # W&B's transaction log header
        assert b"selector.skip_ratio" in data and b"mean_accepted_tokens" in data
    sync = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "sync", "--dry-run", *map(str, runs)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert sync.returncode == 0 and "Would sync 2 run(s)" in sync.stdout + sync.stderr, sync


def test_without_wandb_a_failing_trial_is_a_row_and_the_sweep_goes_on(tiny, prompts, tmp_path):
    model, tok = tiny
    path = _write(
        tmp_path,
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
    res = sweep.run_sweep(path, out_dir=out, mode="disabled", model=model, tokenizer=tok, log=lambda s: None)
    assert [r["status"] for r in res.rows] == ["failed", "ok"] and res.failed == 1
    assert "--selector.skip_attn must be block indices in [0, 3]" in res.rows[0]["error"]
    lines = res.table.splitlines()
    assert lines[2].startswith("| 2 | 1 |") and lines[3].startswith("| 1 | 7 |"), "failed trials sort last"
    assert not (tmp_path / "wandb").exists()


def test_an_interrupted_sweep_keeps_the_finished_trials(tmp_path, monkeypatch, prompts):
    path = _write(
        tmp_path, _yaml({"data": {"value": str(prompts)}, "length.threshold": {"values": [0.5, 0.6, 0.7]}})
    )
    calls = []

    def fake_train(params, **kw):
        calls.append(params)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {"params": params, "metrics": {"speedup": 1.5}, "output": "x.jsonl", "wandb_dir": None}

    monkeypatch.setattr(sweep, "train", fake_train)
    out = tmp_path / "out"
    assert sweep.main([str(path), "--out", str(out), "--no-wandb"]) == 130
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [1]
    assert "1 of 3 trials (interrupted)" in (out / "results.md").read_text()
    assert "| 1 | 0.5 | 1.500x |" in (out / "results.md").read_text()
    assert sweep.main([str(path), "--out", str(out), "--no-wandb"]) == 2, "an earlier sweep's directory"


def test_the_agent_command_runs_one_trial_from_wandb_config(tmp_path, monkeypatch):
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
        sweep.SMOKE_ENV: "1",
    }.items():
        monkeypatch.setenv(key, value)
    command = yaml.safe_load((ROOT / "experiments" / "sweeps" / "static.yaml").read_text())["command"]
    wandb.teardown()  # the agent starts a fresh process: settings are read from the environment again
    try:
        assert sweep.main(command[3:]) == 0
    finally:
        monkeypatch.delenv("WANDB_SWEEP_PARAM_PATH")
        wandb.teardown()
    meta = json.loads((tmp_path / "runs" / "sweeps" / "abc" / "run42.meta.json").read_text())
    assert meta["config"]["selector"]["config"]["skip_ratio"] == 0.5
    assert meta["config"]["length"]["config"]["threshold"] == 0.6
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*-run42")
    assert b"mean_accepted_tokens" in _written(next(run_dir.glob("*.wandb")), b"mean_accepted_tokens")


def test_wandb_mode_never_prompts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    assert sweep.wandb_mode()[0] == "offline" and "no API key" in sweep.wandb_mode()[1]
    with pytest.raises(sweep.SweepError, match="--online needs W&B credentials"):
        sweep.wandb_mode("online")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert sweep.wandb_mode()[0] == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    os.chmod(netrc, 0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert sweep.wandb_mode() == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert sweep.wandb_mode() == ("offline", None)


# ----------------------------------------------------------------------------- the tutorial

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
            code = sweep.main(shlex.split(line)[2:])
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


def test_tutorial_sweep_file_is_valid(tmp_path):
    """The example sweep file of the tutorial's last step validates."""
    (block,) = [
        b for b in re.findall(r"```yaml\n(.*?)```", TUTORIAL.read_text(), re.S) if "name: fixed-k" in b
    ]
    s = sweep.load_sweep(_write(tmp_path, yaml.safe_load(block)))
    trials = sweep.expand_trials(s)
    assert len(trials) == 6 and len(sweep.validate_trials(s, trials)) == 6
