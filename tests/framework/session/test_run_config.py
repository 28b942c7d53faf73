"""RunConfig: presets, override rules, errors named as flags, dict/YAML/JSON round trips, and the
command line generated from the fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import yaml

from framework import REGISTRIES
from framework.config import ConfigError
from framework.drafting.gate import GateConfig
from framework.experiment.cli import main
from framework.registry import UnknownNameError
from framework.session.config import RunConfig, StrategySpec, UnknownStrategyError
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.presets import PRESET_DIR, list_presets
from strategies.length.fixed import FixedLengthConfig
from strategies.selectors.static import StaticSelectorConfig


@pytest.mark.parametrize("name", list_presets())
def test_every_shipped_preset_builds_and_round_trips(name, tmp_path):
    cfg = RunConfig.from_preset(name)
    data = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
    assert cfg.name == name and cfg.baseline_only == bool(data.get("baseline_only", False))
    for kind in REGISTRIES:
        spec = getattr(cfg, kind)
        if kind in data:
            assert spec.name == data[kind]["name"]
            for field, value in data[kind].items():
                if field != "name":
                    got = getattr(spec.config, field)
                    assert got == (tuple(value) if isinstance(value, list) else value)
    assert cfg.gate == GateConfig(**data.get("gate", {}))
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    for suffix in (".yaml", ".json"):
        path = cfg.save(tmp_path / f"c{suffix}")
        assert RunConfig.load(path).to_dict() == cfg.to_dict()


def test_defaults_have_one_source():
    cfg = RunConfig.from_preset()
    assert cfg.to_dict() == RunConfig().to_dict()
    assert cfg.logger == "wandb"
    assert (cfg.selector.name, cfg.length.name, cfg.drafter.name, cfg.verifier.name) == (
        "static",
        "confidence",
        "layer_skip",
        "greedy",
    )
    assert cfg.gate == GateConfig() and not cfg.gate.enabled


def test_overrides_plain_fields_typed_and_as_strings():
    cfg = RunConfig.from_preset("swift", max_new_tokens=64, model="tiny-random")
    assert cfg.max_new_tokens == 64 and cfg.model == "tiny-random" and cfg.selector.name == "swift"
    parsed = RunConfig.from_preset(
        None, max_new_tokens="64", categories="qa,rag", kernels="false", limit="none", stop_strings="a, b"
    )
    assert parsed.max_new_tokens == 64 and parsed.categories == ("qa", "rag") and parsed.kernels is False
    assert parsed.limit is None
    assert parsed.stop_strings == ("a, b",)  # one stop string, never split
    assert RunConfig.from_preset(None, categories=["qa"]).categories == ("qa",)


def test_strategy_by_name_replaces_it_and_drops_the_presets_fields():
    base = RunConfig.from_preset("static_confidence")
    assert base.length.config.max_length == 12 and base.length.name == "confidence"
    other = RunConfig.from_preset("static_confidence", length="fixed")
    assert other.length == StrategySpec("fixed", FixedLengthConfig())
    same = RunConfig.from_preset("static_confidence", selector="static")
    assert same.selector == base.selector  # the preset's own strategy keeps its fields


def test_strategy_by_mapping_spec_config_and_dotted_key():
    cfg = RunConfig.from_preset("static_confidence", selector={"skip_ratio": 0.3})
    assert cfg.selector.config.skip_ratio == 0.3 and cfg.selector.name == "static"
    cfg = RunConfig.from_preset("swift", selector={"name": "static", "skip_ratio": 0.3})
    assert cfg.selector == StrategySpec("static", StaticSelectorConfig(skip_ratio=0.3))
    cfg = RunConfig.from_preset(None, **{"selector.skip_ratio": 0.25, "length.max_length": "8"})
    assert cfg.selector.config.skip_ratio == 0.25 and cfg.length.config.max_length == 8
    # A dotted field applies to the strategy named beside it, whatever the order of the keys.
    cfg = RunConfig.from_preset("swift", **{"length.k": 3}, length="fixed")
    assert cfg.length == StrategySpec("fixed", FixedLengthConfig(k=3))
    cfg = RunConfig.from_preset(None, length=FixedLengthConfig(k=2))
    assert cfg.length == StrategySpec("fixed", FixedLengthConfig(k=2))
    cfg = RunConfig.from_preset(None, length=StrategySpec("fixed", FixedLengthConfig(k=7)))
    assert cfg.length.config.k == 7


def test_gate_overrides():
    assert RunConfig.from_preset(None, gate={"enabled": True}).gate == GateConfig(enabled=True)
    assert RunConfig.from_preset(None, gate=GateConfig(enabled=True, probe=4)).gate.probe == 4
    cfg = RunConfig.from_preset(None, **{"gate.enabled": "true", "gate.margin": "0.1"})
    assert cfg.gate == GateConfig(enabled=True, margin=0.1)


def test_replace_starts_from_self():
    cfg = RunConfig.from_preset("swift", max_new_tokens=32, **{"selector.work_budget": 0.05})
    new = cfg.replace(limit=2, gate={"enabled": True})
    assert new.limit == 2 and new.max_new_tokens == 32 and new.selector == cfg.selector
    assert new.gate.enabled and new.name == "swift"
    assert cfg.replace(selector="static").selector == StrategySpec("static", StaticSelectorConfig())
    assert cfg.replace(selector="swift").selector == cfg.selector
    # A config built by hand (config None: the defaults) works the same way.
    hand = RunConfig(length=StrategySpec("fixed"))
    assert hand.replace(**{"length.k": 2}).length == StrategySpec("fixed", FixedLengthConfig(k=2))
    assert hand.to_dict()["length"] == {"name": "fixed", "k": FixedLengthConfig().k}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"selector.skip_ratio": 1.5}, "--selector.skip_ratio must be in [0, 1), got 1.5"),
        ({"selector": {"skip_ratio": "abc"}}, "--selector.skip_ratio must be a number (float), got 'abc'"),
        (
            {"length": "fixed", "length.threshold": 0.5},
            "--length.threshold must be a field of FixedLengthConfig",
        ),
        ({"max_new_tokens": 0}, "--max-new-tokens must be an integer >= 1, got 0"),
        ({"max_new_tokens": "x"}, "--max-new-tokens must be a number (int), got 'x'"),
        ({"num_nodes": 0}, "--num-nodes must be an integer >= 1, got 0"),
        ({"stop_strings": 3}, "--stop must be a tuple of strings, got 3"),
        (
            {"dtype": "float8"},
            "--dtype must be one of float32, float16, bfloat16, float64, auto, got 'float8'",
        ),
        ({"logger": "tensorboard"}, "--logger must be one of wandb, csv, none, got 'tensorboard'"),
        ({"gate.margin": 0.9}, "--gate.margin must be in [-0.5, 0.5], got 0.9"),
        ({"gate": {"nope": 1}}, "--gate.nope must be a field of GateConfig"),
        ({"gate": 3}, "--gate must be a GateConfig or a mapping of its fields, got 3"),
        ({"no_such_field": 1}, "--no-such-field must be a RunConfig field"),
        ({"sampler.x": 1}, "--sampler.x must be <kind>.<field>"),
        ({"kernels": "maybe"}, "--kernels must be a boolean (true/false), got 'maybe'"),
        ({"resume": 1}, "--resume must be a boolean (true/false), got 1"),
    ],
)
def test_errors_name_the_flag(overrides, message):
    with pytest.raises(ConfigError) as exc:
        RunConfig.from_preset(None, **overrides)
    assert message in str(exc.value)


def test_unknown_strategy_is_a_config_error_with_a_suggestion():
    with pytest.raises(UnknownStrategyError) as exc:
        RunConfig.from_preset(None, selector="statik")
    assert isinstance(exc.value, ConfigError) and isinstance(exc.value, UnknownNameError)
    assert "--selector: unknown selector 'statik'. Did you mean 'static'?" in str(exc.value)


def test_bad_preset_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="--method must be a preset"):
        RunConfig.from_preset("no_such_preset")
    with pytest.raises(ConfigError, match="--config must be a saved RunConfig file"):
        RunConfig.load(tmp_path / "missing.yaml")
    odd = tmp_path / "odd.yaml"
    odd.write_text("model: x\nsampler: {name: y}\n")
    with pytest.raises(ConfigError, match="--sampler must be a RunConfig field"):
        RunConfig.load(odd)
    with pytest.raises(ConfigError, match="--config must be a mapping"):
        RunConfig.from_dict([1, 2])


def test_to_dict_is_plain_and_from_dict_inverts_it(tmp_path):
    cfg = RunConfig.from_preset(
        "hybrid",
        categories="qa,rag",
        stop_strings=("###",),
        gate={"enabled": True},
        **{"selector.skip_attn": (1,)},
    )
    d = cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # only plain YAML types
    assert d["selector"]["name"] == "static" and d["selector"]["skip_attn"] == [1]
    assert d["gate"]["enabled"] is True and d["categories"] == ["qa", "rag"]
    assert RunConfig.from_dict(d) == cfg
    assert list(d) == [f.name for f in dataclasses.fields(RunConfig)]


def test_generated_flags_cover_every_field_and_read_back_as_overrides():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, RunConfig, exclude=("output",))
    args = parser.parse_args(
        [
            "--max-new-tokens",
            "64",
            "--selector.skip_ratio",
            "0.3",
            "--no-plots",
            "--stop",
            "a",
            "--gate.enabled",
        ]
    )
    assert config_overrides_from_args(args) == {
        "max_new_tokens": "64",
        "selector.skip_ratio": "0.3",
        "plots": False,
        "stop_strings": ("a",),
        "gate.enabled": "true",
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--output", "x"])  # excluded
    cfg = RunConfig.from_preset(None, **config_overrides_from_args(args))
    assert cfg.max_new_tokens == 64 and cfg.selector.config.skip_ratio == 0.3 and cfg.gate.enabled


def test_print_config_file_then_config_file_gives_the_same_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    argv = ["--method", "swift", "--max-new-tokens", "64", "--gate.enabled", "--length.threshold", "0.7"]
    assert main([*argv, "--print-config", str(path)]) == 0
    want = RunConfig.from_preset(
        "swift", max_new_tokens=64, gate={"enabled": True}, **{"length.threshold": 0.7}
    )
    assert RunConfig.load(path) == want
    capsys.readouterr()
    assert main(["--config", str(path), "--print-config"]) == 0
    assert RunConfig.from_dict(yaml.safe_load(capsys.readouterr().out)) == want
