"""framework/search/budget.py: the work budget's decisions, periods and counters, on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from framework import Strategy
from framework.config_fields import ConfigError, build_config, field_help
from framework.search.budget import BudgetedWork, WorkBudget, budget_param, check_budget
from framework.testing import FakeClock


def work(budget: WorkBudget, clock: FakeClock, seconds: float) -> float:
    """Run one unit that takes ``seconds`` on ``clock``; returns the unit's measured seconds."""
    with budget.unit() as unit:
        clock.advance(seconds)
    return unit.seconds


@pytest.mark.parametrize("share", [0.0, None])
def test_unlimited_allows_everything_without_reading_the_clock_and_still_counts(share):
    clock = FakeClock()
    b = WorkBudget(share, clock=clock)
    assert b.unlimited and b.share == 0.0
    reads = clock.reads
    for _ in range(5):
        assert b.allows()
    assert clock.reads == reads  # deciding costs nothing
    assert work(b, clock, 2.0) == 2.0
    clock.advance(2.0)
    assert b.allows()
    assert b.summary() == {"budget_units": 1, "budget_skipped": 0, "work_share": 1.0}


def test_allows_exactly_while_work_is_within_the_share_of_wall_time():
    clock = FakeClock()
    b = WorkBudget(0.25, clock=clock)
    assert b.allows()  # the first unit: 0 <= 0.25 * 0
    assert work(b, clock, 1.0) == 1.0
    assert not b.allows()  # 1 s of work in 1 s of wall
    clock.advance(2.9)
    assert not b.allows()  # 1 > 0.25 * 3.9
    clock.advance(0.1)
    assert b.allows()  # 1 <= 0.25 * 4: the boundary is allowed
    assert (b.units, b.skipped, b.work_seconds, b.wall_seconds) == (1, 2, 1.0, 4.0)
    assert b.work_share == 0.25
    assert b.summary() == {"budget_units": 1, "budget_skipped": 2, "work_share": 0.25}


def test_over_many_rounds_the_share_converges_to_the_budget():
    """Decoding rounds of 0.1 s, a unit of 1 s due after each: the work exceeds the budget by at
    most one unit, and the budget is used (not starved)."""
    clock = FakeClock()
    b = WorkBudget(0.05, clock=clock)
    for _ in range(2000):
        clock.advance(0.1)
        if b.allows():
            work(b, clock, 1.0)
        assert b.work_seconds <= 0.05 * b.wall_seconds + 1.0
    assert 0.045 < b.work_share <= 0.05 + 1.0 / b.wall_seconds
    assert b.units + b.skipped == 2000
    assert b.units < 0.06 * 2000


def test_resume_drops_the_idle_time_between_periods_and_restart_forgets_everything():
    clock = FakeClock()
    b = WorkBudget(0.5, clock=clock)
    work(b, clock, 1.0)
    clock.advance(1.0)
    assert b.allows()  # 1 <= 0.5 * 2
    work(b, clock, 1.0)
    clock.advance(100.0)  # another method decodes: the selector sits idle
    b.resume()
    assert b.wall_seconds == 3.0  # counted up to the last reading, the end of the unit
    assert not b.allows()  # 2 > 0.5 * 3 (without resume: 2 <= 0.5 * 103)
    clock.advance(1.0)
    assert b.allows()  # 2 <= 0.5 * 4
    assert (b.units, b.skipped) == (2, 1)
    b.restart()
    assert (b.units, b.skipped, b.work_seconds, b.wall_seconds, b.work_share) == (0, 0, 0.0, 0.0, 0.0)
    assert b.allows()


def test_a_unit_that_raises_is_still_timed_and_counted():
    clock = FakeClock()
    b = WorkBudget(0.1, clock=clock)
    with pytest.raises(RuntimeError), b.unit():
        clock.advance(0.5)
        raise RuntimeError("boom")
    assert (b.units, b.work_seconds) == (1, 0.5)


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5, float("nan"), True])
def test_bad_shares_are_refused_naming_the_field(share):
    with pytest.raises(ConfigError, match="share must be in \\[0, 1\\)"):
        WorkBudget(share)


# ---- the reusable piece: budget_param, check_budget, BudgetedWork -----------------------------


@dataclass(frozen=True)
class _BudgetedConfig:
    work_budget: float = budget_param("skip a unit")

    def __post_init__(self) -> None:
        check_budget(self)


class _Owner(BudgetedWork, Strategy):
    Config = _BudgetedConfig


def test_budget_param_declares_the_field_and_check_budget_validates_it():
    assert _BudgetedConfig().work_budget == 0.0
    assert "skip a unit" in field_help(_BudgetedConfig)["work_budget"]
    with pytest.raises(ConfigError, match=r"^--x\.work_budget must be in \[0, 1\), got "):
        build_config(_BudgetedConfig, {"work_budget": "1.0"}, flag_prefix="--x.")


def test_budgeted_work_owns_the_budget_and_runs_units_under_it():
    owner = _Owner(_BudgetedConfig(work_budget=0.5))
    assert isinstance(owner.budget, WorkBudget) and owner.budget.share == 0.5
    clock = FakeClock()
    owner.budget = WorkBudget(0.5, clock=clock)

    def work(dt: float) -> str:
        clock.advance(dt)
        return "done"

    assert owner.run_budgeted(work, 1.0) == ("done", 1.0)  # the first unit is always allowed
    clock.advance(1.0)  # wall 2 s, work 1 s: at the share
    assert owner.run_budgeted(work, 3.0) == ("done", 3.0)
    clock.advance(1.0)  # wall 6 s, work 4 s > 3 s: refused, nothing runs
    assert owner.run_budgeted(work, 1.0) is None
    s = owner.budget.summary()
    assert (s["budget_units"], s["budget_skipped"]) == (2, 1)


def test_a_capped_budget_times_its_units_on_the_device_clock(monkeypatch):
    """On CUDA a unit's seconds must be its work, not its kernel launches: `prepare` gives a capped
    budget a clock that waits for the device; an unlimited one keeps its clock (it reads none)."""
    import time
    from types import SimpleNamespace

    import torch

    import framework.utils as utils

    waits = []
    monkeypatch.setattr(utils, "device_sync", lambda dev: waits.append(str(dev)))
    ctx = SimpleNamespace(device=torch.device("cuda", 0))
    capped = _Owner(_BudgetedConfig(work_budget=0.5))
    capped.prepare(ctx)
    with capped.budget.unit():
        pass
    assert waits == ["cuda:0", "cuda:0"]  # before and after the unit
    unlimited = _Owner(_BudgetedConfig(work_budget=0.0))
    unlimited.prepare(ctx)
    assert unlimited.budget.clock is time.perf_counter
    on_cpu = _Owner(_BudgetedConfig(work_budget=0.5))
    on_cpu.prepare(SimpleNamespace(device=torch.device("cpu")))
    assert on_cpu.budget.clock is time.perf_counter  # nothing to wait for on a CPU
