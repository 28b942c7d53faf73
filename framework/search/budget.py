"""A wall-time budget for a strategy's own optimisation work (an extension beyond the papers).

SWIFT's matchness steps, CLaSp's dynamic programme and DEL's shadow-token statistics all run
between decoding rounds. On a GPU a paper measures them at a few percent of latency; on a small
CPU model the same work can cost more than the drafting it steers. A `WorkBudget` caps it at a
share of wall time: a unit of work (one SWIFT step, one DP, one statistics update) may start only
while ``work <= share * wall``, where

- ``work`` is the seconds spent inside `WorkBudget.unit` blocks, and
- ``wall`` is the seconds since `WorkBudget.restart`, counting only *periods*: `WorkBudget.resume`
  starts a new period of the same budget and drops the time between the previous period's last
  clock reading and now. A selector whose state carries across generations (SWIFT) resumes at each
  generation, so the time it sat idle (other prompts' baselines, other methods of a benchmark) earns
  it no credit; a selector whose state restarts every generation (CLaSp, DEL) restarts its budget.

The first unit of a budget is always allowed (``0 <= share * 0``). A unit that starts under budget
runs to completion, so the work exceeds ``share * wall`` by at most one unit's duration, a margin
that shrinks relative to ``wall`` as decoding goes on. ``share = 0`` (or ``None``) means
unlimited: every unit is allowed and no clock is read to decide, the published methods'
behaviour; units are still timed and counted.

A strategy gets one by declaring its config field with `budget_param` (validated by
`check_budget`) and mixing in `BudgetedWork`, which owns the `WorkBudget` (``self.budget``) and
runs units under it (`BudgetedWork.run_budgeted`); its ``summary()`` adds `WorkBudget.summary`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from framework.config_fields import check_range, param
from framework.utils import synced_clock

T = TypeVar("T")


@dataclass
class WorkUnit:
    """One timed unit of work; ``seconds`` is set when its ``with`` block ends."""

    seconds: float = 0.0


class WorkBudget:
    """Keep a strategy's optimisation work under ``share`` of wall time.

    Usage, once per unit of work that is due::

        if budget.allows():
            with budget.unit() as unit:
                ...  # the work
            seconds = unit.seconds

    Args:
        share: the largest share of wall time the work may take, in [0, 1); 0 or ``None``:
            unlimited.
        clock: monotonic seconds (`time.perf_counter`); tests pass a fake clock.

    Attributes:
        share: the budget (0 when unlimited).
        units: units run since `restart`.
        skipped: units refused by `allows` since `restart`.
        work_seconds: seconds spent in units since `restart`.
    """

    def __init__(self, share: float | None = None, *, clock: Callable[[], float] = time.perf_counter) -> None:
        share = 0.0 if share is None else share
        check_range("share", share, 0.0, 1.0, hi_open=True)
        self.share = float(share)
        self.clock = clock
        self.restart()

    @property
    def unlimited(self) -> bool:
        return self.share == 0.0

    def restart(self) -> None:
        """Forget all work and wall time; the wall clock starts now (a fresh optimisation state)."""
        self.units = 0
        self.skipped = 0
        self.work_seconds = 0.0
        self._closed_wall = 0.0  # wall seconds of the periods before the current one
        self._period_start = self._last = self.clock()

    def resume(self) -> None:
        """Start a new period: keep the counters, drop the time since the last clock reading.

        The current period counts up to its last reading (the end of the last unit or the last
        `allows`), which errs on the side of less wall time, so less work.
        """
        self._closed_wall += self._last - self._period_start
        self._period_start = self._last = self.clock()

    @property
    def wall_seconds(self) -> float:
        """Wall seconds of all periods up to the last clock reading."""
        return self._closed_wall + self._last - self._period_start

    @property
    def work_share(self) -> float:
        """``work_seconds / wall_seconds`` (0 before any wall time passed)."""
        wall = self.wall_seconds
        return self.work_seconds / wall if wall > 0 else 0.0

    def allows(self) -> bool:
        """Whether the next unit may start: ``work <= share * wall`` now, or the budget is unlimited.

        Call it once per unit that is due: a refusal counts as one skipped unit.
        """
        if self.unlimited:
            return True
        self._last = self.clock()
        if self.work_seconds <= self.share * self.wall_seconds:
            return True
        self.skipped += 1
        return False

    @contextmanager
    def unit(self) -> Iterator[WorkUnit]:
        """Time one unit of work (also when it raises); it counts whether or not `allows` was asked."""
        record = WorkUnit()
        start = self.clock()
        try:
            yield record
        finally:
            self._last = self.clock()
            record.seconds = self._last - start
            self.work_seconds += record.seconds
            self.units += 1

    def charge(self, seconds: float) -> None:
        """Add ``seconds`` of work done elsewhere for the last unit (a unit in two parts: work
        dispatched to the device in one place and finished on the host in another)."""
        self._last = self.clock()
        self.work_seconds += seconds

    def summary(self) -> dict[str, Any]:
        """The counters for a strategy's ``summary()``: ``budget_units``, ``budget_skipped`` and
        ``work_share`` (work over wall time since `restart`, 4 decimals)."""
        return {
            "budget_units": self.units,
            "budget_skipped": self.skipped,
            "work_share": round(self.work_share, 4),
        }


def budget_param(work: str) -> Any:
    """The ``work_budget`` config field (default 0: unlimited) of a strategy whose ``work`` (what
    an over-budget round does instead, e.g. "skip a due optimisation step") is budgeted."""
    return param(
        0.0,
        help=f"extension (not in the papers): {work} while the work's seconds exceed this share of the "
        "wall time (framework.search.budget); 0 = unlimited, as published; in [0, 1)",
    )


def check_budget(cfg: Any) -> None:
    """Validate a config's `budget_param` field ``work_budget`` (raises `ConfigError` naming it)."""
    check_range("work_budget", cfg.work_budget, 0.0, 1.0, hi_open=True)


class BudgetedWork:
    """Mixin for a strategy whose config has a `budget_param` field: it owns the `WorkBudget`.

    Put it before the strategy's base class (``class MySelector(BudgetedWork, LayerSelector)``).
    ``self.budget`` is created in ``__init__`` from ``config.work_budget`` (tests may replace it,
    e.g. with one on a fake clock); the strategy calls ``self.budget.restart()`` when its
    optimisation state restarts and ``self.budget.resume()`` at a generation whose state carries
    over, runs each unit of work with `run_budgeted` (or ``budget.allows`` and ``budget.unit``
    where asking and running are apart), and adds ``self.budget.summary()`` to its summary.
    """

    config: Any

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)  # type: ignore[call-arg]
        self.budget = WorkBudget(self.config.work_budget)

    def prepare(self, ctx: Any) -> None:
        """A capped budget times its units on the run's device: on CUDA with a clock that waits
        for the device (`framework.utils.synced_clock`), so a unit's seconds are its work, not its
        kernel launches. An unlimited budget reads no clock, so nothing changes there."""
        super().prepare(ctx)  # type: ignore[misc]
        device = getattr(ctx, "device", None)
        if not self.budget.unlimited and device is not None:
            self.budget.clock = synced_clock(device)

    def run_budgeted(self, work: Callable[..., T], *args: Any) -> tuple[T, float] | None:
        """Run ``work(*args)`` as one unit if the budget allows it (one `WorkBudget.allows`).

        Returns:
            ``(work's result, its seconds)``, or ``None`` when over budget (nothing ran).
        """
        if not self.budget.allows():
            return None
        with self.budget.unit() as unit:
            out = work(*args)
        return out, unit.seconds
