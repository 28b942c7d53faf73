"""The decoding loops: self-speculative rounds and the vanilla autoregressive baseline.

Both loops run through the same `ModelAdapter`, KV cache and stop
logic, so a speedup compares like with like. The speculative loop knows only the four interfaces.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.engine.adapter import ModelAdapter
from framework.engine.execution.sizes import ForwardSizes
from framework.engine.processing import GenerationControls, LogitsProcessing, stop_cut
from framework.engine.state import DecodeState
from framework.engine.synthetic import SyntheticAcceptance
from framework.interfaces import Drafter, LayerSelector, LengthController, PrepareView, Verifier
from framework.types import Draft, LayerPlan, RoundRecord, Verification
from framework.utils import PhaseTimer, synced_clock
from framework.view import RoundView


class StopCondition:
    """When generation ends: an EOS token, a stop string in the decoded text, or a token budget.

    The cut position depends only on the token sequence, so two decoders that produce the same
    tokens stop at the same place.

    Args:
        max_new_tokens: budget of new tokens (>= 1).
        eos_token_ids: token ids that end generation (kept in the output).
        stop_strings: strings that end generation once they appear in the new text (the token that
            completes one is kept).
        decode: ``token ids -> text`` (the tokenizer's decode); needed only with stop strings.
        on_tokens: called with each block of new tokens as `find_cut` checks it, up to the cut
            (what a streamer is fed: the tokens the generation keeps, as they are committed).
        criteria: a `transformers.StoppingCriteriaList` (or any ``(input_ids, scores) -> bool
            tensor``): each new token is checked with the prompt and the tokens up to it, as
            ``generate`` checks one token at a time; the first that answers True ends the
            generation, that token kept (`framework.engine.processing.stop_cut`).
        controls: what the generation applies to each next token's scores
            (`framework.engine.processing.GenerationControls`; ``None``: nothing).
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Iterable[int] = (),
        stop_strings: Sequence[str] = (),
        decode: Any = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        criteria: Any = None,
        controls: GenerationControls | None = None,
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if stop_strings and decode is None:
            raise ValueError("stop_strings need a decode function")
        self.max_new_tokens = max_new_tokens
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.decode = decode
        self.on_tokens = on_tokens
        self.criteria = criteria
        self.controls = controls if controls is not None and controls.active else None
        self._prompt: torch.Tensor | None = None
        self._window = 8 + max((len(s) for s in self.stop_strings), default=0)

    def begin(self, state: DecodeState) -> None:
        """A generation starts on ``state``: its processors (`controls`), and its prompt for the
        stopping criteria."""
        self._prompt = state.tokens[:, : state.prompt_len]
        if self.controls is not None:
            state.processing = LogitsProcessing(self.controls.processors_for(state.prompt_len))
            state.grammar = state.processing.grammar

    def find_cut(self, new_tokens: Sequence[int], start: int) -> tuple[int, str] | None:
        """Check tokens ``new_tokens[start:]`` (and hand the ones kept to ``on_tokens``).

        Returns:
            ``(keep, reason)`` if generation ends: keep the first ``keep`` new tokens; else ``None``.
        """
        cut = self._cut(new_tokens, start)
        if self.on_tokens is not None:
            kept = list(new_tokens[start : cut[0] if cut is not None else len(new_tokens)])
            if kept:
                self.on_tokens(kept)
        return cut

    def _cut(self, new_tokens: Sequence[int], start: int) -> tuple[int, str] | None:
        cut = self._cut_by_rules(new_tokens, start)
        if self.criteria is not None and self._prompt is not None:
            at = stop_cut(self.criteria, self._prompt, new_tokens[: cut[0]] if cut else new_tokens, start)
            if at is not None:
                return at, "stopping_criteria"
        return cut

    def _cut_by_rules(self, new_tokens: Sequence[int], start: int) -> tuple[int, str] | None:
        for i in range(start, len(new_tokens)):
            if new_tokens[i] in self.eos:
                return i + 1, "eos"
            if self.stop_strings:
                lo = max(0, i + 1 - self._window)
                tail = self.decode(list(new_tokens[lo : i + 1]))
                prev = self.decode(list(new_tokens[lo:i])) if i > lo else ""
                for s in self.stop_strings:
                    # A stop string completed by token i: present now, absent one token earlier.
                    if s in tail and s not in prev:
                        return i + 1, "stop_string"
            if i + 1 >= self.max_new_tokens:
                return i + 1, "max_new_tokens"
        return None


@dataclass
class GenerationResult:
    """One generation (one turn of one prompt).

    Attributes:
        tokens: the new token ids (after the stop cut).
        wall_time: seconds from the start of prefill to the end of the last round.
        stop_reason: ``"eos"``, ``"stop_string"``, ``"stopping_criteria"`` or ``"max_new_tokens"``.
        rounds: one `RoundRecord` per verification round (a plain decoder: one per step after the
            prefill's token); the per-round properties below read them.
        plain: the rounds are plain steps (vanilla decoding): `draft_lengths` is empty.
        timings: seconds per phase (prefill, select, draft, verify, length, commit, lm_head).
        target_forwards / draft_forwards: forward counts.
        verify_tokens: tokens fed to verification forwards (a chain of K drafts: K + 1 per round;
            a token tree: its nodes + 1).
        graph_captures: CUDA graphs recorded during this generation (`--cuda-graphs`; 0 when the
            run recorded them all before timing, `Executor.prepare_graphs`), and
        capture_seconds: the wall time they took (inside ``wall_time``).
        strategy_summary: per-strategy summaries (``Strategy.summary()``).
        prompt_tokens: the prompt's length (where the context of the first round starts).
        synthetic: the forced acceptance probability of a synthetic-acceptance run
            (`framework.engine.synthetic`: the tokens are not the model's), else ``None``.
    """

    tokens: list[int]
    wall_time: float
    stop_reason: str
    rounds: list[RoundRecord] = field(default_factory=list)
    plain: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    target_forwards: int = 0
    draft_forwards: int = 0
    verify_tokens: int = 0
    graph_captures: int = 0
    capture_seconds: float = 0.0
    strategy_summary: dict[str, Any] = field(default_factory=dict)
    prompt_tokens: int = 0
    synthetic: float | None = None

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def accept_lengths(self) -> list[int]:
        """Tokens committed per verification round (m + 1, bonus included)."""
        return [r.committed for r in self.rounds if r.committed]

    @property
    def draft_lengths(self) -> list[int]:
        """Tokens drafted per round (0 for a round that declined to draft); empty when `plain`."""
        return [] if self.plain else [r.drafted for r in self.rounds]

    @property
    def drafted(self) -> int:
        """Draft tokens proposed in total."""
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        """Draft tokens accepted in total."""
        return sum(r.accepted for r in self.rounds)

    @property
    def skip_ratios(self) -> list[float]:
        """Per drafting round, the plan's skip ratio."""
        return [r.skip_ratio for r in self.rounds if r.plan]

    @property
    def plans(self) -> list[str]:
        """Per drafting round, the plan as a 2L-character string (`LayerPlan.code`: attention
        sub-layers of blocks 0..L-1, then their MLPs; ``1`` = not run by the draft)."""
        return [r.plan for r in self.rounds if r.plan]

    @property
    def exit_layers(self) -> list[int | None]:
        """Per drafting round, the plan's exit layer (``None``: full depth)."""
        return [r.exit_layer for r in self.rounds if r.plan]

    @property
    def mean_accepted_length(self) -> float:
        """M: tokens committed per verification round, bonus token included."""
        lengths = self.accept_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def acceptance_rate(self) -> float:
        """alpha: accepted draft tokens / drafted tokens."""
        drafted = self.drafted
        return self.accepted / drafted if drafted else 0.0


#: The record of one plain step (vanilla decoding).
PLAIN_ROUND = RoundRecord(drafted=0, accepted=0, committed=1, skip_ratio=0.0)


def capacity_for(prompt_len: int, max_new_tokens: int, max_draft: int) -> int:
    """KV slots of one generation: prompt + budget + the longest draft block + bonus, and slack."""
    return prompt_len + max_new_tokens + max_draft + 8


def _check_context(adapter: ModelAdapter, prompt_len: int, max_new_tokens: int) -> None:
    limit = adapter.arch.max_context
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds the model's context of "
            f"{limit} tokens; shorten the prompt or lower --max-new-tokens"
        )


def _prefill(
    state: DecodeState, choose: Any, stop: StopCondition
) -> tuple[float, list[int], tuple[int, str] | None]:
    """Prefill, choose the first new token, start the clock; returns (t0, new tokens, cut)."""
    clock = synced_clock(state.adapter.arch.device)  # waits for CUDA's queued work; perf_counter on CPU
    stop.begin(state)
    t0 = clock()
    logits = state.prefill()
    first = choose(logits)[:, None]
    state.append(first)  # before the read: the strategies' reads of the prompt may look at it
    new = state.read(token=first[0, :1])["token"]  # the generation's first read (with the strategies' reads)
    state.known_on_host(new)
    state.stats.timings["prefill"] = clock() - t0
    return t0, new, stop.find_cut(new, 0)


@dataclass(frozen=True)
class _Counters:
    """The adapter's lifetime counters when a generation starts (it reports the difference)."""

    lm_head_seconds: float
    graph_captures: int
    capture_seconds: float

    @classmethod
    def of(cls, adapter: ModelAdapter) -> _Counters:
        return cls(adapter.executor.lm_head_seconds, *adapter.executor.graph_counts())


def _finish(
    state: DecodeState,
    t0: float,
    start: _Counters,
    new: list[int],
    cut: tuple[int, str],
    *,
    decode_phase: str | None = None,
    phases: bool = True,
    summarise: Callable[[], dict[str, Any]] | None = None,
    **fields: Any,
) -> GenerationResult:
    """Stop the clock and package a GenerationResult (tokens cut at the stop position).

    ``summarise`` (the strategies' summaries) runs after the clock stopped: reporting is not
    decoding (the gate's break-even bisection alone took ~1% of a 64-token generation of the
    default model).

    ``decode_phase`` names the phase that gets all time after prefill (vanilla: ``"verify"``).
    Without ``phases`` (phase timing off) the timings are ``prefill`` and ``decode`` (the rest of
    the wall time) only; ``lm_head`` is there when the adapter timed its heads.
    """
    wall = synced_clock(state.adapter.arch.device)() - t0
    if summarise is not None:
        fields["strategy_summary"] = summarise()
    state.cache.release()  # a lent KV pool (CUDA graphs) may serve the next generation
    timings = dict(state.stats.timings)
    if not phases:
        timings = {"prefill": timings["prefill"], "decode": wall - timings["prefill"]}
    if decode_phase is not None:
        timings[decode_phase] = wall - timings["prefill"]
    if state.adapter.executor.times_lm_head:
        timings["lm_head"] = state.adapter.executor.lm_head_seconds - start.lm_head_seconds
    captures, capture_seconds = state.adapter.executor.graph_counts()
    keep, reason = cut
    return GenerationResult(
        tokens=new[:keep],
        wall_time=wall,
        stop_reason=reason,
        rounds=state.stats.rounds,
        timings=timings,
        target_forwards=state.stats.target_forwards,
        draft_forwards=state.stats.draft_forwards,
        verify_tokens=state.stats.verify_tokens,
        graph_captures=captures - start.graph_captures,
        capture_seconds=capture_seconds - start.capture_seconds,
        prompt_tokens=state.prompt_len,
        **fields,
    )


class VanillaDecoder:
    """Autoregressive decoding through the adapter: one full forward per token.

    Each token is ``verifier.choose(logits)``: the argmax for greedy verifiers, a sample from the
    same warped target distribution for a sampling verifier (give the baseline its own verifier
    instance, so that it draws from its own random stream).

    Args:
        adapter: the model adapter.
        verifier: chooses each token from the logits. Defaults to argmax.
    """

    name = "vanilla"

    def __init__(self, adapter: ModelAdapter, verifier: Verifier | None = None) -> None:
        self.adapter, self.verifier = adapter, verifier
        if verifier is not None:
            verifier.setup(adapter.arch.info())
        self.choose = verifier.choose if verifier is not None else (lambda logits: logits.argmax(-1))

    def for_row(self, row: int, adapter: ModelAdapter) -> VanillaDecoder:
        """This decoder for row ``row`` of a batch (`framework.engine.batch`): its verifier's
        `Strategy.for_row` (its own random stream)."""
        if row == 0:
            return self
        return VanillaDecoder(adapter, None if self.verifier is None else self.verifier.for_row(row))

    def on(self, adapter: Any) -> VanillaDecoder:
        """This decoder running its forwards through ``adapter`` (a batch row's)."""
        twin = copy.copy(self)
        twin.adapter = adapter
        return twin

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, stop: StopCondition) -> GenerationResult:
        adapter = self.adapter
        _check_context(adapter, prompt_ids.shape[1], stop.max_new_tokens)
        state = DecodeState(adapter, prompt_ids, capacity_for(prompt_ids.shape[1], stop.max_new_tokens, 0))
        counters = _Counters.of(adapter)
        t0, new, cut = _prefill(state, self.choose, stop)
        while cut is None:
            out = state.forward_verify(state.pending, logits_at="last")
            tok = self.choose(out.logits[:, -1])
            state.cache.commit(1)
            state.append(tok[:, None])
            new.append(int(tok.item()))
            state.stats.rounds.append(PLAIN_ROUND)
            cut = stop.find_cut(new, len(new) - 1)
        return _finish(state, t0, counters, new, cut, plain=True, decode_phase="verify")


class SpeculativeDecoder:
    """Self-speculative decoding: select -> draft -> verify -> commit -> observe, every round.

    One round (the sketch of `framework.interfaces`)::

        plan   = selector.plan(state)
        hint   = selector.length_hint(state)
        k_max  = min(length.max_length(state, hint), token budget, max_draft)
        draft  = drafter.draft(state, plan, length, k_max) if k_max else Draft.empty(...)
        result = verifier.verify(state, draft)
        state.commit(result)
        for s in (selector, length, drafter, verifier):
            s.observe(state, draft, result)

    Args:
        adapter: the model adapter.
        selector: the LayerSelector instance.
        length: the LengthController instance.
        drafter: the Drafter instance.
        verifier: the Verifier instance.
        max_draft: hard cap on one round's draft length (sizes the cache); the length controller's
            own cap is usually lower.
        phase_timing: time every phase of a round (select, length, draft, verify, commit) into
            ``GenerationResult.timings``. On CUDA each phase boundary waits for the device (a
            synchronisation, about ten a round), so ``None`` (the default) means on for a CPU and
            off for CUDA; off, the timings are ``prefill`` and ``decode`` only. A length controller
            that reads the phase timings itself (``needs_phase_timings``, a draft gate without a
            cost model) turns it on.
    """

    name = "speculative"

    def __init__(
        self,
        adapter: ModelAdapter,
        selector: LayerSelector,
        length: LengthController,
        drafter: Drafter,
        verifier: Verifier,
        *,
        max_draft: int = 64,
        phase_timing: bool | None = None,
        synthetic: SyntheticAcceptance | None = None,
    ) -> None:
        self.adapter = adapter
        #: accept at a forced rate instead of the verifier's decisions (`framework.engine.synthetic`)
        self.synthetic = synthetic
        self.selector, self.length, self.drafter, self.verifier = selector, length, drafter, verifier
        self.max_draft = max_draft
        self.phase_timing = phase_timing
        info = adapter.arch.info()
        for s in (selector, length, drafter, verifier):
            s.setup(info)

    def for_row(self, row: int, adapter: ModelAdapter) -> SpeculativeDecoder:
        """This decoder for row ``row`` of a batch (`framework.engine.batch`): each strategy's
        `Strategy.for_row` (row 0: this decoder's own)."""
        if row == 0:
            return self
        s = self.strategies()
        return SpeculativeDecoder(
            adapter,
            *(s[k].for_row(row) for k in ("selector", "length", "drafter", "verifier")),
            max_draft=self.max_draft,
            phase_timing=self.phase_timing,
            synthetic=self.synthetic,
        )

    def on(self, adapter: Any) -> SpeculativeDecoder:
        """This decoder running its forwards through ``adapter`` (a batch row's)."""
        twin = copy.copy(self)
        twin.adapter = adapter
        return twin

    def prepare(self, ctx: PrepareView) -> None:
        """Run every strategy's one-time `Strategy.prepare` (offline searches).

        The drafter goes first: it builds the head drafts score tokens with (``Drafter.draft_head``,
        a reduced vocabulary or ``None``) and the weights they run (``Drafter.draft_weights``),
        which the other strategies then find in ``ctx.draft_head`` and ``ctx.draft_weights`` (a copy
        of ``ctx``; the store is shared) so that what they search or price is the draft that runs.
        """
        self.drafter.prepare(ctx)
        ctx = ctx.with_draft(self.drafter)
        for s in (self.selector, self.length, self.verifier):
            s.prepare(ctx)

    def times_phases(self) -> bool:
        """Whether `generate` times each phase (see ``phase_timing``)."""
        if any(s.needs_phase_timings for s in self.strategies().values()):
            return True
        return self.phase_timing if self.phase_timing is not None else self.adapter.arch.device.type == "cpu"

    def graph_sizes(self, seen: ForwardSizes) -> ForwardSizes:
        """The token counts of the forwards this decoder can run after the prefill, from what it
        ran (``seen``, the executor's record of a warm-up decode): chains of up to the length
        controller's cap (at most ``max_draft``) plus ``pending``, trees as wide as the verifier's
        candidates, and the selector's own passes (`ForwardSizes.filled`)."""
        k = min(self.max_draft, self.length.max_draft_length() or self.max_draft)
        return seen.filled(k, self.verifier.draft_top_k())

    def strategies(self) -> dict[str, Any]:
        return {
            "selector": self.selector,
            "length": self.length,
            "drafter": self.drafter,
            "verifier": self.verifier,
        }

    @torch.inference_mode()
    def generate(self, prompt_ids: torch.Tensor, stop: StopCondition) -> GenerationResult:
        adapter = self.adapter
        _check_context(adapter, prompt_ids.shape[1], stop.max_new_tokens)
        for s in self.strategies().values():
            s.reset()
        state = DecodeState.for_strategies(
            adapter,
            prompt_ids,
            capacity_for(prompt_ids.shape[1], stop.max_new_tokens, self.max_draft),
            self.selector,
            self.length,
            self.verifier,
            self.drafter,
        )
        self.selector.begin(state)
        counters = _Counters.of(adapter)
        phases = self.times_phases()
        t0, new, cut = _prefill(state, self.verifier.choose, stop)
        timer = PhaseTimer(state.stats.timings, adapter.arch.device, enabled=phases)
        codes: dict[LayerPlan, str] = {}  # plans repeat across rounds: encode each once
        while cut is None:
            draft, result = self._round(state, stop.max_new_tokens - len(new) - 1, timer)
            state.stats.rounds.append(_record(draft, result, codes))
            start = len(new)
            new.extend(state.last_committed)  # the tokens committed, on the host since the commit
            cut = stop.find_cut(new, start)
        strategies = self.strategies()

        def summarise() -> dict[str, Any]:
            return {k: v for k, v in ((k, s.summary()) for k, s in strategies.items()) if v}

        res = _finish(state, t0, counters, new, cut, phases=phases, summarise=summarise)
        if self.synthetic is not None:
            res.synthetic = self.synthetic.p
        return res

    def _round(self, state: DecodeState, budget: int, timer: PhaseTimer) -> tuple[Draft, Verification]:
        """One round: select, draft (at most ``budget`` tokens: the last token of a generation is
        the target's own), verify, commit, observe; each phase timed by ``timer``. The strategies
        see the state as a `framework.view.RoundView` (their annotations; the state commits)."""
        view: RoundView = state
        timer.mark()
        plan = self.selector.plan(view)
        hint = self.selector.length_hint(view)
        timer.lap("select")
        k_max = max(0, min(self.length.max_length(view, hint), budget, self.max_draft))
        timer.lap("length")
        if k_max > 0:
            draft = self.drafter.draft(view, plan, self.length, k_max)
        else:
            draft = Draft.empty(state.pending.shape[0], plan, state.device)
        timer.lap("draft")
        result = self.verifier.verify(view, draft)
        if self.synthetic is not None:
            result = self.synthetic.apply(draft, result)
        timer.lap("verify")
        state.commit(result)
        timer.lap("commit")
        for phase, s in (
            ("select", self.selector),
            ("length", self.length),
            ("draft", self.drafter),
            ("verify", self.verifier),
        ):
            s.observe(view, draft, result)
            timer.lap(phase)
        return draft, result


def _record(draft: Draft, result: Verification, codes: dict[LayerPlan, str]) -> RoundRecord:
    """The `RoundRecord` of one round (``codes``: the plans encoded so far)."""
    plan, m = draft.plan, result.accepted
    if not draft.length:
        return RoundRecord(0, m, m + 1, plan.skip_ratio)
    code = codes.get(plan)
    if code is None:
        code = codes[plan] = plan.code()
    return RoundRecord(draft.length, m, m + 1, plan.skip_ratio, code, plan.exit_layer)
