"""The draft gate: decline to draft (plain decoding) while drafting does not pay.

`GatedLength` wraps any length controller in a `DraftGate` (`gated` does it when the run's
`GateConfig` is enabled: the ``gate:`` block of a preset, ``--gate.<field>`` on the command line).
Every round the gate takes the controller's draft length K and returns K (draft as the controller
wants), 0 (decline: the round is one plain target step) or a short *probe* length. The decision
rule (see ``docs/concepts.md``, "The draft gate"):

1. **Acceptance estimate.** After each round that drafted K >= 1 tokens of which m were accepted,
   the accepted tokens count as m successes and the first rejected token (if m < K) as one
   failure of a chain with i.i.d. acceptance. ``alpha = S(acc) / (S(acc) + S(rej))`` over sums
   decayed by ``decay`` per drafted round. Rounds that drafted nothing leave the sums unchanged.
2. **Expected speedup.** With the measured `CostModel` (``PrepareView.cost_model()``) and the
   plan of the last drafted round (``Draft.plan``: what the drafter ran, e.g. an early-exit
   drafter's prefix plan), ``S(k) = E[tokens | alpha, k] * step / (k * draft_step(plan) +
   verify(k + 1))``, exactly `CostModel.expected_speedup`, with the draft step scaled by the draft
   forwards the drafter ran per drafted token (measured from the decode state's counters: 1 for
   ``layer_skip``, 0 for prompt lookup, which drafts for free) and the verification priced at
   the block the verifier actually runs: ``verify(1 + k * width)``, ``width`` the measured
   tokens verified per drafted token (1 for a chain; a token tree verifies several candidates
   per position). The gate's value is ``max S(k)`` over
   ``k = 1..K`` (``lengths="upto"``: a controller whose length varies) or ``S(K)``
   (``lengths="exact"``: a controller that always drafts K).
3. **Decision.** The value is taken at ``alpha + optimism * sd`` (`DraftGate.alpha_bound`: ``sd`` of
   the Beta posterior of the decayed counts, at most 1): draft (return K) when it is ``>= 1 -
   margin``; otherwise decline (return 0). Thin evidence gives a wide bound, so a few unlucky
   rounds cannot shut the gate on a plan that pays; ``optimism = 0`` decides on the estimate.
   A drafting round is capped (``cap``, on by default, for controllers whose length varies) at
   the longest k with ``S(k) >= 1 - margin`` at the *point* estimate (the best k when none is):
   the bound says whether to explore, the estimate how far, so a drafter whose own stopping rule
   runs long on a plan that barely pays (DEL's early exits) loses little per round.
4. **Probes.** While declining, every ``probe`` declined rounds one round drafts
   ``min(K, argmax_k S(k))`` tokens (the cheapest informative draft) so the estimate can recover.
   A probe that leaves the gate declining doubles the interval, up to ``probe_max`` (probing a
   plan near break-even every few rounds costs more than it tells); a probe after which the gate
   drafts, or drafting again, resets it to ``probe``. The interval carries across generations. When the plan
   cannot pay even at alpha = 1, the gate declines without probing. When the selector's plan
   changes while the gate declines (the empty draft of a declined round carries it), the next
   round is a probe, so a selector that finds a better plan (SWIFT, CLaSp) gets it tried.

Before the first drafted round (no estimate, no plan) the gate drafts, at most ``first_probe``
tokens (default 1): that round is a probe, priced like one. Without it a plan that cannot pay cost
a whole draft of the controller's length before the gate had a number (SWIFT's controller drafts
up to 25 tokens, a fixed LayerSkip exit 6 at 80% of the depth each); a plan that pays loses one
short round per gate. Without a cost model (a
decoder whose ``prepare`` was never called) the costs come from the decode state's phase timings
(`MeasuredCosts`): seconds per draft token, and the verify seconds of rounds by block size; one
plain round is declined once to time a plain step.

The acceptance statistics carry from one generation to the next (the same model and plan
usually accept alike); the per-generation counters of `DraftGate.summary` restart in `reset`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from framework.config_fields import check_choice, check_range, check_types, param
from framework.engine.cost_model import CostModel
from framework.interfaces import LengthController, PrepareView
from framework.types import Draft, LayerPlan, LengthHint, ModelInfo, Verification
from framework.view import RoundView


@dataclass(frozen=True)
class GateConfig:
    """The draft gate of a run: one config block (``gate:`` in presets, ``--gate.<field>`` on the
    command line, ``RunConfig.gate`` in Python) that wraps whatever length controller the run uses.

    Off by default (the published methods draft every round); on, it declines rounds that the
    measured acceptance and the cost model say do not pay (see the module docstring)."""

    enabled: bool = param(
        False,
        help="decline to draft (a plain step) while the measured acceptance and the cost model say "
        "drafting with the current plan does not pay; probes now and then",
    )
    margin: float = param(
        0.0,
        help="decline when the best expected speedup is below 1 - margin (> 0 tolerates small predicted "
        "losses, < 0 asks for a gain); in [-0.5, 0.5]",
    )
    probe: int = param(8, help="declined rounds before a probe round drafts again; in [1, 1024]")
    probe_max: int = param(
        256,
        help="longest interval between probes: a probe that leaves the decision unchanged doubles the "
        "interval up to this; in [probe, 4096] (= probe: no back-off)",
    )
    optimism: float = param(
        1.0,
        help="decide on the acceptance estimate plus this many standard deviations of its Beta "
        "posterior (an upper confidence bound): a few unlucky probes cannot shut the gate while "
        "the evidence is thin, and a plan that does not pay is declined once it is not; 0: the "
        "point estimate; in [0, 3]",
    )
    first_probe: int = param(
        1,
        help="the first drafted round (no acceptance measured yet) drafts at most this many tokens, as "
        "a probe; 0: the controller's own length; in [0, 64]",
    )
    cap: bool = param(
        True,
        help="while drafting, draft at most the longest length the cost model prices at break-even or "
        "better at the point estimate of the acceptance (the decision itself is taken on the bound), "
        "so a drafter whose own stopping rule runs long on a plan that barely pays cannot lose "
        "much per round; controllers of an exact length are not capped",
    )
    decay: float = param(
        0.9,
        help="weight of the acceptance statistics one drafted round older (EMA of successes and "
        "failures); in (0, 1]",
    )

    def __post_init__(self) -> None:
        check_types(self)
        check_range("margin", self.margin, -0.5, 0.5)
        check_range("probe", self.probe, 1, 1024, integer=True)
        check_range("probe_max", self.probe_max, self.probe, 4096, integer=True)
        check_range("first_probe", self.first_probe, 0, 64, integer=True)
        check_range("decay", self.decay, 0.0, 1.0, lo_open=True)
        check_range("optimism", self.optimism, 0.0, 3.0)


def speedups(
    costs: CostModel,
    alpha: float,
    plan: LayerPlan,
    max_k: int,
    draft_scale: float = 1.0,
    width: float = 1.0,
) -> list[float]:
    """``[S(1), ..., S(max_k)]``: `CostModel.expected_speedup` of drafting k tokens with ``plan``.

    ``draft_scale`` multiplies the draft step: the draft forwards a drafter runs per drafted token
    (1 for ``layer_skip``, 0 for a drafter that copies tokens without a forward). ``width``: the
    tokens verified per drafted token, so a round of k costs a verification of ``1 + k * width``
    tokens (1: a chain; a token tree verifies several candidates per drafted position, and its
    acceptance, measured per position, already counts what the extra candidates win).
    """
    if width < 1.0:
        raise ValueError(f"width must be >= 1 (a chain), got {width}")
    return [
        costs.expected_speedup(alpha, k, plan, draft_scale=draft_scale, width=width)
        for k in range(1, max_k + 1)
    ]


def gate_value(
    costs: CostModel,
    alpha: float,
    plan: LayerPlan,
    max_k: int,
    lengths: str = "upto",
    draft_scale: float = 1.0,
    width: float = 1.0,
) -> tuple[float, int]:
    """The gate's expected speedup and the best probe length: ``(max S or S(max_k), argmax S)``.

    ``argmax`` is over ``1..max_k``, the shortest on ties; ``lengths="exact"`` values the
    controller's own ``max_k`` only. ``draft_scale``, ``width``: as for `speedups`.
    """
    s = speedups(costs, alpha, plan, max_k, draft_scale, width)
    best = max(range(len(s)), key=lambda i: (s[i], -i))
    return (s[-1] if lengths == "exact" else s[best]), best + 1


def length_cap(
    costs: CostModel,
    alpha: float,
    plan: LayerPlan,
    max_k: int,
    threshold: float = 1.0,
    draft_scale: float = 1.0,
    width: float = 1.0,
) -> int:
    """The longest ``k`` in ``1..max_k`` with ``S(k) >= threshold`` at ``alpha`` (`speedups`), or the
    best ``k`` when none reaches it (at least 1): how far the gate lets a drafting round run."""
    s = speedups(costs, alpha, plan, max_k, draft_scale, width)
    ok = [i for i, v in enumerate(s) if v >= threshold]
    if ok:
        return ok[-1] + 1
    return max(range(len(s)), key=lambda i: (s[i], -i)) + 1


def break_even_alpha(
    costs: CostModel,
    plan: LayerPlan,
    max_k: int,
    lengths: str = "upto",
    margin: float = 0.0,
    draft_scale: float = 1.0,
    width: float = 1.0,
) -> float | None:
    """The smallest alpha at which the gate drafts (value ``>= 1 - margin``), to 1e-9; ``None``
    when it never does (not even at alpha = 1), 0.0 when it always does."""
    target = 1.0 - margin

    def ok(a: float) -> bool:
        return gate_value(costs, a, plan, max_k, lengths, draft_scale, width)[0] >= target

    if not ok(1.0):
        return None
    if ok(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-9:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


class MeasuredCosts:
    """Per-round measurements read from a decode state's counters and phase timings.

    Read once per round (in the controller's ``max_length``): when exactly one round was recorded
    since the last read, its draft forwards per drafted token (``forwards``: scales a cost model's
    draft step, so that a drafter that runs no forward, such as prompt lookup, drafts for free),
    its ``draft`` seconds per drafted token, its verification ``width`` (tokens verified per
    drafted token: 1 for a chain, more for a token tree) and its ``verify`` seconds (keyed by the
    verified block size) enter exponential moving averages (weight ``smoothing`` on the old
    value). `cost_model` turns the timings into a `CostModel` whose draft step is the measured one
    for every plan, for a gate without a cost model.
    """

    def __init__(self, smoothing: float = 0.8) -> None:
        self.smoothing = smoothing
        self.draft: float | None = None
        self.forwards: float | None = None
        self.width: float | None = None
        self.verify: dict[int, float] = {}
        self._stats: Any = None
        self._seen = 0
        self._t = (0.0, 0.0, 0, 0)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * old + (1.0 - self.smoothing) * new

    def update(self, state: RoundView | None) -> None:
        """Read the generation's counters (``state.stats``) for the round just finished; ``None``:
        nothing to read."""
        if state is None:
            return
        stats = state.stats
        timings = stats.timings
        t = (
            float(timings.get("draft", 0.0)),
            float(timings.get("verify", 0.0)),
            int(stats.draft_forwards),
            int(getattr(stats, "verify_tokens", 0)),
        )
        n = len(stats.rounds)
        if stats is not self._stats or n < self._seen:  # a new generation: new baseline
            self._stats, self._seen, self._t = stats, n, t
            return
        if n == self._seen + 1:
            rec = stats.rounds[-1]
            dd, dv, df, dt = (t[i] - self._t[i] for i in range(4))
            if rec.drafted > 0:
                self.draft = self._ema(self.draft, max(dd, 0.0) / rec.drafted)
                self.forwards = self._ema(self.forwards, max(df, 0) / rec.drafted)
                if dt > 1:
                    self.width = self._ema(self.width, (dt - 1) / rec.drafted)
            if dv > 0:
                key = int(dt) if dt > 0 else rec.drafted + 1
                self.verify[key] = self._ema(self.verify.get(key), dv)
        self._seen, self._t = n, t

    @property
    def needs_plain_step(self) -> bool:
        """A drafted round was timed but no plain step yet (the gate declines one round to time it)."""
        return self.draft is not None and 1 not in self.verify

    def cost_model(self, num_layers: int, max_tokens: int = 16) -> CostModel | None:
        """The measured costs as a `CostModel` (verify costs interpolated linearly between the
        measured block sizes, extrapolated beyond), or ``None`` before a draft and a plain step."""
        if self.draft is None or 1 not in self.verify:
            return None
        pts = sorted(self.verify.items())
        top = max(max_tokens, pts[-1][0])

        def at(t: int) -> float:
            if len(pts) == 1:
                return pts[0][1]
            for (t0, c0), (t1, c1) in zip(pts, pts[1:], strict=False):
                if t <= t1:
                    return c0 + (c1 - c0) * (t - t0) / (t1 - t0)
            (t0, c0), (t1, c1) = pts[-2], pts[-1]
            return c1 + max(0.0, (c1 - c0) / (t1 - t0)) * (t - t1)  # never below the largest

        return CostModel(
            num_layers=num_layers,
            base=self.draft,
            attn=0.0,
            mlp=0.0,
            verify_costs=tuple(max(at(t), 1e-12) for t in range(1, top + 1)),
            device="measured",
        )


class DraftGate:
    """Decline to draft while the statistics say drafting does not pay (see the module docstring).

    `GatedLength` puts one around a length controller; a drafter may gate a source of its own
    (``hybrid``'s ``skip_gate``). Use: ``prepare(ctx)`` once, ``reset()`` per generation,
    ``k = gate.limit(state, k)`` per round (idempotent within a round),
    ``gate.observe(draft, result)`` after each verification, ``summary()`` under the key
    ``"gate"`` of the owner's summary.

    Args:
        config: the gate's settings (validated by `GateConfig`; ``enabled`` is not consulted).
        lengths: ``"upto"`` values the best length in ``1..K``; ``"exact"`` the controller's K
            (a controller with ``exact_length``).
    """

    def __init__(self, config: GateConfig | None = None, lengths: Literal["upto", "exact"] = "upto") -> None:
        config = GateConfig() if config is None else config
        check_choice("lengths", lengths, ("upto", "exact"))
        self.config = config
        self.margin, self.probe, self.probe_max, self.decay = (
            config.margin,
            config.probe,
            config.probe_max,
            config.decay,
        )
        self.optimism = config.optimism
        self.first_probe = config.first_probe
        self.cap = config.cap and lengths == "upto"
        self.lengths = lengths
        self.costs: CostModel | None = None
        self.measured = MeasuredCosts()
        self.acc = self.rej = 0.0  # decayed successes / failures
        self.plan: LayerPlan | None = None  # the plan of the last drafted round
        self._selector_plan: LayerPlan | None = None  # the plan of the last empty draft
        self.replan = False
        self.interval = self.probe
        self.wait = self.probe
        self.mode = "draft"
        self._k = 0
        self._memo: dict[tuple[Any, ...], tuple[CostModel, tuple[float, int]]] = {}
        self.reset()

    # ---- lifecycle ---------------------------------------------------------------------------
    def prepare(self, ctx: PrepareView) -> None:
        """Take the measured cost model of the run (measured once per experiment, shared)."""
        self.costs = ctx.cost_model()

    def set_costs(self, costs: CostModel | None) -> None:
        """Use ``costs`` (``None``: measure from the decode state's timings)."""
        self.costs = costs

    def forget(self) -> None:
        """Drop the acceptance statistics and the plan (the gate knows nothing again), for a source
        whose acceptance belongs to one generation's text, such as copies from its context."""
        self.acc = self.rej = 0.0
        self.plan = None

    def reset(self) -> None:
        """Start a generation: counters restart; the acceptance statistics, the plan and the probe
        interval carry over (the next generation is decoded by the same model and plan)."""
        self.rounds = 0
        self.declined = 0
        self.probes = 0
        self.calibration = 0
        self.mode = "draft"

    # ---- statistics ----------------------------------------------------------------------------
    @property
    def alpha(self) -> float | None:
        """The acceptance estimate, or ``None`` before any drafted round."""
        n = self.acc + self.rej
        return self.acc / n if n > 0 else None

    @property
    def alpha_bound(self) -> float | None:
        """What the gate decides on: `alpha` plus ``optimism`` standard deviations of the Beta
        posterior of the decayed counts (``Beta(acc + 1, rej + 1)``), at most 1; ``None`` before
        any drafted round."""
        alpha = self.alpha
        if alpha is None or self.optimism <= 0:
            return alpha
        a, b = self.acc + 1.0, self.rej + 1.0
        sd = (a * b / ((a + b) ** 2 * (a + b + 1.0))) ** 0.5
        return min(1.0, alpha + self.optimism * sd)

    @property
    def trials(self) -> float:
        """The decayed number of observed trials behind `alpha`."""
        return self.acc + self.rej

    def current_costs(self, state: RoundView | None = None) -> CostModel | None:
        """The cost model in use: the prepared one, else the measured costs (``None`` before any).

        Reads the state's counters for the last round first (`MeasuredCosts.update`)."""
        self.measured.update(state)
        return self._known_costs()

    def _known_costs(self) -> CostModel | None:
        """The prepared cost model, else the measured costs so far (no counters read)."""
        if self.costs is not None:
            return self.costs
        return self.measured.cost_model(self.plan.num_layers if self.plan is not None else 1)

    @property
    def draft_scale(self) -> float:
        """Draft forwards per drafted token, which scale the cost model's draft step (1 until
        measured; measured costs already price a drafted token)."""
        if self.costs is None or self.measured.forwards is None:
            return 1.0
        return self.measured.forwards

    @property
    def width(self) -> float:
        """Tokens verified per drafted token (1 for a chain, more for a token tree; 1 until
        measured): a round of k pays for a verification of ``1 + k * width`` tokens."""
        return 1.0 if self.measured.width is None else max(1.0, self.measured.width)

    def _value(self, costs: CostModel, alpha: float, k: int) -> tuple[float, int]:
        # Memoised: while the gate declines, nothing it depends on changes from round to round,
        # and pricing up to K lengths twice a round is a measurable share of a plain step.
        key = (id(costs), alpha, self.plan, k, self.draft_scale, self.width)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is costs:
            return hit[1]
        value = gate_value(costs, alpha, self.plan, k, self.lengths, self.draft_scale, self.width)
        if len(self._memo) >= 64:
            self._memo.clear()
        self._memo[key] = (costs, value)
        return value

    def predict(self, state: RoundView | None, k: int) -> float | None:
        """The gate's value of drafting up to ``k`` tokens this round (the expected speedup at the
        acceptance bound, priced at the round's context), without deciding anything or reading the
        round's counters; ``None`` before a drafted round or without costs. What a drafter that
        chooses among sources compares (`strategies.drafters.cascade`)."""
        costs = self._known_costs()
        alpha = self.alpha_bound
        if costs is None or self.plan is None or alpha is None or k <= 0:
            return None
        if state is not None:
            costs = costs.at_context(state.num_tokens)
        return self._value(costs, alpha, k)[0]

    def _capped(self, costs: CostModel, k: int, threshold: float) -> int:
        """``k`` capped at `length_cap` of the point estimate (memoised like `_value`)."""
        alpha = self.alpha
        assert alpha is not None and self.plan is not None
        key = ("cap", id(costs), alpha, self.plan, k, self.draft_scale, self.width, threshold)
        hit = self._memo.get(key)
        if hit is None or hit[0] is not costs:
            cap = length_cap(costs, alpha, self.plan, k, threshold, self.draft_scale, self.width)
            if len(self._memo) >= 64:
                self._memo.clear()
            hit = self._memo[key] = (costs, (float(cap), cap))
        return min(k, hit[1][1])

    # ---- per round -----------------------------------------------------------------------------
    def limit(self, state: RoundView | None, k: int) -> int:
        """The draft length of this round given the controller's ``k``: ``k``, 0 or a probe length.
        The costs are priced at the round's context (`CostModel.at_context`)."""
        costs = self.current_costs(state)
        if costs is not None and state is not None:
            costs = costs.at_context(state.num_tokens)
        if k <= 0:
            self.mode = "none"
            return 0
        self._k = k
        alpha = self.alpha_bound
        if costs is None or self.plan is None or alpha is None:
            if costs is None and self.measured.needs_plain_step:
                self.mode = "calibrate"
                return 0
            if alpha is None and self.first_probe > 0:  # nothing measured: a short probe first
                self.mode = "probe"
                return min(k, self.first_probe)
            self.mode = "draft"
            return k
        value, k_best = self._value(costs, alpha, k)
        threshold = 1.0 - self.margin
        if value >= threshold:
            self.mode = "draft"
            return self._capped(costs, k, threshold) if self.cap else k
        if self.replan:
            self.mode = "probe"
            return min(k, k_best)
        if self.costs is not None and self._value(costs, 1.0, k)[0] < threshold:
            self.mode = "decline"  # cannot pay at any acceptance: no probe until the plan changes
            return 0
        if self.wait <= 0:
            self.mode = "probe"
            return min(k, k_best)
        self.mode = "decline"
        return 0

    def observe(self, draft: Draft, result: Verification) -> None:
        """Update after a verification (every round, declined ones included)."""
        self.rounds += 1
        k = draft.length
        if k > 0:
            self.plan = draft.plan  # what the draft ran (an early-exit drafter's own prefix plan)
            m = result.accepted
            w = self.decay
            self.acc = w * self.acc + m
            self.rej = w * self.rej + (1.0 if m < k else 0.0)
        else:
            # An empty draft carries the selector's plan: when it changes while the gate declines,
            # probe the new plan next round (even if the old one could never pay).
            if (
                self._selector_plan is not None
                and draft.plan != self._selector_plan
                and self.mode == "decline"
            ):
                self.replan = True
            self._selector_plan = draft.plan
        mode, self.mode = self.mode, "draft"
        if mode == "decline":
            self.declined += 1
            self.wait -= 1
        elif mode == "calibrate":
            self.calibration += 1
        elif mode == "probe" and k > 0:
            self.probes += 1
            self.replan = False
            costs = self._known_costs()
            alpha = self.alpha_bound
            still = (
                costs is not None
                and alpha is not None
                and self._value(costs, alpha, max(self._k, 1))[0] < 1.0 - self.margin
            )
            if still:  # the probe did not change the decision: probe half as often
                self.interval = min(2 * self.interval, self.probe_max)
            else:
                self.interval = self.probe
            self.wait = self.interval
        elif mode == "draft" and k > 0:
            self.interval = self.probe
            self.wait = self.interval

    # ---- reporting -----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Per-generation counters and the current estimate (JSON-friendly)."""
        alpha, bound = self.alpha, self.alpha_bound
        costs = self._known_costs()
        k = max(self._k, 1)
        speedup = best_k = even = None
        if costs is not None and self.plan is not None:
            if bound is not None:
                speedup, best_k = self._value(costs, bound, k)
                speedup = round(speedup, 4)
            even = break_even_alpha(
                costs, self.plan, k, self.lengths, self.margin, self.draft_scale, self.width
            )
            even = None if even is None else round(even, 4)
        return {
            "rounds": self.rounds,
            "declined": self.declined,
            "declined_share": round(self.declined / self.rounds, 4) if self.rounds else 0.0,
            "probes": self.probes,
            "calibration_rounds": self.calibration,
            "alpha": None if alpha is None else round(alpha, 4),
            "alpha_bound": None if bound is None else round(bound, 4),
            "trials": round(self.trials, 3),
            "expected_speedup": speedup,
            "best_k": best_k,
            "break_even_alpha": even,
            "draft_forwards_per_token": None
            if self.measured.forwards is None
            else round(self.measured.forwards, 4),
            "verify_width": round(self.width, 4),
            "probe_interval": self.interval,
            "costs": "cost_model"
            if self.costs is not None
            else ("measured" if costs is not None else "none"),
        }


class GatedLength(LengthController):
    """Any `LengthController` with the draft gate around it.

    The wrapped controller proposes a length (its ``max_length``); the gate turns it into 0 for a
    round that does not pay, or into a short probe. Everything else (``should_continue``, the
    capability flags, the statistics) is the wrapped controller's, so a controller is gated
    without knowing it. Its summary gains a ``"gate"`` entry.

    Args:
        inner: the controller to gate; with ``exact_length`` the gate values drafting exactly K,
            otherwise the best length up to K.
        config: the gate's settings (``enabled`` is not consulted here: see `gated`).
    """

    def __init__(self, inner: LengthController, config: GateConfig | None = None) -> None:
        config = GateConfig(enabled=True) if config is None else config
        super().__init__(config)
        self.inner = inner
        self.needs_confidence = inner.needs_confidence  # type: ignore[misc]
        self.exact_length = inner.exact_length  # type: ignore[misc]
        self.gate = DraftGate(config, lengths="exact" if inner.exact_length else "upto")

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    def setup(self, info: ModelInfo) -> None:
        self.inner.setup(info)

    def prepare(self, ctx: PrepareView) -> None:
        self.inner.prepare(ctx)
        self.gate.prepare(ctx)

    def reset(self) -> None:
        self.inner.reset()
        self.gate.reset()

    def max_length(self, state: RoundView, hint: LengthHint | None = None) -> int:
        return self.gate.limit(state, self.inner.max_length(state, hint))

    def max_draft_length(self) -> int | None:
        return self.inner.max_draft_length()

    @property
    def needs_phase_timings(self) -> bool:
        """A gate without a cost model prices drafts from the decode state's phase timings
        (`MeasuredCosts`), so the decoder must time the phases even on CUDA."""
        return self.gate.config.enabled and self.gate.costs is None

    def should_continue(self, drafted: int, confidence: float | None) -> bool:
        return self.inner.should_continue(drafted, confidence)

    def observe(self, state: RoundView, draft: Draft, result: Verification) -> None:
        self.gate.observe(draft, result)
        self.inner.observe(state, draft, result)

    def summary(self) -> dict[str, Any]:
        return {**self.inner.summary(), "gate": self.gate.summary()}


def gated(length: LengthController, config: GateConfig) -> LengthController:
    """``length`` wrapped in the draft gate when ``config.enabled``, else ``length`` itself."""
    return GatedLength(length, config) if config.enabled else length


__all__ = [
    "DraftGate",
    "GateConfig",
    "GatedLength",
    "MeasuredCosts",
    "break_even_alpha",
    "gate_value",
    "gated",
    "length_cap",
    "speedups",
]
