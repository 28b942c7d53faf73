"""strategies/selectors/static.py: the contract, uniform plans, explicit sets, validation."""

from __future__ import annotations

import math

import pytest

from framework import LayerPlan, ModelInfo
from framework.config_fields import ConfigError, build_config
from framework.testing import LayerSelectorContract
from strategies.selectors.static import StaticSelector, StaticSelectorConfig, uniform_plan


def _info(num_layers: int) -> ModelInfo:
    return ModelInfo(num_layers=num_layers, hidden_size=64, vocab_size=128, max_context=512)


class TestStaticDefaultContract(LayerSelectorContract):
    def make(self):
        return StaticSelector()


class TestStaticHalfContract(LayerSelectorContract):
    def make(self):
        return StaticSelector(StaticSelectorConfig(skip_ratio=0.5))


class TestStaticExplicitContract(LayerSelectorContract):
    def make(self):
        return StaticSelector(StaticSelectorConfig(skip_attn=(0, 2, 3), skip_mlp=(1, 2)))


def _skipped(plan: LayerPlan) -> tuple[list[int], list[int]]:
    n = plan.num_layers
    return [i for i in range(n) if plan.attn_skip[i]], [i for i in range(n) if plan.mlp_skip[i]]


@pytest.mark.parametrize("num_layers", [3, 4, 5, 8, 12, 30])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.2, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 0.99])
def test_uniform_plan_counts_and_spread(num_layers, ratio):
    plan = uniform_plan(num_layers, ratio)
    eligible = num_layers - 2
    n = math.floor(ratio * 2 * eligible)
    attn, mlp = _skipped(plan)
    assert plan.num_skipped == n and plan.exit_layer is None
    assert len(attn) == (n + 1) // 2 and len(mlp) == n // 2  # attention gets the odd one
    # first and last blocks kept (SWIFT's convention)
    for i in (0, num_layers - 1):
        assert plan.runs_attn(i) and plan.runs_mlp(i)
    # each kind spread evenly over blocks 1..L-2: consecutive picks differ by floor or ceil of m / k
    for picks in (attn, mlp):
        if len(picks) > 1:
            gaps = {b - a for a, b in zip(picks[:-1], picks[1:], strict=True)}
            assert gaps <= {eligible // len(picks), -(-eligible // len(picks))}
    # equal counts interleave rather than emptying the same blocks
    if len(attn) == len(mlp) and 0 < len(attn) < eligible:
        assert attn != mlp


@pytest.mark.parametrize("num_layers", [1, 2, 4, 7])
def test_uniform_plan_without_keep_first_last(num_layers):
    for ratio in (0.3, 0.5, 0.8):
        plan = uniform_plan(num_layers, ratio, keep_first_last=False)
        assert plan.num_skipped == math.floor(ratio * 2 * num_layers)
        assert plan.num_skipped < 2 * num_layers


def test_uniform_plan_small_models_keep_all_eligible():
    # with L <= 2 there is no "middle": every block is eligible
    assert uniform_plan(2, 0.5).num_skipped == 2
    assert uniform_plan(1, 0.5).num_skipped == 1


def test_static_uses_uniform_plan_and_is_constant():
    sel = StaticSelector(StaticSelectorConfig(skip_ratio=0.4))
    sel.setup(_info(10))
    plan = sel.plan(None)
    assert plan == uniform_plan(10, 0.4)
    assert sel.plan(None) is plan
    assert sel.summary() == {"plan": plan.describe()}
    sel2 = StaticSelector(StaticSelectorConfig(skip_ratio=0.4, keep_first_last=False))
    sel2.setup(_info(10))
    assert sel2.plan(None) == uniform_plan(10, 0.4, keep_first_last=False)


def test_explicit_set_overrides_ratio():
    sel = StaticSelector(StaticSelectorConfig(skip_ratio=0.9, skip_attn=(1,), skip_mlp=(0, 3)))
    sel.setup(_info(4))
    assert sel.plan(None) == LayerPlan.from_indices(4, attn=[1], mlp=[0, 3])
    only_mlp = StaticSelector(StaticSelectorConfig(skip_mlp=(2,)))
    only_mlp.setup(_info(4))
    assert only_mlp.plan(None) == LayerPlan.from_indices(4, mlp=[2])


@pytest.mark.parametrize("field", ["skip_attn", "skip_mlp"])
def test_explicit_out_of_range_rejected_at_setup(field):
    sel = StaticSelector(StaticSelectorConfig(**{field: (1, 4)}))
    with pytest.raises(ConfigError) as exc:
        sel.setup(_info(4))
    msg = str(exc.value)
    assert msg.startswith(f"--selector.{field} must be block indices in [0, 3]")
    assert "(1, 4)" in msg


def test_all_skipped_rejected():
    every = tuple(range(4))
    sel = StaticSelector(StaticSelectorConfig(skip_attn=every, skip_mlp=every))
    with pytest.raises(ConfigError, match="at least one sub-layer"):
        sel.setup(_info(4))
    # one sub-layer left is accepted
    ok = StaticSelector(StaticSelectorConfig(skip_attn=every, skip_mlp=(0, 1, 2)))
    ok.setup(_info(4))
    assert ok.plan(None).num_skipped == 7


@pytest.mark.parametrize("ratio", [1.0, -0.1, 1.5, float("nan")])
def test_bad_skip_ratio(ratio):
    with pytest.raises(ConfigError, match=r"skip_ratio must be in \[0, 1\)"):
        StaticSelectorConfig(skip_ratio=ratio)


def test_negative_indices_rejected():
    with pytest.raises(ConfigError, match="skip_attn must be non-negative block indices"):
        StaticSelectorConfig(skip_attn=(-1,))
    with pytest.raises(ConfigError, match="skip_mlp"):
        StaticSelectorConfig(skip_mlp=(0, -2))


def test_cli_flags():
    with pytest.raises(ConfigError, match=r"^--selector\.skip_ratio must be in \[0, 1\), got 1\.0$"):
        build_config(StaticSelectorConfig, {"skip_ratio": "1.0"}, flag_prefix="--selector.")
    cfg = build_config(StaticSelectorConfig, {"skip_attn": "3,5", "keep_first_last": "false"})
    assert cfg.skip_attn == (3, 5) and cfg.keep_first_last is False and cfg.explicit
    assert not StaticSelectorConfig().explicit
