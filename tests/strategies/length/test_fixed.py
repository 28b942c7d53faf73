"""strategies/length/fixed.py."""

from __future__ import annotations

import pytest
import torch

from framework import Draft, LayerPlan, Verification
from framework.config_fields import ConfigError
from framework.drafting.gate import GateConfig, GatedLength, length_cap
from framework.testing import LengthControllerContract, synthetic_cost_model
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig


class TestFixedDefaultContract(LengthControllerContract):
    def make(self):
        return FixedLength()


class TestFixedOneContract(LengthControllerContract):
    def make(self):
        return FixedLength(FixedLengthConfig(k=1))


class TestFixedLongContract(LengthControllerContract):
    def make(self):
        return FixedLength(FixedLengthConfig(k=9))


@pytest.mark.parametrize("k", [0, -1, -10, 65])
def test_k_outside_range_rejected(k):
    with pytest.raises(ConfigError, match=rf"^k must be an integer in \[1, 64\], got {k}$"):
        FixedLengthConfig(k=k)


@pytest.mark.parametrize("k", [1, 4, 17])
def test_constant_k_and_never_stops_early(k):
    ctl = FixedLength(FixedLengthConfig(k=k))
    assert ctl.needs_confidence is False
    assert ctl.max_length(None) == k
    assert all(ctl.should_continue(i, None) for i in range(1, k + 3))
    assert FixedLength().config.k == 4


# ---- under the draft gate -----------------------------------------------------------------------


class TestFixedGatedContract(LengthControllerContract):
    def make(self):
        return GatedLength(FixedLength(FixedLengthConfig(k=3)), GateConfig(enabled=True, probe=2))


_CHEAP = LayerPlan.from_indices(4, attn=[1, 2], mlp=[1, 2])  # 0.55 steps on the synthetic costs


def _observe(ctl, k: int, m: int) -> None:
    ctl.observe(
        None,
        Draft(torch.zeros(1, k, dtype=torch.long), _CHEAP),
        Verification(torch.tensor([m]), torch.zeros(1, m + 1, dtype=torch.long)),
    )


def test_fixed_drafts_exactly_k_and_has_no_gate_of_its_own():
    ctl = FixedLength()
    assert FixedLength.exact_length is True
    assert not hasattr(ctl, "gate") and ctl.summary() == {}
    assert not any(f.startswith(("fallback", "gate")) for f in FixedLengthConfig.__dataclass_fields__)


def test_gate_declines_probes_and_reports():
    ctl = GatedLength(FixedLength(FixedLengthConfig(k=3)), GateConfig(enabled=True, probe=2, probe_max=2))
    ctl.gate.set_costs(synthetic_cost_model(4))
    ctl.reset()
    got = []
    for _ in range(7):
        k = ctl.max_length(None)
        got.append(k)
        _observe(ctl, k, 0)
    assert got == [1, 0, 0, 1, 0, 0, 1]  # a first probe of 1 token, then the probe schedule
    s = ctl.summary()["gate"]
    assert (s["rounds"], s["declined"], s["probes"], s["alpha"]) == (7, 4, 3, 0.0)


def test_gate_values_k_itself_unlike_a_controller_that_stops_early():
    """alpha 0.7: drafting 1 token pays (1.7 / 1.65), drafting 3 does not (2.533 / 2.95)."""
    costs = synthetic_cost_model(4)
    assert costs.expected_speedup(0.7, 1, _CHEAP) > 1 > costs.expected_speedup(0.7, 3, _CHEAP)
    on = GateConfig(enabled=True, optimism=0.0)  # the point estimate: the arithmetic above
    fixed = GatedLength(FixedLength(FixedLengthConfig(k=3)), on)
    conf = GatedLength(ConfidenceLength(ConfidenceLengthConfig(max_length=3)), on)
    for ctl in (fixed, conf):
        ctl.gate.set_costs(costs)
        ctl.gate.plan = _CHEAP
        ctl.gate.acc, ctl.gate.rej = 7.0, 3.0
    assert fixed.max_length(None) == 0
    assert conf.max_length(None) == length_cap(costs, 0.7, _CHEAP, 3) >= 1  # drafts, capped
    uncapped = GatedLength(
        ConfidenceLength(ConfidenceLengthConfig(max_length=3)),
        GateConfig(enabled=True, optimism=0.0, cap=False),
    )
    uncapped.gate.set_costs(costs)
    uncapped.gate.plan = _CHEAP
    uncapped.gate.acc, uncapped.gate.rej = 7.0, 3.0
    assert uncapped.max_length(None) == 3
