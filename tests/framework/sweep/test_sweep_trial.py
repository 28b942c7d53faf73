"""A sweep trial (framework/sweep/trial.py): parameter names and values -> `RunConfig` (through
`RunConfig.from_preset`, no command-line parser), and W&B's mode."""

from __future__ import annotations

import os

import pytest

import framework.sweep.trial as trial
from framework.session.run_config import RunConfig
from framework.sweep import SweepError


def test_parameters_are_spelled_as_on_the_command_line():
    cfg = trial.build_run_config(
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
    assert (
        cfg.method.selector.config.skip_attn == (1, 2) and cfg.method.selector.config.keep_first_last is False
    )
    assert cfg.data.categories == ("qa", "code") and cfg.generation.stop_strings == ("END", "STOP")
    assert (
        cfg.method.length.config.max_length == 8
        and cfg.generation.max_new_tokens == 16
        and cfg.runner.output == "x.jsonl"
    )
    # a nested wandb.config (W&B's nested parameters) is flattened
    nested = trial.build_run_config({"selector": {"name": "swift", "skip_ratio": 0.4}, "limit": 1})
    assert nested.method.selector.name == "swift" and nested.method.selector.config.skip_ratio == 0.4


def test_wandb_mode_never_prompts(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    assert trial.wandb_mode()[0] == "offline" and "no API key" in trial.wandb_mode()[1]
    with pytest.raises(SweepError, match="--online needs W&B credentials"):
        trial.wandb_mode("online")
    monkeypatch.setenv("WANDB_MODE", "online")
    assert trial.wandb_mode()[0] == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    os.chmod(netrc, 0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert trial.wandb_mode() == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert trial.wandb_mode() == ("offline", None)


def test_a_trial_config_is_the_preset_with_the_parameters():
    cfg = trial.build_run_config(
        {"method": "swift", "max_new_tokens": 64, "selector.skip_ratio": 0.3, "gate.enabled": "false"}
    )
    want = RunConfig.from_preset(
        "swift", max_new_tokens=64, **{"selector.skip_ratio": 0.3, "gate.enabled": False}
    )
    assert cfg == want and cfg.method.name == "swift"
    # the short flags and the negated booleans of run.py
    cfg = trial.build_run_config(
        {"method": "selfsd", "skip_set": "s.json", "no_plots": True, "kernels": "false"}
    )
    assert (
        cfg.method.selector.config.skip_set == "s.json"
        and cfg.runner.plots is False
        and cfg.model.kernels is False
    )


def test_parameter_names_come_from_the_run_config():
    options = trial.run_options()
    for name in (
        "max_new_tokens",
        "limit",
        "categories",
        "stop",
        "selector",
        "skip_set",
        "no_plots",
        "method",
    ):
        assert name in options, name
    assert options["stop"].key == "stop_strings" and options["stop"].repeat
    assert options["skip_set"].key == "selector.skip_set"
    assert options["no_kernels"] == trial.RunOption("kernels", negate=True)
    assert "output" not in options
    with pytest.raises(SweepError, match="'threshold' is not a run option .did you mean length.threshold"):
        trial.check_names(["threshold"])
    with pytest.raises(SweepError, match="'colour.x' is not a run option"):
        trial.check_names(["colour.x"])
