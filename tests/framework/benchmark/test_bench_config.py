"""The benchmark's configuration (the ``compare`` section, framework/session/sections.py, and how
its method names resolve, framework/session/methods.py) and how a preset method's `RunConfig` is
built (`preset_run_config`: no command-line round trip)."""

from __future__ import annotations

import pytest

from framework.config_fields import ConfigError
from framework.runner.pipeline import run
from framework.session.methods import MethodSpec, parse_methods, preset_run_config
from framework.session.methods import specs as methods_of
from framework.session.run_config import RunConfig


def test_methods_resolve_with_vanilla_first():
    specs = parse_methods(["hf_generate", "static_confidence"])
    assert [(s.label, s.kind) for s in specs] == [
        ("vanilla", "baseline"),
        ("hf_generate", "hf"),
        ("static_confidence", "preset"),
    ]


def test_preset_file_is_a_method(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("selector: {name: static, skip_ratio: 0.3}\nlength: {name: fixed}\n")
    cfg = RunConfig.of(methods=("vanilla", str(path)))
    (spec,) = [s for s in methods_of(cfg) if s.kind == "preset"]
    assert (spec.label, spec.source) == ("mine", str(path))
    rc = preset_run_config(spec, cfg)
    assert (
        rc.method.selector.config.skip_ratio == 0.3
        and rc.method.length.name == "fixed"
        and rc.method.name == "mine"
    )


def test_from_overrides_splits_benchmark_and_run_options():
    cfg = RunConfig.of(
        methods="vanilla,hf_generate", repeats="3", max_new_tokens="16", categories="qa,rag", plots=False
    )
    assert cfg.compare.methods == ("vanilla", "hf_generate") and cfg.compare.repeats == 3
    assert (
        cfg.generation.max_new_tokens == 16
        and cfg.data.categories == ("qa", "rag")
        and cfg.runner.plots is False
    )
    assert cfg.describe()["max_new_tokens"] == 16 and cfg.describe()["methods"] == ["vanilla", "hf_generate"]
    with pytest.raises(ConfigError, match="--repeats must be a number"):
        RunConfig.of(repeats="many")
    with pytest.raises(ConfigError, match="--max-new-tokens must be an integer >= 1"):
        RunConfig.of(max_new_tokens="0")
    with pytest.raises(ConfigError, match="--no-such-option must be a RunConfig field"):
        RunConfig.of(no_such_option=1)


@pytest.mark.parametrize(
    ("methods", "preset_args", "named"),
    [
        (("vanilla", "static_confidence", "selfsd_sampling"), (), "selfsd_sampling"),
        (("vanilla", "layerskip_static"), (("layerskip_static", "--verifier sampling"),), "layerskip_static"),
        (
            ("vanilla", "static_confidence"),
            (("static_confidence", "--verifier sampling"),),
            "static_confidence",
        ),
    ],
    ids=["preset", "preset-args", "raw-companion-too"],
)
def test_a_sampling_method_is_refused_with_the_config_before_any_model_loads(methods, preset_args, named):
    """The comparison is greedy: a method whose verifier samples is refused when the config is
    built, not after the model has loaded and the methods before it have prepared."""
    with pytest.raises(ConfigError, match=f"a greedy preset .*got '{named}'"):
        RunConfig.of(methods=methods, preset_args=preset_args)


def test_preset_args_and_skip_set_reach_the_preset(tmp_path):
    cfg = RunConfig.of(
        max_new_tokens=32,
        dtype="float64",
        methods=("vanilla", "static_confidence", "selfsd"),
        preset_args=(("static_confidence", "--selector.skip_ratio 0.5 --length.threshold 0.9"),),
        skip_set=str(tmp_path / "s.skipset.json"),
    )
    rc = preset_run_config(MethodSpec("static_confidence", "preset", "static_confidence"), cfg)
    assert rc.method.selector.config.skip_ratio == 0.5 and rc.method.length.config.threshold == 0.9
    assert rc.method.label == "static_confidence"
    assert (rc.generation.max_new_tokens, rc.model.dtype) == (32, "float64"), (
        "the shared run options reach the preset"
    )
    rc = preset_run_config(MethodSpec("selfsd", "preset", "selfsd"), cfg)
    assert rc.method.selector.config.skip_set == str(tmp_path / "s.skipset.json")
    with pytest.raises(ConfigError, match="records.jsonl exists"):
        (tmp_path / "records.jsonl").write_text("{}\n")
        run(RunConfig.of(methods=("vanilla", "hf_generate"), output=str(tmp_path)), model=object())
