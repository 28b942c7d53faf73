"""Test helpers shipped with the package: stub strategies and contract mixins (the tiny random
models come from `framework.experiment.tiny` and are re-exported here).

Researchers test their own strategies by inheriting a contract mixin and overriding ``make``::

    from framework.testing.contracts import LayerSelectorContract

    class TestMySelector(LayerSelectorContract):
        def make(self):
            return MySelector(MySelectorConfig(budget=0.5))

pytest then runs every ``test_*`` method of the mixin against the instance: the interface contract
(types, shapes, ranges) and the central invariant of the framework, that greedy self-speculative
decoding with the strategy in place produces exactly the tokens of plain greedy decoding.

Class attributes tune a contract: ``arch`` / ``num_layers`` pick the tiny model, ``max_new_tokens``
and ``prompt_seeds`` the greedy-equality run, and ``greedy_lossless = False`` skips that run for a
strategy not meant to be lossless (a sampling verifier). The slots not under test are filled with
:data:`CONTRACT_PARTNERS`. The mixins are plain classes (no ``unittest.TestCase``) and need no
fixtures, so they work from any test suite; ``pytest`` is imported only when a test runs.

Everything here runs on CPU in seconds and never downloads anything: models are built in-process
from a small config with random weights (`tiny_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from framework.engine.context import PrepareContext
from framework.engine.cost_model import CostModel
from framework.experiment.plugins import load_builtin_strategies
from framework.experiment.tiny import ARCHS, cached_tiny_model, tiny_model
from framework.interfaces import REGISTRIES, Drafter, LengthController, Strategy, Verifier
from framework.types import Draft, LayerPlan, Verification

#: The strategy `default_strategy_instance` picks for a kind when no name is given.
DEFAULT_NAMES: dict[str, str] = {
    "selector": "static",
    "length": "fixed",
    "drafter": "layer_skip",
    "verifier": "greedy",
}

#: The partners a contract mixin puts in the slots it does not test: ``(name, config overrides)``.
#: The static selector skips half the eligible sub-layers so that drafts are sometimes rejected
#: (its default ratio 0.2 skips nothing on a 4-layer model, and every draft would be accepted).
CONTRACT_PARTNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "selector": ("static", {"skip_ratio": 0.5}),
    "length": ("fixed", {"k": 3}),
    "drafter": ("layer_skip", {}),
    "verifier": ("greedy", {}),
}


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------


class FakeClock:
    """A clock for tests of time budgets (`framework.policies.budget.WorkBudget`): seconds move only when
    the test says so (`advance`, or by setting ``t``); ``reads`` counts how often it was read."""

    def __init__(self) -> None:
        self.t = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def random_prompt(length: int = 6, vocab_size: int = 128, seed: int = 0) -> torch.Tensor:
    """LongTensor (1, length) of random token ids (reproducible, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, length), generator=g)


# --------------------------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------------------------


#: Config overrides that shrink a strategy's offline search for tests (``fast=True``). The lossless
#: invariant holds for whatever skip set a search returns; these only make it cheaper to find one.
FAST_OVERRIDES: dict[tuple[str, str], dict[str, Any]] = {
    ("selector", "selfsd_bo"): {"iterations": 3, "calib_limit": 2, "calib_max_new_tokens": 8},
}


def synthetic_cost_model(num_layers: int, max_tokens: int = 16) -> CostModel:
    """A deterministic `CostModel` in units of one step: the LM head and embedding 0.1, attention
    0.5 / L and MLP 0.4 / L per sub-layer, a verification of T tokens 1 + 0.1 (T - 1)."""
    return CostModel(
        num_layers=num_layers,
        base=0.1,
        attn=0.5 / num_layers,
        mlp=0.4 / num_layers,
        verify_costs=tuple(1.0 + 0.1 * (t - 1) for t in range(1, max_tokens + 1)),
    )


def prepare_context(
    adapter: Any, *, store: dict[str, Any] | None = None, measure: bool = False
) -> PrepareContext:
    """A `PrepareContext` for tests: a deterministic byte-level ``encode`` (no tokenizer), no files,
    no log output, and (unless ``measure``) a `synthetic_cost_model` instead of timing the model."""
    info = adapter.info()
    vocab = info.vocab_size

    def encode(text: str) -> list[int]:
        return [1 + b % (vocab - 1) for b in text.encode()[:16]] or [1]

    ctx = PrepareContext(
        adapter=adapter, encode=encode, log=lambda msg: None, store={} if store is None else store
    )
    if not measure:
        ctx.store.setdefault("cost_model", synthetic_cost_model(info.num_layers))
    return ctx


def default_strategy_instance(kind: str, name: str | None = None, *, fast: bool = False) -> Strategy:
    """Construct the registered strategy ``name`` of ``kind`` with its default config.

    Args:
        kind: ``"selector"``, ``"length"``, ``"drafter"`` or ``"verifier"``.
        name: registered name; ``None`` takes :data:`DEFAULT_NAMES` (or the first registered).
        fast: apply :data:`FAST_OVERRIDES` (a cheaper offline search) when there are any.
    """
    if kind not in REGISTRIES:
        raise ValueError(f"unknown strategy kind {kind!r}; choose from {', '.join(REGISTRIES)}")
    reg = REGISTRIES[kind]
    load_builtin_strategies()  # idempotent: the defaults are built-in strategies
    if name is None:
        name = DEFAULT_NAMES.get(kind)
        if name not in reg:
            name = reg.names()[0]
    entry = reg.entry(name)
    if fast and (kind, name) in FAST_OVERRIDES:
        from framework.config import build_config

        return entry.cls(build_config(entry.config, FAST_OVERRIDES[kind, name]))
    return entry.cls(entry.config())


@dataclass(frozen=True)
class _NoConfig:
    pass


class AlwaysAcceptDrafter(Drafter):
    """Stub drafter (unregistered) that drafts with the full model, ignoring the plan.

    Its tokens are the target's own greedy continuation, so a greedy verifier accepts all of them
    (litgpt's "always accepts" stub).
    """

    Config = _NoConfig

    def draft(self, state, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        full = LayerPlan.full(state.info.num_layers)
        x, toks = state.pending, []
        for _ in range(max_tokens):
            tok = state.forward_draft(x, full).logits[:, -1].argmax(-1)
            toks.append(tok)
            x = tok[:, None]
        return Draft(torch.stack(toks, dim=1), full)


class NeverAcceptDrafter(Drafter):
    """Stub drafter (unregistered) whose first token is never the target's greedy choice.

    It runs the full model and proposes the runner-up token, so a greedy verifier accepts nothing
    (litgpt's "never accepts" stub).
    """

    Config = _NoConfig

    def draft(self, state, plan: LayerPlan, length: LengthController, max_tokens: int) -> Draft:
        full = LayerPlan.full(state.info.num_layers)
        x, toks = state.pending, []
        for _ in range(max_tokens):
            logits = state.forward_draft(x, full).logits[:, -1]
            tok = logits.topk(2, dim=-1).indices[:, 1]  # the runner-up: never the argmax
            toks.append(tok)
            x = tok[:, None]
        return Draft(torch.stack(toks, dim=1), full)


class RejectAllVerifier(Verifier):
    """Stub verifier (unregistered) that accepts nothing and commits the target's own next token.

    Still lossless for greedy decoding: every round commits exactly one target token.
    """

    Config = _NoConfig

    def verify(self, state, draft: Draft) -> Verification:
        block = torch.cat([state.pending, draft.tokens], dim=1)
        target = state.forward_verify(block, logits_at="all").logits.argmax(-1)
        return Verification(
            num_accepted=torch.zeros(block.shape[0], dtype=torch.long, device=block.device),
            new_tokens=target[:, :1],
            target_tokens=target,
        )


class ZeroLength(LengthController):
    """Stub length controller (unregistered) that always declines to draft."""

    Config = _NoConfig

    def max_length(self, state) -> int:
        return 0


# --------------------------------------------------------------------------------------------
# Contract mixins
# --------------------------------------------------------------------------------------------


class _Contract:
    """Shared machinery of the contract mixins (plain pytest classes, not unittest)."""

    #: The kind of strategy under test (a key of REGISTRIES).
    kind: ClassVar[str] = ""
    #: Architecture and depth of the tiny model the contract runs on.
    arch: ClassVar[str] = "llama"
    num_layers: ClassVar[int] = 4
    #: Tokens generated by the greedy-equality check.
    max_new_tokens: ClassVar[int] = 24
    #: Prompts (seeds of random prompts) used by the greedy-equality check.
    prompt_seeds: ClassVar[tuple[int, ...]] = (0, 1)
    #: Set False for a strategy that is not meant to be lossless under greedy decoding (e.g. a
    #: sampling verifier); the greedy-equality test is then skipped.
    greedy_lossless: ClassVar[bool] = True

    def make(self) -> Strategy:
        """Return a fresh instance of the strategy under test (override this)."""
        raise NotImplementedError(f"{type(self).__name__} must override make()")

    # ---- helpers --------------------------------------------------------------------------
    def model(self) -> torch.nn.Module:
        return cached_tiny_model(self.arch, self.num_layers)

    def adapter(self):
        from framework.engine.adapter import adapter_for

        return adapter_for(self.model())

    def partner(self, kind: str) -> Strategy:
        """The strategy put in slot ``kind`` next to the one under test (see CONTRACT_PARTNERS)."""
        from framework.config import build_config

        load_builtin_strategies()
        name, overrides = CONTRACT_PARTNERS[kind]
        if name not in REGISTRIES[kind]:
            return default_strategy_instance(kind)
        entry = REGISTRIES[kind].entry(name)
        return entry.cls(build_config(entry.config, overrides))

    def strategies(self, instance: Strategy) -> dict[str, Strategy]:
        """The four strategies with ``instance`` in its slot and partners elsewhere."""
        out = {k: self.partner(k) for k in ("selector", "length", "drafter", "verifier") if k != self.kind}
        out[self.kind] = instance
        return out

    def prepared(self):
        """A tiny adapter, the strategies (set up) and a fresh decode state."""
        adapter = self.adapter()
        s = self.strategies(self.make())
        for inst in s.values():
            self.setup_instance(inst, adapter)
        return adapter, s, self.new_state(adapter, s)

    def setup_instance(self, instance: Strategy, adapter) -> Strategy:
        instance.setup(adapter.info())
        instance.prepare(prepare_context(adapter))
        instance.reset()
        return instance

    def new_state(self, adapter, strategies: dict[str, Strategy], prompt_seed: int = 0, prompt_len: int = 6):
        """A DecodeState after prefill and the first token, flags set from the strategies."""
        from framework.engine.state import DecodeState

        prompt = random_prompt(prompt_len, adapter.config.vocab_size, prompt_seed)
        state = DecodeState.for_strategies(
            adapter,
            prompt,
            prompt_len + 64,
            strategies["selector"],
            strategies["length"],
            strategies["verifier"],
        )
        logits = state.prefill()
        state.append(strategies["verifier"].choose(logits)[:, None])
        return state

    def run_round(self, state, s: dict[str, Strategy], k_max: int = 4):
        """One select -> draft -> verify -> commit -> observe round; returns (plan, draft, result)."""
        plan = s["selector"].plan(state)
        k = max(0, min(int(s["length"].max_length(state)), k_max))
        if k > 0:
            draft = s["drafter"].draft(state, plan, s["length"], k)
        else:
            draft = Draft.empty(1, plan, state.device)
        result = s["verifier"].verify(state, draft)
        state.commit(result)
        s["selector"].observe(state, draft, result)
        s["length"].observe(draft, result)
        return plan, draft, result

    # ---- shared tests -----------------------------------------------------------------------
    def test_is_strategy_of_kind(self):
        inst = self.make()
        base = REGISTRIES[self.kind].base_cls
        assert base is not None and isinstance(inst, base)
        assert inst.config is not None

    def test_summary_is_dict(self):
        adapter = self.adapter()
        inst = self.setup_instance(self.make(), adapter)
        assert isinstance(inst.summary(), dict)

    def test_greedy_equality(self):
        """Speculative decoding with this strategy emits exactly the vanilla greedy tokens."""
        import pytest

        from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder

        if not self.greedy_lossless:
            pytest.skip("strategy declared not greedy-lossless")
        adapter = self.adapter()
        s = self.strategies(self.make())
        dec = SpeculativeDecoder(adapter, s["selector"], s["length"], s["drafter"], s["verifier"])
        dec.prepare(prepare_context(adapter))
        for seed in self.prompt_seeds:
            prompt = random_prompt(6, adapter.config.vocab_size, seed)
            stop = StopCondition(self.max_new_tokens)
            want = VanillaDecoder(adapter).generate(prompt, stop).tokens
            got = dec.generate(prompt, stop)
            assert got.tokens == want, f"prompt seed {seed}: speculative output differs from vanilla"
            assert len(got.tokens) == self.max_new_tokens
            assert 0 <= got.accepted <= got.drafted


class LayerSelectorContract(_Contract):
    """Contract tests for a `LayerSelector`; override ``make``."""

    kind = "selector"

    def test_plan_is_valid_layer_plan(self):
        adapter, s, state = self.prepared()
        for _ in range(3):
            plan = s["selector"].plan(state)
            assert isinstance(plan, LayerPlan)
            assert plan.num_layers == adapter.num_layers
            assert plan.num_skipped < 2 * adapter.num_layers, "a plan must run at least one sub-layer"
            assert 0.0 <= plan.skip_ratio < 1.0
            self.run_round(state, s)

    def test_observe_keeps_plans_valid(self):
        adapter, s, state = self.prepared()
        for _ in range(4):
            plan, draft, result = self.run_round(state, s)
            assert plan.num_layers == adapter.num_layers
        if s["selector"].needs_hidden_states:
            assert state.last_hidden_states is not None
            assert state.last_hidden_states.shape[0] == adapter.num_layers + 1
        plan = s["selector"].plan(state)
        assert isinstance(plan, LayerPlan) and plan.num_skipped < 2 * adapter.num_layers


class LengthControllerContract(_Contract):
    """Contract tests for a `LengthController`; override ``make``."""

    kind = "length"

    def test_max_length_is_nonnegative_int(self):
        adapter, s, state = self.prepared()
        for _ in range(4):
            k = s["length"].max_length(state)
            assert isinstance(k, int) and not isinstance(k, bool)
            assert k >= 0
            self.run_round(state, s)

    def test_should_continue_returns_bool(self):
        adapter = self.adapter()
        inst = self.setup_instance(self.make(), adapter)
        for drafted in (1, 2, 5):
            for conf in (0.0, 0.3, 0.7, 1.0):
                out = inst.should_continue(drafted, conf)
                assert isinstance(out, bool)
        if not inst.needs_confidence:
            assert isinstance(inst.should_continue(1, None), bool)

    def test_drafts_respect_max_length(self):
        adapter, s, state = self.prepared()
        for _ in range(4):
            k_max = s["length"].max_length(state)
            _, draft, _ = self.run_round(state, s, k_max=64)
            assert draft.length <= k_max


class DrafterContract(_Contract):
    """Contract tests for a `Drafter`; override ``make``.

    ``may_decline = True`` lets a round's draft be empty (a drafter that proposes nothing when it
    has nothing good to propose, like ``prompt_lookup`` without an n-gram match); otherwise every
    draft must have at least one token.
    """

    kind = "drafter"
    may_decline: ClassVar[bool] = False

    class _StopAfterOne(LengthController):
        Config = _NoConfig

        def max_length(self, state) -> int:
            return 8

        def should_continue(self, drafted, confidence):
            return False

    def _plans(self, num_layers: int) -> list[LayerPlan]:
        return [
            LayerPlan.full(num_layers),
            LayerPlan.from_indices(num_layers, attn=[1], mlp=[2]),
            LayerPlan.from_indices(num_layers, attn=range(num_layers), mlp=[0]),
            LayerPlan.from_indices(num_layers, mlp=[1], exit_layer=max(1, num_layers - 1)),
        ]

    def _check_draft(self, draft, state, plan, max_tokens: int) -> None:
        assert isinstance(draft, Draft)
        k = draft.length
        assert (0 if self.may_decline else 1) <= k <= max_tokens
        assert draft.tokens.shape == (1, k) and draft.tokens.dtype == torch.long
        assert int(draft.tokens.min()) >= 0 and int(draft.tokens.max()) < state.info.vocab_size
        assert isinstance(draft.plan, LayerPlan) and draft.plan.num_layers == state.info.num_layers
        if state.need_confidence:
            assert draft.confidences is not None and draft.confidences.shape == (1, k)
            assert bool(((draft.confidences >= 0) & (draft.confidences <= 1)).all())
        if state.need_draft_probs:
            assert draft.probs is not None and draft.probs.shape == (1, k, state.info.vocab_size)
            torch.testing.assert_close(
                draft.probs.sum(-1).double(), torch.ones(1, k, dtype=torch.float64), atol=1e-4, rtol=0
            )

    def test_draft_shapes_and_bounds(self):
        adapter = self.adapter()
        for length_name in REGISTRIES["length"].names():
            s = self.strategies(self.make())
            s["length"] = default_strategy_instance("length", length_name)
            for inst in s.values():
                self.setup_instance(inst, adapter)
            for plan in self._plans(adapter.num_layers):
                for max_tokens in (1, 3, 6):
                    state = self.new_state(adapter, s)
                    draft = s["drafter"].draft(state, plan, s["length"], max_tokens)
                    self._check_draft(draft, state, plan, max_tokens)

    def test_confidences_when_requested(self):
        from framework.engine.state import DecodeState

        adapter = self.adapter()
        drafter = self.setup_instance(self.make(), adapter)
        length = self.partner("length")
        for need_conf in (True, False):
            state = DecodeState(adapter, random_prompt(5), capacity=32, need_confidence=need_conf)
            state.append(state.prefill().argmax(-1)[:, None])
            draft = drafter.draft(state, LayerPlan.full(adapter.num_layers), length, 3)
            self._check_draft(draft, state, None, 3)

    def test_stops_when_length_says_so(self):
        adapter, s, state = self.prepared()
        draft = s["drafter"].draft(state, LayerPlan.full(adapter.num_layers), self._StopAfterOne(), 8)
        assert draft.length == 1, (
            "should_continue returned False after the first token: that token is kept, no more"
        )

    def test_committed_cache_untouched(self):
        adapter, s, state = self.prepared()
        c = state.cache.committed
        keys = state.cache.keys[:, :, :, :c].clone()
        values = state.cache.values[:, :, :, :c].clone()
        tokens = state.tokens.clone()
        s["drafter"].draft(state, LayerPlan.from_indices(adapter.num_layers, attn=[1]), s["length"], 4)
        assert state.cache.committed == c
        assert torch.equal(state.tokens, tokens)
        assert torch.equal(state.cache.keys[:, :, :, :c], keys)
        assert torch.equal(state.cache.values[:, :, :, :c], values)


class VerifierContract(_Contract):
    """Contract tests for a `Verifier`; override ``make``."""

    kind = "verifier"

    def _check(self, result, draft, state) -> int:
        assert isinstance(result, Verification)
        k = draft.length
        assert result.num_accepted.shape == (1,)
        m = result.accepted
        assert 0 <= m <= k
        assert result.new_tokens.shape == (1, m + 1) and result.new_tokens.dtype == torch.long
        # Accepted tokens are draft tokens: the chain's, except that a tree verifier may end the
        # accepted path on one of the step's top-k alternatives (Draft.top_tokens).
        if m:
            assert torch.equal(result.new_tokens[:, : m - 1], draft.tokens[:, : m - 1]), (
                "accepted tokens must be the draft's"
            )
            last = int(result.new_tokens[0, m - 1])
            allowed = {int(draft.tokens[0, m - 1])}
            if draft.top_tokens is not None:
                allowed |= set(draft.top_tokens[0, m - 1].tolist())
            assert last in allowed, "accepted tokens must be the draft's (or its top-k alternatives)"
        assert 0 <= int(result.new_tokens.min()) and int(result.new_tokens.max()) < state.info.vocab_size
        if result.kv_keep is not None:
            assert result.kv_keep.numel() == m + 1
        return m

    def test_verify_bounds_and_commit(self):
        adapter = self.adapter()
        s = self.strategies(self.make())
        for inst in s.values():
            self.setup_instance(inst, adapter)
        L = adapter.num_layers
        plans = [
            LayerPlan.full(L),
            LayerPlan.from_indices(L, attn=range(L)),
            LayerPlan.from_indices(L, mlp=[1]),
        ]
        for plan in plans:
            for k in (1, 4):
                state = self.new_state(adapter, s)
                draft = s["drafter"].draft(state, plan, s["length"], k)
                result = s["verifier"].verify(state, draft)
                self._check(result, draft, state)
                n_before = state.num_tokens
                state.commit(result)
                assert state.num_tokens == n_before + result.accepted + 1
                assert state.cache.committed == state.num_tokens - 1

    def test_empty_draft(self):
        adapter, s, state = self.prepared()
        draft = Draft.empty(1, LayerPlan.full(adapter.num_layers))
        result = s["verifier"].verify(state, draft)
        assert self._check(result, draft, state) == 0
        state.commit(result)
        assert state.cache.committed == state.num_tokens - 1

    def test_random_tokens_draft(self):
        adapter, s, state = self.prepared()
        g = torch.Generator().manual_seed(3)
        toks = torch.randint(0, adapter.config.vocab_size, (1, 5), generator=g)
        draft = Draft(toks, LayerPlan.full(adapter.num_layers))
        if state.need_confidence:
            draft.confidences = torch.full((1, 5), 0.5)
        if state.need_draft_probs:
            draft.probs = torch.full((1, 5, adapter.config.vocab_size), 1.0 / adapter.config.vocab_size)
        result = s["verifier"].verify(state, draft)
        self._check(result, draft, state)

    def test_choose_shape(self):
        adapter = self.adapter()
        inst = self.setup_instance(self.make(), adapter)
        logits = torch.randn(1, adapter.config.vocab_size, dtype=torch.float64)
        tok = inst.choose(logits)
        assert tok.shape == (1,) and tok.dtype == torch.long
        assert 0 <= int(tok) < adapter.config.vocab_size


__all__ = [
    "ARCHS",
    "CONTRACT_PARTNERS",
    "DEFAULT_NAMES",
    "AlwaysAcceptDrafter",
    "DrafterContract",
    "LayerSelectorContract",
    "LengthControllerContract",
    "NeverAcceptDrafter",
    "RejectAllVerifier",
    "VerifierContract",
    "ZeroLength",
    "cached_tiny_model",
    "default_strategy_instance",
    "random_prompt",
    "tiny_model",
]
