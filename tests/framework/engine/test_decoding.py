"""framework.engine.decoding: the loops, the stop logic, the metrics, and the central invariant that greedy
self-speculative decoding emits exactly the tokens of plain greedy decoding."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from framework import (
    Draft,
    Drafter,
    LayerPlan,
    LayerSelector,
    LengthController,
    LengthHint,
    Verification,
    Verifier,
)
from framework.config_fields import ConfigError
from framework.engine.adapter import adapter_for
from framework.engine.decoding import (
    GenerationResult,
    SpeculativeDecoder,
    StopCondition,
    VanillaDecoder,
)
from framework.engine.state import DecodeState
from framework.testing import (
    ARCHS,
    AlwaysAcceptDrafter,
    NeverAcceptDrafter,
    RejectAllVerifier,
    ZeroLength,
    cached_tiny_model,
    random_prompt,
    tiny_model,
)
from framework.types import RoundRecord
from framework.view import RoundView
from strategies.drafters.layer_skip import LayerSkipDrafter
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier

L = 4


@functools.lru_cache(maxsize=64)
def _vanilla(arch: str, prompt_seed: int, max_new: int, prompt_len: int = 6) -> tuple[int, ...]:
    adapter = adapter_for(cached_tiny_model(arch, L))
    prompt = random_prompt(prompt_len, 128, prompt_seed)
    return tuple(VanillaDecoder(adapter).generate(prompt, StopCondition(max_new)).tokens)


def _spec(adapter, selector=None, length=None, drafter=None, verifier=None, **kw) -> SpeculativeDecoder:
    return SpeculativeDecoder(
        adapter,
        selector or StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
        length or FixedLength(FixedLengthConfig(k=3)),
        drafter or LayerSkipDrafter(),
        verifier or GreedyVerifier(),
        **kw,
    )


@dataclass(frozen=True)
class _NoCfg:
    pass


# ------------------------------------------------------------------------------ vanilla vs HF


@pytest.mark.parametrize("arch", ARCHS)
def test_vanilla_matches_hf_generate(arch, tiny_models, adapters):
    model, adapter = tiny_models[arch], adapters[arch]
    n = 16
    for seed in (0,):
        prompt = random_prompt(7, 128, seed)
        with torch.inference_mode():
            hf = model.generate(
                prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None
            )
        want = hf[0, prompt.shape[1] :].tolist()
        assert len(want) == n
        got = VanillaDecoder(adapter).generate(prompt, StopCondition(n))
        assert got.tokens == want
        assert got.stop_reason == "max_new_tokens"
        assert got.target_forwards == n  # prefill + one forward per further token
        assert got.accept_lengths == [1] * (n - 1)


def test_tiny_models_are_not_degenerate():
    """The equality tests below are only meaningful if greedy output is not one repeated token."""
    for arch in ARCHS:
        assert len(set(_vanilla(arch, 0, 32))) >= 4


# ------------------------------------------------------------------------------ central invariant


_PROMPT_SEEDS = (0, 1, 2)


@st.composite
def _skip_sets(draw):
    """Explicit skip sets from nothing to everything but one sub-layer."""
    attn = draw(st.sets(st.integers(0, L - 1)))
    mlp = draw(st.sets(st.integers(0, L - 1)))
    if len(attn) + len(mlp) == 2 * L:  # keep one sub-layer: the selector rejects an empty draft
        mlp.discard(draw(st.sampled_from(sorted(mlp))))
    return tuple(sorted(attn)), tuple(sorted(mlp))


_lengths = st.one_of(
    st.builds(lambda k: FixedLength(FixedLengthConfig(k=k)), st.integers(1, 8)),
    st.builds(
        lambda t, m: ConfidenceLength(ConfidenceLengthConfig(threshold=t, max_length=m)),
        st.floats(0.01, 0.99),
        st.integers(1, 8),
    ),
)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    arch=st.sampled_from(("llama", "qwen2", "mistral")),
    skip=_skip_sets(),
    length=_lengths,
    prompt_seed=st.sampled_from(_PROMPT_SEEDS),
    max_new=st.integers(1, 24),
)
# the extremes: one sub-layer left (an attention, then an MLP), and nothing skipped
@example(
    arch="llama",
    skip=((0, 1, 2, 3), (0, 1, 2)),
    length=FixedLength(FixedLengthConfig(k=4)),
    prompt_seed=0,
    max_new=24,
)
@example(
    arch="qwen2",
    skip=((0, 1, 2), (0, 1, 2, 3)),
    length=FixedLength(FixedLengthConfig(k=8)),
    prompt_seed=1,
    max_new=24,
)
@example(arch="mistral", skip=((), ()), length=FixedLength(FixedLengthConfig(k=5)), prompt_seed=2, max_new=24)
def test_speculative_equals_vanilla_random_skip_sets(arch, skip, length, prompt_seed, max_new):
    adapter = adapter_for(cached_tiny_model(arch, L))
    selector = StaticSelector(StaticSelectorConfig(skip_attn=skip[0], skip_mlp=skip[1]))
    dec = _spec(adapter, selector=selector, length=length)
    res = dec.generate(random_prompt(6, 128, prompt_seed), StopCondition(max_new))
    assert tuple(res.tokens) == _vanilla(arch, prompt_seed, 24)[:max_new]
    assert res.stop_reason == "max_new_tokens"
    assert 0 <= res.accepted <= res.drafted
    assert sum(res.accept_lengths) == max_new - 1  # the first token comes from prefill


def test_skip_everything_is_rejected(llama_adapter):
    sel = StaticSelector(StaticSelectorConfig(skip_attn=tuple(range(L)), skip_mlp=tuple(range(L))))
    with pytest.raises(ConfigError, match="at least one sub-layer"):
        _spec(llama_adapter, selector=sel)


def test_exit_layer_plans_are_lossless(llama_adapter):
    """Early-exit plans (not producible by the static selector) through a stub selector."""

    class ExitSelector(LayerSelector):
        Config = _NoCfg

        def __init__(self, plan):
            super().__init__()
            self._plan = plan

        def plan(self, state):
            return self._plan

    for plan in (
        LayerPlan.from_indices(L, exit_layer=1),
        LayerPlan.from_indices(L, attn=[0], exit_layer=2),
        LayerPlan.from_indices(L, mlp=[1, 2], exit_layer=3),
    ):
        res = _spec(llama_adapter, selector=ExitSelector(plan)).generate(
            random_prompt(6, 128, 1), StopCondition(20)
        )
        assert tuple(res.tokens) == _vanilla("llama", 1, 24)[:20]
        assert all(r == plan.skip_ratio for r in res.skip_ratios)
        # the recorded plan codes come back as plans that run (and cost) the same sub-layers
        for code in res.plans:
            back = LayerPlan.from_code(code)
            assert back.code() == code
            assert all(
                back.runs_attn(i) == plan.runs_attn(i) and back.runs_mlp(i) == plan.runs_mlp(i)
                for i in range(L)
            )
    with pytest.raises(ValueError, match="2L characters of 0/1"):
        LayerPlan.from_code("012")


# ------------------------------------------------------------------------------ stub strategies


def test_always_accepts_drafter(llama_adapter):
    k, rounds = 3, 5
    max_new = 1 + rounds * (k + 1)
    res = _spec(
        llama_adapter, length=FixedLength(FixedLengthConfig(k=k)), drafter=AlwaysAcceptDrafter()
    ).generate(random_prompt(6, 128, 0), StopCondition(max_new))
    assert tuple(res.tokens) == _vanilla("llama", 0, max_new)
    assert res.accept_lengths == [k + 1] * rounds
    assert res.acceptance_rate == 1.0 and res.mean_accepted_length == k + 1
    assert res.drafted == res.accepted == rounds * k
    assert res.target_forwards == 1 + rounds


def test_never_accepts_drafter(llama_adapter):
    res = _spec(
        llama_adapter, length=FixedLength(FixedLengthConfig(k=4)), drafter=NeverAcceptDrafter()
    ).generate(random_prompt(6, 128, 2), StopCondition(16))
    assert tuple(res.tokens) == _vanilla("llama", 2, 16)
    assert res.accepted == 0 and res.acceptance_rate == 0.0 and res.drafted > 0
    assert res.accept_lengths == [1] * 15 and res.mean_accepted_length == 1.0


def test_reject_all_verifier(llama_adapter):
    res = _spec(llama_adapter, drafter=AlwaysAcceptDrafter(), verifier=RejectAllVerifier()).generate(
        random_prompt(6, 128, 1), StopCondition(12)
    )
    assert tuple(res.tokens) == _vanilla("llama", 1, 12)
    assert res.accepted == 0 and res.accept_lengths == [1] * 11 and res.drafted > 0


class _SpyDrafter(Drafter):
    """Wraps a drafter and records every call."""

    Config = _NoCfg

    def __init__(self, inner: Drafter):
        super().__init__()
        self.inner = inner
        self.calls: list[dict] = []

    def draft(self, state, plan, length, max_tokens):
        d = self.inner.draft(state, plan, length, max_tokens)
        self.calls.append(
            dict(
                max_tokens=max_tokens,
                k=d.length,
                num_new=state.num_new,
                round=state.round,
                conf=d.confidences,
            )
        )
        return d


class _SpyLength(LengthController):
    """Wraps a length controller and records each round's max_length."""

    Config = _NoCfg

    def __init__(self, inner: LengthController):
        super().__init__()
        self.inner = inner
        self.needs_confidence = inner.needs_confidence
        self.maxes: list[int] = []
        self.observed: list[tuple[int, int]] = []
        self.resets = 0

    def reset(self):
        self.resets += 1

    def max_length(self, state, hint=None):
        k = self.inner.max_length(state, hint)
        self.maxes.append(k)
        return k

    def should_continue(self, drafted, confidence):
        return self.inner.should_continue(drafted, confidence)

    def observe(self, state, draft, result):
        self.observed.append((draft.length, result.accepted))


def test_zero_length_makes_decoding_plain(llama_adapter):
    spy = _SpyDrafter(LayerSkipDrafter())
    res = _spec(llama_adapter, length=ZeroLength(), drafter=spy).generate(
        random_prompt(6, 128, 0), StopCondition(15)
    )
    assert tuple(res.tokens) == _vanilla("llama", 0, 15)
    assert spy.calls == [] and res.drafted == 0 and res.accepted == 0
    assert res.accept_lengths == [1] * 14 and res.skip_ratios == []
    assert res.acceptance_rate == 0.0 and res.draft_forwards == 0


@pytest.mark.parametrize("k, max_new", [(1, 9), (4, 13), (7, 10), (12, 6), (5, 1), (5, 2)])
def test_metrics_and_budgets(llama_adapter, k, max_new):
    drafter = _SpyDrafter(LayerSkipDrafter())
    length = _SpyLength(FixedLength(FixedLengthConfig(k=k)))
    dec = _spec(
        llama_adapter,
        selector=StaticSelector(StaticSelectorConfig(skip_attn=(2,))),
        length=length,
        drafter=drafter,
    )
    res = dec.generate(random_prompt(6, 128, 1), StopCondition(max_new))
    assert tuple(res.tokens) == _vanilla("llama", 1, max_new)
    assert len(res.tokens) == max_new == res.new_tokens
    # 1 token from prefill, then m + 1 per round, never past the budget
    assert 1 + sum(res.accept_lengths) == max_new
    rounds = len(res.accept_lengths)
    assert res.accepted == sum(res.accept_lengths) - rounds
    assert res.mean_accepted_length == (sum(res.accept_lengths) / rounds if rounds else 0.0)
    assert res.acceptance_rate == (res.accepted / res.drafted if res.drafted else 0.0)
    assert res.drafted == sum(c["k"] for c in drafter.calls)
    assert res.target_forwards == 1 + rounds
    assert res.draft_forwards == res.drafted  # layer_skip: one forward per draft token
    assert res.verify_tokens == sum(res.draft_lengths) + rounds  # chains of k + 1
    assert len(length.maxes) == rounds  # asked once per round
    for call in drafter.calls:
        budget = max_new - call["num_new"] - 1
        assert 1 <= call["k"] <= call["max_tokens"] <= min(length.maxes[call["round"]], budget)
    assert len(length.observed) == rounds and length.resets == 1
    assert all(0 <= a <= d for d, a in length.observed)
    assert set(res.timings) >= {"prefill", "select", "draft", "verify", "length", "commit", "lm_head"}
    assert all(v >= 0 for v in res.timings.values()) and res.wall_time > 0


def test_draft_length_respects_confidence_cap(llama_adapter):
    drafter = _SpyDrafter(LayerSkipDrafter())
    length = _SpyLength(ConfidenceLength(ConfidenceLengthConfig(threshold=0.01, max_length=3)))
    res = _spec(llama_adapter, length=length, drafter=drafter).generate(
        random_prompt(6, 128, 0), StopCondition(30)
    )
    assert tuple(res.tokens) == _vanilla("llama", 0, 30)
    assert drafter.calls and all(c["k"] <= 3 for c in drafter.calls)
    assert all(c["conf"] is not None and c["conf"].shape == (1, c["k"]) for c in drafter.calls)


def test_max_draft_caps_rounds(llama_adapter):
    drafter = _SpyDrafter(AlwaysAcceptDrafter())
    res = _spec(
        llama_adapter, length=FixedLength(FixedLengthConfig(k=8)), drafter=drafter, max_draft=2
    ).generate(random_prompt(6, 128, 0), StopCondition(13))
    assert tuple(res.tokens) == _vanilla("llama", 0, 13)
    assert all(c["max_tokens"] <= 2 for c in drafter.calls)
    assert res.accept_lengths == [3] * 4


def test_capability_flags_reach_strategies(llama_adapter):
    """needs_hidden_states / needs_draft_probs make the engine compute what was asked for."""
    seen: dict[str, list] = {"hidden": [], "probs": []}

    class HiddenSelector(LayerSelector):
        Config = _NoCfg
        needs_hidden_states = True

        def plan(self, state):
            seen["hidden"].append(("plan", state.last_hidden_states.shape))
            return LayerPlan.from_indices(L, attn=[1])

        def observe(self, state, draft, result):
            seen["hidden"].append(("observe", result.hidden_states.shape, draft.length))

    class ProbsVerifier(GreedyVerifier):
        needs_draft_probs = True

        def verify(self, state, draft):
            seen["probs"].append(None if draft.probs is None else draft.probs.shape)
            return super().verify(state, draft)

    res = SpeculativeDecoder(
        llama_adapter,
        HiddenSelector(),
        FixedLength(FixedLengthConfig(k=2)),
        LayerSkipDrafter(),
        ProbsVerifier(),
    ).generate(random_prompt(6, 128, 2), StopCondition(10))
    assert tuple(res.tokens) == _vanilla("llama", 2, 10)
    assert seen["hidden"][0] == ("plan", (L + 1, 1, 6, 64))  # from the prefill
    for entry in seen["hidden"]:
        if entry[0] == "observe":
            assert entry[1] == (L + 1, 1, entry[2] + 1, 64)
    # every non-empty draft carries its distributions (B, K, V); an empty one (no budget left) may not
    assert seen["probs"] and all(s is not None and s[0] == 1 and s[2] == 128 for s in seen["probs"][:-1])


def test_strategies_setup_once_reset_per_prompt(llama_adapter):
    counts = {"setup": 0, "reset": 0}

    class Counting(FixedLength):
        def setup(self, info):
            counts["setup"] += 1
            assert info.num_layers == L

        def reset(self):
            counts["reset"] += 1

    dec = _spec(llama_adapter, length=Counting(FixedLengthConfig(k=2)))
    for seed in (0, 1):
        res = dec.generate(random_prompt(6, 128, seed), StopCondition(8))
        assert tuple(res.tokens) == _vanilla("llama", seed, 8)
    assert counts == {"setup": 1, "reset": 2}


def test_decoder_is_reusable_across_prompt_lengths(llama_adapter):
    dec = _spec(llama_adapter)
    for plen, seed in ((1, 3), (9, 4), (3, 5)):
        want = _vanilla("llama", seed, 12, prompt_len=plen)
        assert tuple(dec.generate(random_prompt(plen, 128, seed), StopCondition(12)).tokens) == want


# ------------------------------------------------------------------------------ stop conditions


def _decode(ids) -> str:
    return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def _both(adapter, prompt, stop):
    v = VanillaDecoder(adapter).generate(prompt, stop)
    s = _spec(adapter, length=FixedLength(FixedLengthConfig(k=4))).generate(prompt, stop)
    return v, s


def test_eos_cut_kept(llama_adapter):
    full = _vanilla("llama", 0, 30)
    eos = full[5]
    first = full.index(eos)  # the first occurrence ends generation
    other = next(t for t in range(128) if t not in full)  # an eos id that never occurs
    v, s = _both(llama_adapter, random_prompt(6, 128, 0), StopCondition(30, eos_token_ids=[other, eos]))
    assert v.tokens == s.tokens == list(full[: first + 1])
    assert v.tokens[-1] == eos and eos not in v.tokens[:-1]
    assert v.stop_reason == s.stop_reason == "eos"


def test_eos_as_first_token(llama_adapter):
    full = _vanilla("llama", 1, 5)
    v, s = _both(llama_adapter, random_prompt(6, 128, 1), StopCondition(30, eos_token_ids=[full[0]]))
    assert v.tokens == s.tokens == [full[0]] and v.stop_reason == s.stop_reason == "eos"


def test_max_new_tokens_cut(llama_adapter):
    for n in (1, 2, 7):
        v, s = _both(llama_adapter, random_prompt(6, 128, 2), StopCondition(n))
        assert v.tokens == s.tokens == list(_vanilla("llama", 2, n))
        assert len(v.tokens) == n and v.stop_reason == s.stop_reason == "max_new_tokens"


def test_stop_string_cut(llama_adapter):
    full = _vanilla("llama", 0, 30)
    text = _decode(full)
    stop_str = text[9:12]  # spans three tokens of the fake one-char-per-token decode
    expect = text.index(stop_str) + len(stop_str)  # tokens up to the first completion
    v, s = _both(
        llama_adapter,
        random_prompt(6, 128, 0),
        StopCondition(30, stop_strings=[stop_str, ""], decode=_decode),
    )
    assert v.tokens == s.tokens == list(full[:expect])
    assert v.stop_reason == s.stop_reason == "stop_string"
    assert _decode(v.tokens).endswith(stop_str)


def test_stop_condition_unit():
    with pytest.raises(ValueError, match="max_new_tokens"):
        StopCondition(0)
    with pytest.raises(ValueError, match="decode"):
        StopCondition(5, stop_strings=["x"])
    stop = StopCondition(10, eos_token_ids=[7])
    assert stop.find_cut([1, 2, 3], 0) is None
    assert stop.find_cut([1, 7, 3, 7], 0) == (2, "eos")
    assert stop.find_cut([1, 7, 3, 7], 2) == (4, "eos")  # only tokens from `start` are checked
    assert StopCondition(3).find_cut([1, 2, 3, 4], 0) == (3, "max_new_tokens")
    ss = StopCondition(50, stop_strings=["cd"], decode=_decode)
    assert ss.find_cut([0, 1, 2], 0) is None
    assert ss.find_cut([0, 1, 2, 3, 4], 0) == (4, "stop_string")
    assert ss.find_cut([0, 1, 2, 3, 4], 3) == (4, "stop_string")
    # a stop string completed before `start` has been seen already: not reported again
    assert ss.find_cut([2, 3, 9, 9], 2) is None
    # eos wins over the budget at the same position
    assert StopCondition(2, eos_token_ids=[5]).find_cut([1, 5], 0) == (2, "eos")


def test_context_limit(tiny_llama):
    small = adapter_for(tiny_model("llama", num_layers=2, max_position_embeddings=24))
    prompt = random_prompt(10, 128, 0)
    for dec in (VanillaDecoder(small), _spec(small)):
        with pytest.raises(ValueError, match="exceeds the model's context of 24"):
            dec.generate(prompt, StopCondition(15))
        res = dec.generate(prompt, StopCondition(14))  # exactly at the limit is fine
        assert len(res.tokens) == 14
    with pytest.raises(ValueError, match="exceeds the model's context of 512"):
        VanillaDecoder(adapter_for(tiny_llama)).generate(prompt, StopCondition(503))


def test_generation_result_properties():
    r = GenerationResult(tokens=[1, 2, 3], wall_time=0.5, stop_reason="eos")
    assert r.new_tokens == 3 and r.tokens_per_second == 6.0
    assert r.mean_accepted_length == 0.0 and r.acceptance_rate == 0.0
    rounds = [RoundRecord(2, 0, 1, 0.5, "10"), RoundRecord(4, 3, 4, 0.5, "01", 1)]
    r2 = GenerationResult(tokens=[], wall_time=0.0, stop_reason="eos", rounds=rounds)
    assert r2.tokens_per_second == 0.0 and r2.mean_accepted_length == 2.5 and r2.acceptance_rate == 0.5
    assert (r2.accept_lengths, r2.draft_lengths, r2.drafted, r2.accepted) == ([1, 4], [2, 4], 6, 3)
    assert (r2.skip_ratios, r2.plans, r2.exit_layers) == ([0.5, 0.5], ["10", "01"], [None, 1])
    declined = GenerationResult([1], 0.1, "eos", [RoundRecord(0, 0, 1, 0.25)])
    assert (declined.draft_lengths, declined.plans, declined.accept_lengths) == ([0], [], [1])
    plain = GenerationResult([1, 2], 0.1, "eos", [RoundRecord(0, 0, 1, 0.0)], plain=True)
    assert (plain.draft_lengths, plain.accept_lengths) == ([], [1])


def test_bad_prompt_shapes(llama_adapter):

    with pytest.raises(ValueError, match="P >= 1"):
        DecodeState(llama_adapter, torch.zeros(1, 0, dtype=torch.long), 8)
    with pytest.raises(ValueError, match=r"\(B, P\)"):
        DecodeState(llama_adapter, torch.zeros(4, dtype=torch.long), 8)
    with pytest.raises(NotImplementedError):
        DecodeState(llama_adapter, torch.zeros(2, 3, dtype=torch.long), 8)


def test_verification_and_draft_reach_state_consistently(llama_adapter):
    """After every round of a real generation: committed == num_tokens - 1 and the tokens are
    vanilla's; the strategy gets the state as a `RoundView` (what it may use of it is checked
    statically: tests/framework/test_layering.py)."""
    checks = []

    class CheckingVerifier(GreedyVerifier):
        def verify(self, state, draft):
            assert isinstance(state, RoundView)
            checks.append(state.pending_position == state.num_tokens - 1)
            res = super().verify(state, draft)
            assert isinstance(res, Verification) and isinstance(draft, Draft)
            return res

    assert issubclass(CheckingVerifier, Verifier)
    res = _spec(llama_adapter, verifier=CheckingVerifier()).generate(
        random_prompt(6, 128, 0), StopCondition(16)
    )
    assert checks and all(checks)
    assert tuple(res.tokens) == _vanilla("llama", 0, 16)


# ----------------------------------------------------------------------------- the round's order


def test_round_order_hint_and_one_observe_signature(llama_adapter):
    """Each round: plan, length_hint, max_length(state, hint), draft, verify, then every strategy's
    ``observe(state, draft, result)`` on the committed state, selector first."""
    log: list[tuple] = []
    hint = LengthHint(max_length=2, threshold=0.5, source="spy")

    class Sel(StaticSelector):
        def plan(self, state):
            log.append(("plan",))
            return super().plan(state)

        def length_hint(self, state):
            log.append(("hint",))
            return hint

        def observe(self, state, draft, result):
            log.append(("observe", "selector", state.num_tokens, draft.length))

    class Len(FixedLength):
        def max_length(self, state, got=None):
            log.append(("max_length", got))
            return super().max_length(state, got)

        def observe(self, state, draft, result):
            log.append(("observe", "length", state.num_tokens, draft.length))

    class Drf(LayerSkipDrafter):
        def observe(self, state, draft, result):
            log.append(("observe", "drafter", state.num_tokens, draft.length))

    class Ver(GreedyVerifier):
        def observe(self, state, draft, result):
            log.append(("observe", "verifier", state.num_tokens, draft.length))

    dec = SpeculativeDecoder(
        llama_adapter,
        Sel(StaticSelectorConfig(skip_attn=(2,))),
        Len(FixedLengthConfig(k=3)),
        Drf(),
        Ver(),
    )
    prompt = random_prompt(6, 128, 0)
    res = dec.generate(prompt, StopCondition(12))
    assert res.tokens == list(_vanilla("llama", 0, 12))
    rounds = len(res.draft_lengths)
    assert len(log) == 7 * rounds
    n = 7  # the prompt and the first token
    for r in range(rounds):
        chunk = log[7 * r : 7 * r + 7]
        assert chunk[:3] == [("plan",), ("hint",), ("max_length", hint)]
        n += res.accept_lengths[r]
        k = res.draft_lengths[r]
        assert chunk[3:] == [("observe", who, n, k) for who in ("selector", "length", "drafter", "verifier")]


def test_the_strategies_summaries_are_not_timed():
    """Reporting is not decoding: the strategies' ``summary()`` runs after the clock stopped (the
    draft gate's break-even bisection took ~1% of a short generation when it was timed), and its
    result is still in the record."""
    import time

    class SlowSummary(FixedLength):
        def summary(self):
            time.sleep(0.5)
            return {"slow": True}

    adapter = adapter_for(tiny_model("llama", num_layers=2, seed=1))
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.5)),
        SlowSummary(FixedLengthConfig(k=2)),
        LayerSkipDrafter(),
        GreedyVerifier(),
    )
    res = dec.generate(random_prompt(5, 128, 2), StopCondition(max_new_tokens=6))
    assert res.strategy_summary["length"] == {"slow": True}
    assert res.wall_time < 0.5
