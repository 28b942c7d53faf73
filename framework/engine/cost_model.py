"""A measured cost model of one model on one machine: what a draft step and a verification cost.

Speculative decoding wins only if ``drafted * draft_step + verify(drafted + 1)`` per round is less
than one plain step per committed token. The model here is measured, not assumed:

- a draft step (one token through a `LayerPlan`) costs ``base + attn * (attention sub-layers run)
  + mlp * (MLP sub-layers run)``, where ``base`` is the embedding, final norm and LM head; the three
  coefficients come from timing four plans (full, no attention, no MLP, nothing) on a warm cache;
- a full forward over T new tokens (verification, T = 1 is a plain decoding step) is timed for
  every T up to ``max_tokens`` and extrapolated linearly beyond;
- the context: attention reads every cached position, so ``attn`` and the verification costs are
  measured at two cache lengths (``context``, 128, and ``far_context``, 1024 where the model
  allows) and `CostModel.at_context` re-prices them linearly for any other (KnapSpec prices
  sub-layers by context the same way); the gate and the reports' "its rounds" prediction price
  each round at its own context;
- ``head``, the final norm and LM head of one token, is timed on its own (it is part of ``base``);
  drafts that score a reduced vocabulary (`framework.engine.draft_head.DraftHead`) are priced with
  their own head: `CostModel.measure` with ``draft_head``, or `CostModel.with_head` from the
  full-head model.

Used by ``selfsd_bo``'s deterministic objective (modelled time per token of a decode whose rounds
are counted, not timed) and by reports that put a measured speedup next to what the cost model
predicts for the measured acceptance.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from framework.engine.state import DecodeState
from framework.types import LayerPlan
from framework.utils import FrameworkWarning, device_sync

if TYPE_CHECKING:
    from framework.engine.draft_head import DraftHead
    from framework.kernels.protocols import DraftWeights


@dataclass(frozen=True)
class CostModel:
    """Seconds per forward, measured (see `CostModel.measure`).

    Attributes:
        num_layers: L, the blocks of the model measured.
        base: a one-token draft forward that skips every sub-layer (embedding, final norm and the
            draft's LM head: the full head, or the reduced head of ``draft_vocab`` tokens).
        attn: one attention sub-layer, one token.
        mlp: one MLP sub-layer, one token.
        verify_costs: ``verify_costs[T - 1]`` = a full forward over T new tokens (T = 1: one plain step).
        context: the cache length the costs were measured at.
        device: where they were measured.
        head: the final norm and the draft's LM head of one token (part of ``base``; 0: not
            measured).
        full_head: the final norm and the full LM head of one token (what a verification pays per
            position; 0: not measured).
        draft_vocab: K of the reduced draft head ``base`` and ``head`` were priced with; 0: the
            full vocabulary.
        draft_weights: the storage of the weights the draft steps (``attn``, ``mlp``) were timed
            with: ``"float32"``, the model's own; ``"bfloat16"``, ``"int8"`` or ``"int4"``, a compressed copy
            (`framework.engine.adapter.ModelAdapter.draft_branches`).
        far_context: a second cache length the context-dependent costs were measured at (0: none,
            the costs are the same at every context).
        far_attn: ``attn`` at ``far_context``.
        far_verify_costs: ``verify_costs`` at ``far_context``.
        inconsistent: what stayed inconsistent when the costs were measured (a cost that fell as
            the context grew: the machine was loaded), ``""`` when nothing did. Such a model's
            far costs were raised to the near ones so that it can still price a round, but the
            reports print no prediction from it (`LOADED`).
    """

    num_layers: int
    base: float
    attn: float
    mlp: float
    verify_costs: tuple[float, ...]
    context: int = 0
    device: str = "cpu"
    head: float = 0.0
    full_head: float = 0.0
    draft_vocab: int = 0
    draft_weights: str = "float32"
    far_context: int = 0
    far_attn: float = 0.0
    far_verify_costs: tuple[float, ...] = ()
    inconsistent: str = ""

    def __post_init__(self) -> None:
        if not self.verify_costs:
            raise ValueError("verify_costs needs at least the T = 1 cost")
        if self.far_context and len(self.far_verify_costs) != len(self.verify_costs):
            raise ValueError("far_verify_costs needs one cost per verify_costs entry")

    def at_context(self, tokens: int) -> CostModel:
        """These costs at a cache of ``tokens`` positions (rounded to a multiple of `CONTEXT_STEP`,
        so that nearby lengths share one instance): ``attn`` and each verification cost move
        linearly between their values at ``context`` and at ``far_context``, extrapolated beyond
        either end, never below half their value at ``context``; ``base`` and ``mlp`` do not
        depend on the context. Itself when only one context was measured."""
        if not self.far_context or self.far_context <= self.context:
            return self
        return _priced_at(self, max(CONTEXT_STEP, round(tokens / CONTEXT_STEP) * CONTEXT_STEP))

    # ---- costs ---------------------------------------------------------------------------
    @property
    def step(self) -> float:
        """One plain decoding step (a full forward over one token)."""
        return self.verify_costs[0]

    def draft_step(self, plan: LayerPlan) -> float:
        """One token through ``plan``."""
        n = plan.num_layers
        attn_run = sum(plan.runs_attn(i) for i in range(n))
        mlp_run = sum(plan.runs_mlp(i) for i in range(n))
        return self.base + self.attn * attn_run + self.mlp * mlp_run

    def verify(self, tokens: int) -> float:
        """A full forward over ``tokens`` new tokens.

        Past the measured range: linear extrapolation with the mean slope of the upper half of the
        table, never negative (the last two sizes alone can differ by less than their noise, and a
        negative slope would price a 200-token tree verification below one step).
        """
        if tokens < 1:
            raise ValueError(f"a verification covers >= 1 token, got {tokens}")
        costs = self.verify_costs
        n = len(costs)
        if tokens <= n:
            return costs[tokens - 1]
        if n == 1:
            slope = costs[0]
        else:
            h = n // 2
            slope = max(0.0, (costs[-1] - costs[h - 1]) / (n - h))
        return costs[-1] + slope * (tokens - n)

    def verify_at(self, tokens: float) -> float:
        """`verify` at a fractional block size (linear between the integer sizes): the mean cost
        of a verifier whose block size varies, e.g. a token tree of ``width`` nodes per drafted
        position, ``verify_at(1 + k * width)``."""
        lo = max(1, int(tokens))
        frac = tokens - lo
        if frac <= 0.0:
            return self.verify(lo)
        return (1.0 - frac) * self.verify(lo) + frac * self.verify(lo + 1)

    def round_time(self, k: int, plan: LayerPlan, *, draft_scale: float = 1.0, width: float = 1.0) -> float:
        """Modelled seconds of one round: ``k`` draft steps of ``plan`` plus a verification of
        ``1 + k * width`` tokens. The one pricing of a round that the gate, the reports, the
        search objectives and the reproduction script share.

        Args:
            k: tokens drafted (0: a plain step).
            plan: what the draft ran.
            draft_scale: draft forwards per drafted token (1 for a layer-skip drafter; 0 prices a
                drafter that copies tokens without a forward, such as prompt lookup, as free).
            width: tokens verified per drafted token (1 for a chain; a token tree verifies several
                candidates per drafted position).
        """
        if k == 0:
            return self.step
        return k * self.draft_step(plan) * draft_scale + self.verify_at(1.0 + k * width)

    def decode_time(self, plan: LayerPlan, draft_lengths: Sequence[int]) -> float:
        """Modelled seconds of the rounds of one decode (prefill excluded): `round_time` summed."""
        return sum(self.round_time(k, plan) for k in draft_lengths)

    @staticmethod
    def expected_tokens(alpha: float, k: int) -> float:
        """Tokens committed per round of ``k`` drafted tokens when each is accepted with
        probability ``alpha`` independently (the chain model of Leviathan et al.), bonus included."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        return k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)

    def expected_speedup(
        self, alpha: float, k: int, plan: LayerPlan, *, draft_scale: float = 1.0, width: float = 1.0
    ) -> float:
        """Speedup over plain decoding of drafting ``k`` tokens every round at acceptance ``alpha``:
        `expected_tokens` per `round_time`, in plain steps. ``k = 0`` is plain decoding (1.0).
        ``draft_scale``, ``width``: as for `round_time`."""
        tokens = self.expected_tokens(alpha, k)
        if k == 0:
            return 1.0
        return tokens * self.step / self.round_time(k, plan, draft_scale=draft_scale, width=width)

    def ceiling(
        self, alpha: float, plan: LayerPlan, max_k: int = 16, *, draft_scale: float = 1.0
    ) -> tuple[float, int]:
        """The best `expected_speedup` over draft lengths ``0..max_k``: ``(speedup, k)``."""
        best = max(
            (self.expected_speedup(alpha, k, plan, draft_scale=draft_scale), -k) for k in range(max_k + 1)
        )
        return best[0], -best[1]

    # ---- (de)serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verify_costs"] = list(self.verify_costs)
        d["far_verify_costs"] = list(self.far_verify_costs)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        d = dict(d)
        d["verify_costs"] = tuple(d["verify_costs"])
        d["far_verify_costs"] = tuple(d.get("far_verify_costs", ()))
        return cls(**d)

    def describe(self) -> str:
        ms = 1e3
        head = f"the {self.draft_vocab}-token draft head" if self.draft_vocab else "the full LM head"
        weights = "" if self.draft_weights == "float32" else f" ({self.draft_weights} weights)"
        text = (
            f"step {self.step * ms:.2f} ms; draft step = {self.base * ms:.2f} ms (embedding, {head}) + "
            f"{self.attn * ms:.3f} ms per attention + {self.mlp * ms:.3f} ms per MLP sub-layer{weights}; verify of 4 "
            f"tokens {self.verify(4) / self.step:.2f} steps, of 8 tokens {self.verify(8) / self.step:.2f} steps"
        )
        if self.inconsistent:
            text += f" ({LOADED}: {self.inconsistent})"
        if self.far_context:
            far = self.at_context(self.far_context)
            text += (
                f"; at context {self.far_context}: step {far.step * ms:.2f} ms, {far.attn * ms:.3f} ms per "
                f"attention, verify of 8 tokens {far.verify(8) / far.step:.2f} steps"
            )
        return text

    def with_head(
        self, adapter: Any, head: DraftHead | None, *, reps: int = 31, weights: DraftWeights | None = None
    ) -> CostModel:
        """This cost model with draft steps priced for ``head`` (``None``: the full LM head), scored
        as a draft with compressed ``weights`` scores it (`DraftHead.logits`).

        Times the final norm + LM head of one token with the full head and with ``head``
        (interleaved, medians) and scales the full head's share of ``base`` by their ratio, so that
        a cost model in any unit (a synthetic one of tests) keeps its unit. The share is the
        measured ``full_head`` (or this timing), never more than ``base`` itself (the two are
        separate measurements).
        """
        full_s, draft_s = head_seconds(adapter, head, reps=reps, weights=weights)
        ratio = draft_s / full_s if full_s > 0 else 1.0
        full_part = self.full_head or self.head or full_s
        base_full = self.base - self.head + full_part if self.draft_vocab else self.base
        full_part = min(full_part, base_full)
        new_head = full_part * ratio
        return replace(
            self,
            base=base_full - full_part + new_head,
            head=new_head,
            full_head=full_part,
            draft_vocab=0 if head is None else head.size,
        )

    def with_weights(self, adapter: Any, weights: DraftWeights | None, *, reps: int = 7) -> CostModel:
        """This cost model with its draft sub-layers priced for ``weights`` (a draft's compressed
        copy, `framework.engine.adapter.ModelAdapter.draft_branches`; ``None``: the model's own).

        Times draft steps through every attention sub-layer, every MLP sub-layer and neither, with
        the model's own weights and with ``weights`` (interleaved, medians), and scales ``attn`` and
        ``mlp`` by the measured ratios, so that a cost model in any unit keeps its unit. ``base``
        (embedding, final norm, head) and the verification costs do not change: a reduced head that
        the compressed draft scores from its own copy is re-priced by `with_head`.
        """
        if weights is None or weights.weights == "float32":
            return replace(self, draft_weights="float32")
        own, comp = draft_sublayer_seconds(adapter, (None, weights), reps=reps)
        ratio_attn = comp[0] / own[0] if own[0] > 0 else 1.0
        ratio_mlp = comp[1] / own[1] if own[1] > 0 else 1.0
        return replace(
            self,
            attn=self.attn * ratio_attn,
            far_attn=self.far_attn * ratio_attn,
            mlp=self.mlp * ratio_mlp,
            draft_weights=weights.weights,
        )

    # ---- measurement --------------------------------------------------------------------------
    @classmethod
    @torch.inference_mode()
    def measure(
        cls,
        adapter: Any,
        *,
        max_tokens: int = 16,
        context: int = 128,
        far_context: int = 1024,
        reps: int = 7,
        draft_head: DraftHead | None = None,
        draft_weights: DraftWeights | None = None,
        log: Callable[[str], None] | None = None,
    ) -> CostModel:
        """Time the model through ``adapter`` on a random prompt of ``context`` tokens, and the
        context-dependent costs (attention, verifications) again on one of ``far_context`` tokens
        (clamped to what the model allows; skipped when that is not longer than ``context``).

        The measurements are interleaved (every rep times every plan and every T once, at both
        contexts), after one warm-up pass, and the median of ``reps`` is kept, so slow drift on a
        shared machine hits every quantity alike. Draft steps run with ``draft_head`` (``None``:
        the full LM head) and ``draft_weights`` (``None``: the model's own weights).

        A cost that falls as the context grows (a step, a verification or an attention sub-layer
        cheaper at ``far_context`` than at ``context``: only a loaded machine measures that) is
        measured once more, within a budget of the first measurement's own time (repetitions stop
        when it is spent); if it stays, the far costs are raised to the near ones (a cost never
        falls with the context), the model says what stayed ``inconsistent`` (the reports then
        print no prediction from it) and a `CostModelWarning` names it. ``log``: where a line
        about the re-measurement goes (``None``: nowhere).
        """
        if max_tokens < 2 or context < 1 or reps < 1:
            raise ValueError("need max_tokens >= 2, context >= 1 and reps >= 1")
        args = (adapter, max_tokens, context, far_context, reps, draft_head, draft_weights)
        start = time.perf_counter()
        model = cls._measure_once(*args)
        took = time.perf_counter() - start
        problem = context_inconsistency(model)
        if not problem:
            return model
        if log is not None:
            log(
                f"[selfspec] the cost model was inconsistent ({problem}); measuring again, at most {took:.0f} s"
            )
        model = cls._measure_once(*args, deadline=time.perf_counter() + took)
        problem = context_inconsistency(model)
        if not problem:
            return model
        warnings.warn(
            CostModelWarning(
                f"the cost model stayed inconsistent after a second measurement ({problem}): the machine "
                "is probably loaded; the far-context costs are raised to the near ones and no prediction "
                "is reported from it"
            ),
            stacklevel=2,
        )
        return replace(monotone_in_context(model), inconsistent=problem)

    @classmethod
    def _measure_once(
        cls,
        adapter: Any,
        max_tokens: int,
        context: int,
        far_context: int,
        reps: int,
        draft_head: DraftHead | None,
        draft_weights: DraftWeights | None,
        deadline: float | None = None,
    ) -> CostModel:
        """One interleaved measurement (see `measure`); past ``deadline`` (a `time.perf_counter`
        value) no further repetition starts, one at least is always timed."""
        info = adapter.arch.info()
        n = info.num_layers
        context = min(context, info.max_context - max_tokens - 2)
        far_context = min(far_context, info.max_context - max_tokens - 2)
        gen = torch.Generator().manual_seed(0)
        block = torch.randint(0, info.vocab_size, (1, max_tokens), generator=gen).to(adapter.arch.device)
        near = _Probe(adapter, context, max_tokens, gen, draft_head, draft_weights)
        jobs = near.jobs(block, range(1, max_tokens + 1), ("full", "no_attn", "no_mlp", "none"))
        far = None
        # With CUDA graphs the KV pool serves one cache at a time: a second probe would run
        # eagerly and price the far context with another engine, so it is left out.
        if far_context > context and adapter.executor.graphs is None:
            far = _Probe(adapter, far_context, max_tokens, gen, draft_head, draft_weights)
            far_sizes = sorted({1, 2, 4, 8, max_tokens} & set(range(1, max_tokens + 1)))
            jobs += far.jobs(block, far_sizes, ("full", "no_attn"), tag="far")
        samples: dict[Any, list[float]] = {key: [] for key, _ in jobs}
        for rep in range(reps + 1):  # rep 0 is the warm-up
            for key, fn in jobs:
                t = _timed(adapter.arch.device, fn)
                if rep:
                    samples[key].append(t)
            if rep and deadline is not None and time.perf_counter() > deadline:
                break
        for probe in (near, far):
            if probe is not None:
                probe.close()
        med = {k: statistics.median(v) for k, v in samples.items()}
        full_head, head = head_seconds(adapter, draft_head, reps=4 * reps + 3, weights=draft_weights)
        verify = tuple(med[t] for t in range(1, max_tokens + 1))
        far_fields: dict[str, Any] = {}
        if far is not None:
            far_fields = {
                "far_context": far_context,
                "far_attn": max(0.0, (med["far", "full"] - med["far", "no_attn"]) / n),
                "far_verify_costs": _fill_sizes({t: med["far", t] for t in far_sizes}, verify),
            }
        return cls(
            num_layers=n,
            base=med["none"],
            attn=max(0.0, (med["full"] - med["no_attn"]) / n),
            mlp=max(0.0, (med["full"] - med["no_mlp"]) / n),
            verify_costs=verify,
            context=context,
            device=str(adapter.arch.device),
            head=head,
            full_head=full_head,
            draft_vocab=0 if draft_head is None else draft_head.size,
            draft_weights="float32" if draft_weights is None else draft_weights.weights,
            **far_fields,
        )


#: What the reports print in place of a prediction from an `CostModel.inconsistent` cost model.
LOADED = "n/a: the machine was loaded while the costs were measured"


class CostModelWarning(FrameworkWarning):
    """A cost model measured on a loaded machine stayed inconsistent (see `CostModel.measure`)."""


#: How much cheaper a far-context cost may measure than its near-context value before the
#: measurement counts as inconsistent (timer noise on an idle machine stays well inside it).
CONTEXT_TOLERANCE = 0.10


def context_inconsistency(model: CostModel, tolerance: float = CONTEXT_TOLERANCE) -> str:
    """What falls as the context grows in ``model`` (beyond ``tolerance``), or ``""``."""
    if not model.far_context or model.far_context <= model.context:
        return ""
    problems = []
    for t, (near, far) in enumerate(zip(model.verify_costs, model.far_verify_costs, strict=False), 1):
        if far < near * (1.0 - tolerance):
            problems.append(
                f"a forward of {t} token(s) took {1e3 * far:.2f} ms at context {model.far_context} and "
                f"{1e3 * near:.2f} ms at context {model.context}"
            )
            break
    if model.attn > 0 and model.far_attn < model.attn * (1.0 - tolerance):
        problems.append(
            f"an attention sub-layer took {1e3 * model.far_attn:.3f} ms at context {model.far_context} and "
            f"{1e3 * model.attn:.3f} ms at context {model.context}"
        )
    return "; ".join(problems)


def monotone_in_context(model: CostModel) -> CostModel:
    """``model`` with each far-context cost raised to at least its near-context value."""
    if not model.far_context:
        return model
    far = tuple(max(f, n) for f, n in zip(model.far_verify_costs, model.verify_costs, strict=False))
    return replace(model, far_verify_costs=far, far_attn=max(model.far_attn, model.attn))


class _Probe:
    """A warm decode state over a random prompt of ``context`` tokens whose draft steps and
    verifications `CostModel.measure` times."""

    def __init__(
        self, adapter: Any, context: int, max_tokens: int, gen: torch.Generator, head: Any, weights: Any
    ):
        info = adapter.arch.info()
        prompt = torch.randint(0, info.vocab_size, (1, context), generator=gen).to(adapter.arch.device)
        self.state = DecodeState(adapter, prompt, context + max_tokens + 8)
        self.state.append(self.state.prefill().argmax(-1)[:, None])
        self.state.draft_head = head
        self.state.draft_weights = weights
        n = info.num_layers
        every = range(n)
        self.plans = {
            "full": LayerPlan.full(n),
            "no_attn": LayerPlan.from_indices(n, attn=every),
            "no_mlp": LayerPlan.from_indices(n, mlp=every),
            "none": LayerPlan.from_indices(n, attn=every, mlp=every),
        }

    def _draft(self, plan: LayerPlan) -> None:
        self.state.forward_draft(self.state.pending, plan)
        self.state.discard_draft()

    def jobs(
        self, block: torch.Tensor, sizes: Sequence[int], plans: Sequence[str], tag: str | None = None
    ) -> list[tuple[Any, Callable[[], Any]]]:
        """``(key, fn)`` pairs: a draft step per plan name, a verification per block size; keys are
        the plan name or size, or ``(tag, name or size)``."""
        key = (lambda k: k) if tag is None else (lambda k: (tag, k))
        out: list[tuple[Any, Callable[[], Any]]] = [
            (key(name), functools.partial(self._draft, self.plans[name])) for name in plans
        ]
        for t in sizes:
            out.append((key(t), functools.partial(self.state.forward_verify, block[:, :t], logits_at="all")))
        return out

    def close(self) -> None:
        self.state.discard_draft()
        self.state.cache.release()


def _timed(device: Any, fn: Callable[[], Any]) -> float:
    device_sync(device)
    t = time.perf_counter()
    fn()
    device_sync(device)
    return time.perf_counter() - t


def _fill_sizes(measured: dict[int, float], near: tuple[float, ...]) -> tuple[float, ...]:
    """Costs for every block size 1..len(near) from those ``measured`` at some sizes: the measured
    ones, and between them the near costs shifted by the linearly interpolated difference."""
    sizes = sorted(measured)
    delta = {t: measured[t] - near[t - 1] for t in sizes}
    out = []
    for t in range(1, len(near) + 1):
        lo = max((s for s in sizes if s <= t), default=sizes[0])
        hi = min((s for s in sizes if s >= t), default=sizes[-1])
        d = delta[lo] if hi == lo else delta[lo] + (delta[hi] - delta[lo]) * (t - lo) / (hi - lo)
        out.append(measured[t] if t in measured else near[t - 1] + d)
    return tuple(out)


#: `CostModel.at_context` prices contexts in steps of this many positions.
CONTEXT_STEP = 64


@functools.lru_cache(maxsize=512)
def _priced_at(costs: CostModel, tokens: int) -> CostModel:
    """`CostModel.at_context` for a bucketed length (cached: the gate prices every round)."""
    f = (tokens - costs.context) / (costs.far_context - costs.context)

    def lerp(near: float, far: float) -> float:
        return max(0.5 * near, near + f * (far - near))

    verify = tuple(lerp(n, x) for n, x in zip(costs.verify_costs, costs.far_verify_costs, strict=True))
    return replace(
        costs,
        attn=lerp(costs.attn, costs.far_attn),
        verify_costs=verify,
        context=tokens,
        far_context=0,
        far_attn=0.0,
        far_verify_costs=(),
    )


@torch.inference_mode()
def draft_sublayer_seconds(
    adapter: Any, weights: Sequence[DraftWeights | None], *, context: int = 128, reps: int = 7
) -> list[tuple[float, float]]:
    """Seconds of one attention and one MLP sub-layer of a one-token draft step, for each of
    ``weights`` (``None``: the model's own): ``[(attn, mlp), ...]``. From draft steps through every
    attention sub-layer, every MLP sub-layer and neither, interleaved after a warm-up, medians."""
    info = adapter.arch.info()
    n = info.num_layers
    context = min(context, info.max_context - 10)
    prompt = torch.randint(0, info.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    state = DecodeState(adapter, prompt.to(adapter.arch.device), context + 8)
    state.append(state.prefill().argmax(-1)[:, None])
    every = range(n)
    plans = {
        "attn": LayerPlan.from_indices(n, mlp=every),
        "mlp": LayerPlan.from_indices(n, attn=every),
        "none": LayerPlan.from_indices(n, attn=every, mlp=every),
    }
    samples: dict[tuple[int, str], list[float]] = {(w, p): [] for w in range(len(weights)) for p in plans}
    for rep in range(reps + 1):  # rep 0 is the warm-up
        for w, wts in enumerate(weights):
            state.draft_weights = wts
            for name, plan in plans.items():
                device_sync(adapter.arch.device)
                t = time.perf_counter()
                state.forward_draft(state.pending, plan, logits_at=None)
                device_sync(adapter.arch.device)
                if rep:
                    samples[(w, name)].append(time.perf_counter() - t)
                state.discard_draft()
    state.cache.release()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return [
        (
            max(0.0, (med[(w, "attn")] - med[(w, "none")]) / n),
            max(0.0, (med[(w, "mlp")] - med[(w, "none")]) / n),
        )
        for w in range(len(weights))
    ]


@torch.inference_mode()
def head_seconds(
    adapter: Any, head: DraftHead | None = None, *, reps: int = 31, weights: DraftWeights | None = None
) -> tuple[float, float]:
    """Seconds of the final norm + LM head on one token: ``(full head, head)`` (``head`` ``None``:
    both are the full head; ``head`` scored as a draft with ``weights`` scores it). Interleaved,
    after a warm-up, medians of ``reps``."""
    d = adapter.arch.info().hidden_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, d, generator=gen).to(device=adapter.arch.device, dtype=adapter.arch.dtype)

    def sync() -> None:
        device_sync(adapter.arch.device)

    fns = [lambda: adapter.logits_from_hidden(x)]
    if head is not None:
        fns.append(lambda: adapter.logits_from_hidden(x, head, weights))
    samples: list[list[float]] = [[] for _ in fns]
    for rep in range(reps + 1):
        for fn, out in zip(fns, samples, strict=True):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if rep:
                out.append(time.perf_counter() - t)
    meds = [statistics.median(v) for v in samples]
    return meds[0], meds[-1]
