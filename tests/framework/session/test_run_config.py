"""RunConfig: presets, override rules, errors named as flags, dict/YAML/JSON round trips, and the
command line generated from the fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import yaml

from framework import REGISTRIES
from framework.config_fields import ConfigError
from framework.drafting.gate import GateConfig
from framework.registry import UnknownNameError
from framework.runner.cli import main
from framework.session.flags import add_config_flags, config_overrides_from_args
from framework.session.presets import PRESET_DIR, list_presets
from framework.session.run_config import (
    FLAT_KEYS,
    SECTIONS,
    GenerationConfig,
    MethodConfig,
    RunConfig,
    RunnerConfig,
    StrategySpec,
    UnknownStrategyError,
    section_of,
)
from strategies.length.fixed import FixedLengthConfig
from strategies.selectors.static import StaticSelectorConfig


@pytest.mark.parametrize("name", list_presets())
def test_every_shipped_preset_builds_and_round_trips(name, tmp_path):
    cfg = RunConfig.from_preset(name)
    data = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
    assert cfg.method.name == name and cfg.method.baseline_only == bool(data.get("baseline_only", False))
    for kind in REGISTRIES:
        spec = getattr(cfg.method, kind)
        if kind in data:
            assert spec.name == data[kind]["name"]
            for field, value in data[kind].items():
                if field != "name":
                    got = getattr(spec.config, field)
                    assert got == (tuple(value) if isinstance(value, list) else value)
    assert cfg.method.gate == GateConfig(**data.get("gate", {}))
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    for suffix in (".yaml", ".json"):
        path = cfg.save(tmp_path / f"c{suffix}")
        assert RunConfig.load(path).to_dict() == cfg.to_dict()


def test_defaults_have_one_source():
    cfg = RunConfig.from_preset()
    assert cfg.to_dict() == RunConfig().to_dict()
    assert cfg.runner.logger == "wandb"
    assert (
        cfg.method.selector.name,
        cfg.method.length.name,
        cfg.method.drafter.name,
        cfg.method.verifier.name,
    ) == (
        "static",
        "confidence",
        "layer_skip",
        "greedy",
    )
    assert cfg.method.gate == GateConfig() and not cfg.method.gate.enabled


def test_overrides_plain_fields_typed_and_as_strings():
    cfg = RunConfig.from_preset("swift", max_new_tokens=64, model="tiny-random")
    assert (
        cfg.generation.max_new_tokens == 64
        and cfg.model.name_or_path == "tiny-random"
        and cfg.method.selector.name == "swift"
    )
    parsed = RunConfig.from_preset(
        None, max_new_tokens="64", categories="qa,rag", kernels="false", limit="none", stop_strings="a, b"
    )
    assert parsed.generation.max_new_tokens == 64 and parsed.data.categories == ("qa", "rag")
    assert parsed.model.kernels is False and parsed.data.limit is None
    assert parsed.generation.stop_strings == ("a, b",)  # one stop string, never split
    assert RunConfig.from_preset(None, categories=["qa"]).data.categories == ("qa",)
    # typed values are coerced, never spelled back as text: YAML's 8.0 for an int, a list
    typed = RunConfig.of(max_new_tokens=8.0, stop=["x", "y"], limit=2.0)
    assert typed.generation == GenerationConfig(max_new_tokens=8, stop_strings=("x", "y"))
    assert typed.data.limit == 2 and isinstance(typed.data.limit, int)


def test_sections_hold_every_field_and_take_flat_and_dotted_overrides():
    cfg = RunConfig.of(**{"generation.max_new_tokens": 12, "model.dtype": "float64", "data.limit": "3"})
    assert (cfg.generation.max_new_tokens, cfg.model.dtype, cfg.data.limit) == (12, "float64", 3)
    cfg = RunConfig.of(**{"generation.seed": 5, "runner.logger": "none", "method.length": "fixed"})
    assert cfg.generation.seed == 5 and cfg.runner.logger == "none" and cfg.method.length.name == "fixed"
    assert RunConfig.of(**{"model.name_or_path": "tiny-random"}).model.name_or_path == "tiny-random"
    assert RunConfig.of(model="tiny-random").model.name_or_path == "tiny-random"  # the flat key
    # every plain field sits in exactly one section, under one flat key
    seen = [(section, name) for section, name in FLAT_KEYS.values()]
    assert len(seen) == len(set(seen))
    for section, cls in SECTIONS.items():
        names = {f.name for f in dataclasses.fields(cls)} - {
            "selector",
            "length",
            "drafter",
            "verifier",
            "gate",
        }
        assert names == {n for s, n in seen if s == section}
    assert section_of("max_new_tokens") == "generation" and section_of("stop") == "generation"
    assert section_of("selector.skip_ratio") == section_of("gate") == "method"
    assert section_of("logger") == "runner" and section_of("model") == "model" and section_of("x") is None
    with pytest.raises(ConfigError, match="--generation.nope must be a field of the generation section"):
        RunConfig.of(**{"generation.nope": 1})
    with pytest.raises(ConfigError, match="--device must be auto or cuda with --devices > 1"):
        RunConfig.of(device="cuda:1", devices=2)


def test_a_flat_config_saved_before_the_sections_still_loads(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(
        "model: tiny-random\nmax_new_tokens: 16\nlogger: none\nselector: {name: static, skip_ratio: 0.3}\n"
    )
    cfg = RunConfig.load(old)
    assert cfg.model.name_or_path == "tiny-random" and cfg.generation.max_new_tokens == 16
    assert cfg.runner.logger == "none" and cfg.method.selector.config.skip_ratio == 0.3


def test_strategy_by_name_replaces_it_and_drops_the_presets_fields():
    base = RunConfig.from_preset("static_confidence")
    assert base.method.length.config.max_length == 12 and base.method.length.name == "confidence"
    other = RunConfig.from_preset("static_confidence", length="fixed")
    assert other.method.length == StrategySpec("fixed", FixedLengthConfig())
    same = RunConfig.from_preset("static_confidence", selector="static")
    assert same.method.selector == base.method.selector  # the preset's own strategy keeps its fields


def test_strategy_fields_by_dotted_key():
    cfg = RunConfig.from_preset("static_confidence", **{"selector.skip_ratio": 0.3})
    assert cfg.method.selector.config.skip_ratio == 0.3 and cfg.method.selector.name == "static"
    cfg = RunConfig.from_preset("swift", **{"selector.name": "static", "selector.skip_ratio": 0.3})
    assert cfg.method.selector == StrategySpec("static", StaticSelectorConfig(skip_ratio=0.3))
    cfg = RunConfig.from_preset(None, **{"selector.skip_ratio": 0.25, "length.max_length": "8"})
    assert cfg.method.selector.config.skip_ratio == 0.25 and cfg.method.length.config.max_length == 8
    # A dotted field applies to the strategy named beside it, whatever the order of the keys.
    cfg = RunConfig.from_preset("swift", **{"length.k": 3}, length="fixed")
    assert cfg.method.length == StrategySpec("fixed", FixedLengthConfig(k=3))
    cfg = RunConfig.from_preset("swift", **{"length.k": 3, "method.length": "fixed"})
    assert cfg.method.length == StrategySpec("fixed", FixedLengthConfig(k=3))


def test_gate_overrides():
    cfg = RunConfig.from_preset(None, **{"gate.enabled": "true", "gate.margin": "0.1"})
    assert cfg.method.gate == GateConfig(enabled=True, margin=0.1)
    assert RunConfig.from_preset(None, **{"gate.probe": 4}).method.gate.probe == 4


@pytest.mark.parametrize(
    ("overrides", "flag", "spelled"),
    [
        ({"gate": {"enabled": True}}, "--gate", "gate.enabled=True"),
        ({"gate": GateConfig(enabled=True, probe=4)}, "--gate", "gate.enabled=True, gate.probe=4"),
        ({"selector": {"skip_ratio": 0.3}}, "--selector", "selector.skip_ratio=0.3"),
        (
            {"selector": {"name": "static", "skip_ratio": 0.3}},
            "--selector",
            "selector.name='static', selector.skip_ratio=0.3",
        ),
        ({"length": FixedLengthConfig(k=2)}, "--length", "length.k=2"),
        (
            {"length": StrategySpec("fixed", FixedLengthConfig(k=7))},
            "--length",
            "length.name='fixed', length.k=7",
        ),
        ({"generation": {"seed": 5}}, "--generation", "generation.seed=5"),
        ({"runner": RunnerConfig(logger="none")}, "--runner", "runner.logger='none'"),
        ({"model": {"name_or_path": "tiny-random"}}, "--model", "model.name_or_path='tiny-random'"),
        ({"method": {"length": "fixed"}}, "--method", "method.length='fixed'"),
        ({"method.gate": {"enabled": True}}, "--gate", "gate.enabled=True"),
    ],
)
def test_the_spellings_that_went_are_refused_with_the_dotted_keys_that_say_the_same(overrides, flag, spelled):
    """Issue 39, item 4: overrides come in two spellings, flat names and dotted keys; a whole
    section, strategy or gate as a mapping or an object is refused, and the message says it in
    dotted keys."""
    with pytest.raises(ConfigError) as err:
        RunConfig.from_preset("static_confidence", **overrides)
    message = str(err.value)
    assert message.startswith(f"{flag} must be ")
    assert f"overrides are flat names or dotted keys: write {spelled})" in message
    with pytest.raises(ConfigError, match="overrides are flat names or dotted keys"):
        RunConfig.of().replace(**overrides)


def test_the_dotted_keys_an_error_names_give_what_the_old_spelling_meant():
    for old, dotted in [
        ({"gate": {"enabled": True, "probe": 4}}, {"gate.enabled": True, "gate.probe": 4}),
        (
            {"selector": {"name": "static", "skip_ratio": 0.3}},
            {"selector.name": "static", "selector.skip_ratio": 0.3},
        ),
        ({"generation": {"seed": 5}}, {"generation.seed": 5}),
    ]:
        with pytest.raises(ConfigError) as err:
            RunConfig.from_preset("swift", **old)
        named = str(err.value).split("write ", 1)[1].split(")", 1)[0]
        parsed = dict(item.split("=", 1) for item in named.split(", "))
        assert set(parsed) == set(dotted)
        cfg = RunConfig.from_preset("swift", **dotted)
        key = next(iter(old))
        assert getattr(cfg.method if key in ("gate", "selector") else cfg, key) is not None


def test_replace_starts_from_self():
    cfg = RunConfig.from_preset("swift", max_new_tokens=32, **{"selector.work_budget": 0.05})
    new = cfg.replace(limit=2, **{"gate.enabled": True})
    assert new.data.limit == 2 and new.generation.max_new_tokens == 32
    assert new.method.selector == cfg.method.selector
    assert new.method.gate.enabled and new.method.name == "swift"
    assert cfg.replace(selector="static").method.selector == StrategySpec("static", StaticSelectorConfig())
    assert cfg.replace(selector="swift").method.selector == cfg.method.selector
    # A config built by hand (config None: the defaults) works the same way.
    hand = RunConfig(method=MethodConfig(length=StrategySpec("fixed")))
    assert hand.replace(**{"length.k": 2}).method.length == StrategySpec("fixed", FixedLengthConfig(k=2))
    assert hand.to_dict()["method"]["length"] == {"name": "fixed", "k": FixedLengthConfig().k}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"selector.skip_ratio": 1.5}, "--selector.skip_ratio must be in [0, 1), got 1.5"),
        ({"selector.skip_ratio": "abc"}, "--selector.skip_ratio must be a number (float), got 'abc'"),
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
        ({"gate.nope": 1}, "--gate.nope must be a field of GateConfig"),
        (
            {"gate": 3},
            "--gate must be set field by field (overrides are flat names or dotted keys: write gate.<field>=VALUE), got 3",
        ),
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
        **{"gate.enabled": True, "selector.skip_attn": (1,)},
    )
    d = cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # only plain YAML types
    method = d["method"]
    assert method["selector"]["name"] == "static" and method["selector"]["skip_attn"] == [1]
    assert method["gate"]["enabled"] is True and d["data"]["categories"] == ["qa", "rag"]
    assert RunConfig.from_dict(d) == cfg
    assert list(d) == [f.name for f in dataclasses.fields(RunConfig)] == list(SECTIONS)
    # the metadata form stays flat, with the keys of the files written before the sections
    flat = cfg.describe()
    assert flat["max_new_tokens"] == 128 and flat["categories"] == ["qa", "rag"] and flat["model"] is None
    assert flat["selector"]["name"] == "static" and flat["gate"]["enabled"] is True


def test_generated_flags_cover_every_field_and_read_back_as_overrides():
    parser = argparse.ArgumentParser()
    add_config_flags(parser, RunConfig, exclude=("output", "compare"))  # run.py's flags
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
        "generation.max_new_tokens": "64",
        "selector.skip_ratio": "0.3",
        "runner.plots": False,
        "generation.stop_strings": ("a",),
        "gate.enabled": "true",
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--output", "x"])  # excluded
    cfg = RunConfig.from_preset(None, **config_overrides_from_args(args))
    assert (
        cfg.generation.max_new_tokens == 64
        and cfg.method.selector.config.skip_ratio == 0.3
        and cfg.method.gate.enabled
    )


def test_print_config_file_then_config_file_gives_the_same_config(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    argv = ["--method", "swift", "--max-new-tokens", "64", "--gate.enabled", "--length.threshold", "0.7"]
    assert main([*argv, "--print-config", str(path)]) == 0
    want = RunConfig.from_preset(
        "swift", max_new_tokens=64, **{"gate.enabled": True, "length.threshold": 0.7}
    )
    loaded = RunConfig.load(path)  # with the command line that wrote it (the report's)
    assert loaded.compare.command == f"python experiments/run.py {' '.join(argv)} --print-config {path}"
    assert loaded.replace(command="") == want
    capsys.readouterr()
    assert main(["--config", str(path), "--print-config"]) == 0
    again = RunConfig.from_dict(yaml.safe_load(capsys.readouterr().out))
    assert again.compare.command == f"python experiments/run.py --config {path} --print-config"
    assert again.replace(command="") == want


def test_a_methods_settings_say_what_it_runs():
    assert RunConfig.from_preset("vanilla").method.settings() == {"baseline_only": True}
    settings = RunConfig.from_preset("static_confidence", **{"selector.skip_ratio": 0.3}).method.settings()
    assert set(settings) == {"selector", "length", "drafter", "verifier", "gate"}
    assert settings["selector"] == {
        "name": "static",
        "config": {**settings["selector"]["config"], "skip_ratio": 0.3},
    }
    assert settings["gate"]["enabled"] is True


def test_typos_get_a_did_you_mean_and_a_preset_files_errors_name_the_file(tmp_path, capsys):
    """Issue 48, item 8: a mistyped preset, key, field or flag gets the closest name; a field error
    inside a YAML preset names the file and the field, not a flag."""
    import pytest

    from framework.config_fields import ConfigError
    from framework.runner.cli import build_parser
    from framework.session.run_config import RunConfig

    with pytest.raises(ConfigError, match="did you mean 'hybrid'"):
        RunConfig.from_preset("hybird")
    with pytest.raises(ConfigError, match="did you mean 'max_new_tokens'"):
        RunConfig.from_preset(None, max_new_token=3)
    typo = tmp_path / "mine.yaml"
    typo.write_text("selector: {name: static, skip_ratoi: 0.2}\n")
    with pytest.raises(
        ConfigError, match=r"mine.yaml: selector.skip_ratoi must be a field .* did you mean 'skip_ratio'"
    ):
        RunConfig.from_preset(str(typo))
    bad = tmp_path / "range.yaml"
    bad.write_text("selector: {name: static, skip_ratio: 2.0}\n")
    with pytest.raises(ConfigError, match=r"^.*range.yaml: selector.skip_ratio must be in"):
        RunConfig.from_preset(str(bad))
    with pytest.raises(ConfigError, match=r"^--selector.skip_ratio must be in"):  # a flag's own error
        RunConfig.from_preset("static_confidence", **{"selector.skip_ratio": 2.0})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--selector.skip_ratoi", "0.3"])
    assert "did you mean --selector.skip_ratio?" in capsys.readouterr().err
