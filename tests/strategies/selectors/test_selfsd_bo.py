"""strategies/selectors/selfsd_bo.py: the offline Bayesian search, its saved result and its reuse."""

from __future__ import annotations

import json

import pytest

import strategies.selectors.selfsd_bo as selfsd
from framework import LayerPlan
from framework.config_fields import ConfigError, build_config
from framework.engine.adapter import adapter_for
from framework.runner.cli import build_parser, config_from_args
from framework.testing import LayerSelectorContract, cached_tiny_model, prepare_context, tiny_model
from strategies.selectors.selfsd_bo import SelfSDConfig, SelfSDSelector, load_skip_set
from strategies.selectors.static import uniform_plan

FAST = {"iterations": 4, "calib_limit": 2, "calib_max_new_tokens": 8}


def make(**kw) -> SelfSDSelector:
    return SelfSDSelector(build_config(SelfSDConfig, {**FAST, **kw}))


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(cached_tiny_model("llama", 6, seed=1))


def searched(adapter, tmp_path, **kw) -> SelfSDSelector:
    sel = make(save_to=str(tmp_path / "set.json"), **kw)
    sel.setup(adapter.arch.info())
    sel.prepare(prepare_context(adapter))
    return sel


class TestSelfSDContract(LayerSelectorContract):
    def make(self):
        return make()


def test_search_writes_a_complete_result_file(adapter, tmp_path):
    sel = searched(adapter, tmp_path, initial_random=1)
    data = json.loads((tmp_path / "set.json").read_text())
    assert data["format"] == selfsd.FORMAT and data["num_layers"] == 6 and data["dtype"] == "float32"
    assert data["fingerprint"] == adapter.arch.fingerprint()
    assert [r["source"] for r in data["trace"]] == ["probe", "probe", "random", "gp"]
    # the probes are the uniform sets at the configured ratios, evaluated first
    assert data["trace"][0]["bits"] == list(uniform_plan(6, 0.1, False).to_bits())
    assert data["trace"][1]["bits"] == list(uniform_plan(6, 0.2, False).to_bits())
    best = max(data["trace"], key=lambda r: r["tokens_per_s_model"])
    assert data["bits"] == best["bits"] and data["objective"]["value"] == pytest.approx(
        best["tokens_per_s_model"], abs=1e-3
    )
    assert sel.plan(None) == LayerPlan.from_bits(data["bits"])
    for row in data["trace"]:
        assert 0 <= row["alpha"] <= 1 and row["M"] >= 1 and row["tokens_per_s_wall"] > 0
    assert data["gp_fits"] == 1
    assert sel.summary()["source"] == "search" and sel.summary()["iterations"] == 4


def test_cost_model_objective_is_deterministic(adapter, tmp_path):
    """Greedy decoding with a fixed cost model scores a set the same every time (wall time would not)."""
    a = searched(adapter, tmp_path / "a")
    b = searched(adapter, tmp_path / "b")
    ta = json.loads((tmp_path / "a" / "set.json").read_text())["trace"]
    tb = json.loads((tmp_path / "b" / "set.json").read_text())["trace"]
    assert [r["tokens_per_s_model"] for r in ta] == [r["tokens_per_s_model"] for r in tb]
    assert [r["bits"] for r in ta] == [r["bits"] for r in tb]
    assert a.plan(None) == b.plan(None)


def test_saved_set_round_trips_without_searching(adapter, tmp_path, monkeypatch):
    first = searched(adapter, tmp_path)
    monkeypatch.setattr(
        selfsd, "search", lambda *a, **k: pytest.fail("a saved skip set must not be searched again")
    )
    again = make(skip_set=str(tmp_path / "set.json"))
    again.setup(adapter.arch.info())
    assert again.plan(None) == first.plan(None)  # usable right after setup
    again.prepare(prepare_context(adapter))
    assert again.plan(None) == first.plan(None)
    assert again.summary()["source"] == "file"


def test_context_store_shares_one_search(adapter, monkeypatch):
    calls = []
    real = selfsd.search
    monkeypatch.setattr(selfsd, "search", lambda ctx, c: calls.append(1) or real(ctx, c))
    ctx = prepare_context(adapter)
    plans = []
    for _ in range(2):  # e.g. the runner's rebuild after warm-up
        sel = make()
        sel.setup(adapter.arch.info())
        sel.prepare(ctx)
        plans.append(sel.plan(None))
    assert len(calls) == 1 and plans[0] == plans[1]


def test_keep_first_last_pins_the_end_blocks(adapter, tmp_path):
    searched(adapter, tmp_path, keep_first_last=True, iterations=5)
    for row in json.loads((tmp_path / "set.json").read_text())["trace"]:
        bits = row["bits"]
        assert bits[0] == bits[5] == bits[6] == bits[11] == 0


def test_plan_before_prepare_is_a_clear_error(adapter):
    sel = make()
    sel.setup(adapter.arch.info())
    with pytest.raises(RuntimeError, match="no skip set"):
        sel.plan(None)


def test_bad_skip_set_files(adapter, tmp_path):
    with pytest.raises(ConfigError, match="existing file"):
        load_skip_set(tmp_path / "missing.json", 6)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="readable JSON"):
        load_skip_set(tmp_path / "bad.json", 6)
    (tmp_path / "other.json").write_text(json.dumps({"bits": [0] * 12}))
    with pytest.raises(ConfigError, match="format"):
        load_skip_set(tmp_path / "other.json", 6)
    searched(adapter, tmp_path)
    with pytest.raises(ConfigError, match="8-block model"):
        load_skip_set(tmp_path / "set.json", 8)


def test_skip_set_from_other_weights_is_refused(adapter, tmp_path):
    searched(adapter, tmp_path)
    other = adapter_for(tiny_model("llama", 6, seed=7))
    sel = make(skip_set=str(tmp_path / "set.json"))
    sel.setup(other.arch.info())
    with pytest.raises(ConfigError, match="searched on other weights"):
        sel.prepare(prepare_context(other))


def test_bad_config():
    for field, value, match in [
        ("iterations", 0, "iterations"),
        ("calib_limit", 0, "calib_limit"),
        ("objective", "speed", "objective"),
        ("probe_ratios", (1.0,), "probe_ratios"),
        ("kappa", 0.0, "kappa"),
    ]:
        with pytest.raises(ConfigError, match=match):
            build_config(SelfSDConfig, {field: value})


def test_bad_calibration_data(adapter, tmp_path):
    sel = make(calib_data=str(tmp_path / "nope.jsonl"))
    sel.setup(adapter.arch.info())
    with pytest.raises(ConfigError, match="calib_data"):
        sel.prepare(prepare_context(adapter))


def test_cli_short_flags():
    args = build_parser().parse_args(
        ["--selector", "selfsd_bo", "--skip-set", "s.json", "--calib-data", "c.jsonl", "--calib-limit", "3"]
    )
    cfg = config_from_args(args).method.selector.config
    assert (cfg.skip_set, cfg.calib_data, cfg.calib_limit) == ("s.json", "c.jsonl", 3)


def test_cache_searches_a_model_once_across_runs(adapter, tmp_path, monkeypatch):
    """cache=True: the first run searches and keeps the result in <cache>/skipsets/; a later run
    (a new context, as a new process would have) reuses it; other settings or weights search again."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    calls = []
    real = selfsd.search
    monkeypatch.setattr(selfsd, "search", lambda ctx, c: calls.append(1) or real(ctx, c))

    def run(model_adapter, **kw):
        sel = make(cache=True, **kw)
        sel.setup(model_adapter.arch.info())
        sel.prepare(prepare_context(model_adapter))
        return sel

    first = run(adapter)
    assert len(calls) == 1 and first.summary()["source"] == "search"
    files = list((tmp_path / "cache" / "skipsets").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["bits"] == list(first.plan(None).to_bits())
    again = run(adapter)
    assert len(calls) == 1, "the cached search must be reused"
    assert again.plan(None) == first.plan(None) and again.summary()["source"] == "cache"
    run(adapter, seed=2)  # other search settings: another search, another file
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "skipsets").glob("*.json"))) == 2
    other = adapter_for(tiny_model("llama", num_layers=6, seed=7))  # other weights
    run(other)
    assert len(calls) == 3
    # A corrupt cache file is searched again, not trusted.
    files[0].write_text("{not json")
    run(adapter)
    assert len(calls) == 4


def test_cache_is_off_by_default_and_on_in_the_self_sd_presets():
    from framework.session.run_config import RunConfig

    assert SelfSDConfig().cache is False
    for name in ("selfsd", "selfsd_safe", "selfsd_sampling"):
        assert RunConfig.from_preset(name).method.selector.config.cache is True, name
