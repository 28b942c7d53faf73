"""The cascade drafter's choice between a copy, the layer-skip draft and a plain step."""

from __future__ import annotations

import types

import pytest

from framework import LayerPlan
from framework.testing import synthetic_cost_model
from framework.types import DecodeStats
from strategies.drafters.cascade import CascadeDrafter, CascadeDrafterConfig

L = 4
COSTS = synthetic_cost_model(L)
PLAN = LayerPlan.from_indices(L, attn=[1, 2], mlp=[1, 2])  # a draft step of 0.55
STATE = types.SimpleNamespace(stats=DecodeStats(), num_tokens=128)


def _cascade(copy_alpha: float | None, skip_alpha: float | None) -> CascadeDrafter:
    """A cascade whose gates price with the synthetic costs and whose statistics say the given
    acceptance (1000 trials; ``None``: untried)."""
    d = CascadeDrafter()
    for gate, alpha in ((d.copy_gate, copy_alpha), (d.gate, skip_alpha)):
        gate.set_costs(COSTS)
        gate.optimism = 0.0
        if alpha is not None:
            gate.plan = PLAN
            gate.acc, gate.rej = 1000 * alpha, 1000 * (1 - alpha)
    return d


def test_an_untried_copy_source_is_copied():
    assert _cascade(None, 0.95)._copy_values(STATE, 4, 4) == (True, False)


def test_a_copy_that_accepts_well_is_copied_and_a_poor_one_gives_way():
    # copies are free drafts: at alpha 0.8 four copied tokens are worth (1 - 0.8^5) / 0.2 / 1.3
    assert _cascade(0.8, 0.95)._copy_values(STATE, 4, 4) == (True, False)
    # a copy source accepting 10% (a 4-token copy predicted at 0.79x) against a layer-skip source
    # accepting 95% (predicted to pay, and faster): the copy gives way
    pays, better = _cascade(0.1, 0.95)._copy_values(STATE, 4, 4)
    assert better and not pays
    # both poor: the layer-skip source does not pay, so it cannot displace anything
    assert _cascade(0.1, 0.2)._copy_values(STATE, 4, 4)[1] is False


def test_a_copy_that_does_not_pay_is_declined():
    """A copy priced as a free draft pays unless verifying it costs more than it commits: with
    verification of 5 tokens at 3 steps, a 4-token copy accepting 10% does not pay."""
    dear = synthetic_cost_model(L)
    dear = type(dear)(**{**dear.to_dict(), "verify_costs": tuple(1.0 + 0.5 * t for t in range(16))})
    d = _cascade(0.1, None)
    d.copy_gate.set_costs(dear)
    assert d._copy_values(STATE, 4, 4) == (False, False)


def test_the_copy_estimate_restarts_with_every_generation_and_the_skip_estimate_does_not():
    d = _cascade(0.1, 0.9)
    d.reset()
    assert d.copy_gate.alpha is None and d.gate.alpha == pytest.approx(0.9)
    assert d._since_copy == 0 and d._displaced == 0


def test_the_skip_gate_is_required():
    with pytest.raises(ValueError, match="skip_gate"):
        CascadeDrafterConfig(skip_gate=False)


# --------------------------------------------------------------------------------------------
# Contract
# --------------------------------------------------------------------------------------------
from framework.testing import DrafterContract  # noqa: E402


class TestCascadeContract(DrafterContract):
    """A round whose best predicted source is a plain step drafts nothing."""

    may_decline = True

    def make(self):
        return CascadeDrafter()
