"""``swift``: SWIFT's on-the-fly skip-set optimisation (random search + interval Bayesian optimisation).

Xia et al., "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration", ICLR 2025.
No offline search: while decoding, the selector proposes one candidate skip set of exactly
``floor(r * L_eff)`` sub-layers per optimisation step (a uniform random subset, or every
``bo_interval``-th step the GP-UCB maximiser over the observed candidates), scores it by *matchness*
(one teacher-forced draft pass over a context window of tokens the target already generated, on the
committed prefix cache, which stays intact) and keeps the best set, which drafts meanwhile.
Optimisation stops for good once matchness exceeds ``matchness_stop``, after ``patience`` steps
without improvement, or after ``max_opt_steps`` steps; decoding then continues with the best set
(the acceleration phase). The optimisation state carries across prompts as in the paper.

With ``adaptive_r_below`` > 0, r adapts as in the later revision's App. C.2 footnote (LLaMA-3-70B: r
"automatically adjusted from 0.5 to 0.4 as the token acceptance rate remained below the tolerance
threshold of 0.7" during optimisation; not in the released code): while optimising, once the
acceptance rate over the last ``adaptive_r_window`` drafting rounds is below ``adaptive_r_below``,
r drops by ``adaptive_r_step`` (not below ``adaptive_r_min``) and the search restarts at the new
cardinality.

Timeline of one generation: after each verification, once the generation has more than
``context_window + 1`` new tokens, run one optimisation step (every ``opt_interval`` rounds),
unless ``work_budget`` (an extension, `framework.search.budget.WorkBudget`) says the steps already took
their share of wall time: then that step is skipped and its counters do not advance.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch

from framework import (
    Draft,
    LayerPlan,
    LayerSelector,
    ModelInfo,
    RoundView,
    Verification,
    register_selector,
)
from framework.config_fields import ConfigError, check_range, check_types, param
from framework.search.bayesopt import BinaryBayesOpt
from framework.search.budget import BudgetedWork, budget_param, check_budget
from strategies.selectors.static import uniform_plan


@dataclass(frozen=True)
class SwiftConfig:
    skip_ratio: float = param(
        0.45,
        help="r: every candidate skips exactly floor(r * L_eff) eligible sub-layers (the paper: 0.45 "
        "for 13B, 0.5 for 34B/70B); in (0, 1)",
    )
    context_window: int = param(
        32,
        help="gamma: generated tokens whose next-token agreement is the matchness (the paper: 32); in [2, 1024]",
    )
    window: Literal["first", "sliding"] = param(
        "first",
        help="'first': the generation's first gamma+1 tokens, fixed (the released code); 'sliding': the "
        "last gamma+1 committed tokens",
    )
    max_opt_steps: int = param(
        1000, help="S: optimisation ends after this many steps (the paper: 1000); >= 1"
    )
    bo_interval: int = param(
        25, help="beta: every beta-th step is a GP-UCB proposal, the others random (the paper: 25); >= 1"
    )
    patience: int = param(
        300, help="optimisation ends after this many steps without improvement (the paper: 300); >= 1"
    )
    matchness_stop: float = param(
        0.95, help="optimisation ends once the best matchness exceeds this (the paper: 0.95); in (0, 1]"
    )
    opt_interval: int = param(
        1, help="one optimisation step every this many verification rounds (the code: 1); >= 1"
    )
    initial_set: Literal["odd_blocks", "uniform"] = param(
        "odd_blocks",
        help="the set drafting before the first improvement: 'odd_blocks' skips both sub-layers of "
        "blocks 1, 3, .., L-3 (the released code); 'uniform' spreads floor(r * L_eff) evenly",
    )
    keep_first_last: bool = param(True, help="never skip the first and last block (the released code)")
    persist_across_prompts: bool = param(
        True,
        help="keep the optimisation state from one generation to the next (the paper); false restarts "
        "it every generation",
    )
    retrigger_below: float = param(
        0.0,
        help="extension (not in the paper): after optimisation ended, restart it when the acceptance "
        "rate over the last retrigger_window drafting rounds falls below this; 0 disables; in [0, 1)",
    )
    retrigger_window: int = param(50, help="rounds in the rolling acceptance rate of retrigger_below; >= 1")
    adaptive_r_below: float = param(
        0.0,
        help="SWIFT's adaptive r (the later revision's App. C.2 footnote; not in the released code): "
        "while optimising, when the acceptance rate over the last adaptive_r_window drafting rounds is "
        "below this, lower r by adaptive_r_step and restart the search at the new cardinality; the "
        "footnote's tolerance is 0.7; 0 disables (the paper's main method, fixed r); in [0, 1)",
    )
    adaptive_r_step: float = param(
        0.1, help="how much one adjustment lowers r (the footnote: 0.5 -> 0.4); in (0, 1)"
    )
    adaptive_r_window: int = param(
        50, help="drafting rounds in the acceptance rate of adaptive_r_below (not in the paper); >= 1"
    )
    adaptive_r_min: float = param(
        0.2,
        help="adaptive r never goes below this (not in the paper); in (0, 1), at most skip_ratio when "
        "adaptive_r_below is on",
    )
    work_budget: float = budget_param(
        "skip a due optimisation step (the best set keeps drafting; wall time counts from the start "
        "of the optimisation state)"
    )
    kappa: float = param(2.5, help="UCB exploration weight (the code: 2.5); > 0")
    gp_noise: float = param(
        0.01, help="observation noise of the GP on standardised matchness (the code: 1e-2); > 0"
    )
    seed: int = param(2024, help="seeds random proposals and the GP's random starts (the code: 2024)")

    def __post_init__(self) -> None:
        check_types(self)
        check_range("skip_ratio", self.skip_ratio, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("context_window", self.context_window, 2, 1024, integer=True)
        check_range("max_opt_steps", self.max_opt_steps, 1, integer=True)
        check_range("bo_interval", self.bo_interval, 1, integer=True)
        check_range("patience", self.patience, 1, integer=True)
        check_range("matchness_stop", self.matchness_stop, 0.0, 1.0, lo_open=True)
        check_range("opt_interval", self.opt_interval, 1, integer=True)
        check_range("retrigger_below", self.retrigger_below, 0.0, 1.0, hi_open=True)
        check_range("retrigger_window", self.retrigger_window, 1, integer=True)
        check_range("adaptive_r_below", self.adaptive_r_below, 0.0, 1.0, hi_open=True)
        check_range("adaptive_r_step", self.adaptive_r_step, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range("adaptive_r_window", self.adaptive_r_window, 1, integer=True)
        check_range("adaptive_r_min", self.adaptive_r_min, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.adaptive_r_below > 0 and self.adaptive_r_min > self.skip_ratio:
            raise ConfigError(
                "adaptive_r_min",
                self.adaptive_r_min,
                f"at most skip_ratio ({self.skip_ratio:g}) when adaptive_r_below is on",
            )
        check_budget(self)
        check_range("kappa", self.kappa, 0.0, lo_open=True)
        check_range("gp_noise", self.gp_noise, 0.0, lo_open=True)


@register_selector("swift", config=SwiftConfig)
class SwiftSelector(BudgetedWork, LayerSelector):
    """SWIFT: optimise the skip set on the fly by matchness, random search plus GP-UCB every
    ``bo_interval`` steps; draft with the best set so far."""

    requires = ("botorch", "gpytorch")  # its Gaussian-process Bayesian optimisation

    def setup(self, info: ModelInfo) -> None:
        c, n = self.config, info.num_layers
        blocks = list(range(1, n - 1)) if c.keep_first_last and n > 2 else list(range(n))
        #: eligible sub-layers in the 2L bit convention (attention of block i: i; its MLP: L + i)
        self.eligible = blocks + [n + b for b in blocks]
        n_skip = int(c.skip_ratio * len(self.eligible))
        if n_skip < 1 or n_skip >= len(self.eligible):
            raise ConfigError(
                "--selector.skip_ratio",
                c.skip_ratio,
                f"a ratio that skips between 1 and {len(self.eligible) - 1} of the {len(self.eligible)} eligible "
                f"sub-layers of this {n}-block model (floor(r * {len(self.eligible)}) = {n_skip})",
            )
        self.num_layers = n
        # ``self.budget`` (BudgetedWork) caps the steps' share of wall time; it lives as long as the
        # optimisation state (restarted with it, resumed at each generation when the state carries over)
        self._init_state()
        self._new_generation()

    def _init_state(self) -> None:
        c, n = self.config, self.num_layers
        #: r and the cardinality floor(r * L_eff) of the candidates (adaptive r lowers them)
        self.ratio = c.skip_ratio
        self.n_skip = int(c.skip_ratio * len(self.eligible))
        if c.initial_set == "odd_blocks":
            odd = [b for b in range(1, n - 2 + (not c.keep_first_last), 2)]
            self.current = LayerPlan.from_indices(n, attn=odd, mlp=odd)
        else:
            self.current = uniform_plan(n, c.skip_ratio, c.keep_first_last)
        self.best = 0.0
        self.steps = 0  # o
        self.stale = 0  # steps without improvement
        self.optimising = True
        self.rescore = False  # re-baseline the best set on a new window (after a retrigger)
        self.rebase = False  # the next candidate replaces the current set (after r was lowered)
        self.bo = BinaryBayesOpt(
            len(self.eligible), cardinality=self.n_skip, kappa=c.kappa, noise=c.gp_noise, seed=c.seed
        )
        self.generator = torch.Generator().manual_seed(c.seed)
        self.recent = deque(maxlen=c.retrigger_window)  # (drafted, accepted) after optimisation
        self.recent_opt = deque(maxlen=c.adaptive_r_window)  # (drafted, accepted) while optimising
        self.r_adjustments = 0
        self.total_seconds = 0.0
        self.retriggers = 0
        self.stop_reason = ""
        self.budget.restart()

    # ---- per generation ------------------------------------------------------------------------
    def reset(self) -> None:
        if self.config.persist_across_prompts:
            self.budget.resume()  # the time between generations earns no budget
        else:
            self._init_state()
        self._new_generation()

    def _new_generation(self) -> None:
        self.rounds = 0
        self.gen_steps = 0
        self.gen_bo_steps = 0
        self.gen_improvements = 0
        self.gen_seconds = 0.0
        self.gen_matchness: list[float] = []
        self.gen_start = time.perf_counter()

    def plan(self, state: RoundView) -> LayerPlan:
        return self.current

    def run_notes(self, max_new_tokens: int) -> list[str]:
        """The search runs only once a turn has ``context_window + 2`` new tokens (its scratch
        pass needs ``context_window`` of them): a shorter run never optimises."""
        c = self.config
        first = c.context_window + 2
        if max_new_tokens >= first:
            return []
        return [
            f"swift never optimises in this run: its search starts at new token {first} of a turn "
            f"(context_window {c.context_window} + 2) and max_new_tokens is {max_new_tokens}, so every "
            f"draft uses its initial skip set ({c.initial_set}, r = {c.skip_ratio:g}); raise "
            f"--max-new-tokens to at least {first} or lower --selector.context_window"
        ]

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self.rounds += 1
        if not self.optimising:
            self._maybe_retrigger(draft, result)
            return
        self._maybe_lower_r(draft, result)
        c = self.config
        if state.num_new <= c.context_window + 1 or self.rounds % c.opt_interval:
            return
        done = self.run_budgeted(self._step, state)
        if done is None:  # over budget: no step; the best set keeps drafting
            return
        self.gen_seconds += done[1]
        self.total_seconds += done[1]

    # ---- one optimisation step -----------------------------------------------------------------
    def window_span(self, state: RoundView) -> tuple[int, int]:
        """Tokens ``[start, end)`` fed to the teacher-forced pass; their successors are the targets."""
        g = self.config.context_window
        if self.config.window == "first":
            start = state.prompt_len
        else:
            start = state.num_tokens - 1 - g
        return start, start + g

    def matchness(self, state: RoundView, plan: LayerPlan) -> float:
        """Fraction of the window's next tokens the draft ``plan`` predicts (argmax), teacher forced
        on the committed cache (``DecodeState.forward_scratch``; the committed KV is not touched),
        scored with the draft's head (``state.draft_head``), as the draft would propose them."""
        start, end = self.window_span(state)
        predicted = state.forward_scratch(start, plan, end=end, logits_at="all").top1()
        target = state.tokens[:, start + 1 : end + 1]
        return float((predicted == target).float().mean())

    def _bits_to_plan(self, x: tuple[int, ...]) -> LayerPlan:
        n = self.num_layers
        bits = [0] * (2 * n)
        for j, on in zip(self.eligible, x, strict=True):
            bits[j] = on
        return LayerPlan.from_bits(bits)

    def _random_candidate(self) -> tuple[int, ...]:
        chosen = set(torch.randperm(len(self.eligible), generator=self.generator)[: self.n_skip].tolist())
        return tuple(int(i in chosen) for i in range(len(self.eligible)))

    def _step(self, state: RoundView) -> None:
        c = self.config
        if self.rescore:  # a retrigger: score the current set on the new window first
            self.best = self.matchness(state, self.current)
            self.rescore = False
        self.steps += 1
        self.gen_steps += 1
        if self.steps % c.bo_interval == 0 and len(self.bo.Y) >= 2:
            x = self.bo.suggest()
            self.gen_bo_steps += 1
        else:
            x = self._random_candidate()
        plan = self._bits_to_plan(x)
        s = self.matchness(state, plan)
        self.bo.observe(x, s)
        self.gen_matchness.append(round(s, 4))
        if s > self.best or self.rebase:  # strict, as the released code (rebase: r was lowered)
            self.current, self.best, self.stale = plan, s, 0
            self.rebase = False
            self.gen_improvements += 1
            if s > c.matchness_stop:
                self._stop("matchness")
        else:
            self.stale += 1
        if self.optimising and self.stale > c.patience:
            self._stop("patience")
        elif self.optimising and self.steps >= c.max_opt_steps:
            self._stop("max_opt_steps")

    def _stop(self, reason: str) -> None:
        self.optimising = False
        self.stop_reason = reason
        self.recent.clear()
        self.recent_opt.clear()

    # ---- adaptive r (the later revision's App. C.2 footnote) -----------------------------------
    def _maybe_lower_r(self, draft: Draft, result: Verification) -> None:
        """While optimising: lower r once the rolling acceptance rate is below ``adaptive_r_below``."""
        c = self.config
        if c.adaptive_r_below <= 0 or not draft.length:
            return
        self.recent_opt.append((draft.length, result.accepted))
        if len(self.recent_opt) < c.adaptive_r_window:
            return
        drafted = sum(d for d, _ in self.recent_opt)
        if sum(a for _, a in self.recent_opt) / drafted >= c.adaptive_r_below:
            return
        ratio = round(self.ratio - c.adaptive_r_step, 9)
        n_skip = int(ratio * len(self.eligible))
        if ratio < c.adaptive_r_min - 1e-9 or n_skip < 1:
            return  # at the floor: r stays
        self.set_ratio(ratio)

    def set_ratio(self, ratio: float) -> None:
        """Candidates skip ``floor(ratio * L_eff)`` sub-layers from now on; the search restarts there.

        The step and patience counters restart, the rolling acceptance rate empties, and the next
        candidate replaces the current set whatever its matchness (the current set has the old
        cardinality). The GP keeps its observations (they are matchness values of real sets) and
        proposes sets of the new cardinality.
        """
        c = self.config
        self.ratio = ratio
        self.n_skip = int(ratio * len(self.eligible))
        old = self.bo
        self.bo = BinaryBayesOpt(
            len(self.eligible), cardinality=self.n_skip, kappa=c.kappa, noise=c.gp_noise, seed=c.seed
        )
        for x, y in zip(old.X, old.Y, strict=True):
            self.bo.observe(x, y)
        self.bo.num_fits, self.bo.fit_seconds = old.num_fits, old.fit_seconds
        self.rebase = True
        self.steps = self.stale = 0
        self.recent_opt.clear()
        self.r_adjustments += 1

    def _maybe_retrigger(self, draft: Draft, result: Verification) -> None:
        c = self.config
        if c.retrigger_below <= 0 or not draft.length:
            return
        self.recent.append((draft.length, result.accepted))
        if len(self.recent) < c.retrigger_window:
            return
        drafted = sum(d for d, _ in self.recent)
        if sum(a for _, a in self.recent) / drafted < c.retrigger_below:
            self.optimising, self.rescore, self.stale, self.steps = True, True, 0, 0
            self.stop_reason = ""
            self.retriggers += 1

    def summary(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.gen_start
        return {
            "phase": "optimising" if self.optimising else "accelerating",
            "stop_reason": self.stop_reason,
            "opt_steps": self.gen_steps,
            "bo_steps": self.gen_bo_steps,
            "improvements": self.gen_improvements,
            "opt_steps_total": self.steps,
            "gp_fits_total": self.bo.num_fits,
            "opt_seconds": round(self.gen_seconds, 4),
            "opt_share": round(self.gen_seconds / wall, 4) if wall > 0 else 0.0,
            "opt_seconds_total": round(self.total_seconds, 3),
            "best_matchness": round(self.best, 4),
            "matchness": list(self.gen_matchness),
            "retriggers": self.retriggers,
            "r": self.ratio,
            "r_adjustments": self.r_adjustments,
            **self.budget.summary(),
            "plan": self.current.describe(),
        }
