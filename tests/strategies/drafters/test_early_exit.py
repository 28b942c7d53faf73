"""strategies/drafters/early_exit.py: the contract, the draft is the first-E-blocks model, and the
verification's reuse of those blocks is exact and saves E block evaluations per drafted position."""

from __future__ import annotations

import pytest
import torch

from framework import LayerPlan, ModelInfo
from framework.config_fields import ConfigError, build_config
from framework.engine.adapter import adapter_for
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.state import DecodeState
from framework.testing import DrafterContract, cached_tiny_model, random_prompt
from strategies.drafters.early_exit import EarlyExitDrafter, EarlyExitDrafterConfig
from strategies.length.confidence import ConfidenceLength, ConfidenceLengthConfig
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier
from strategies.verifiers.sampling import SamplingVerifier, SamplingVerifierConfig

L = 4


class TestEarlyExitContract(DrafterContract):
    def make(self):
        return EarlyExitDrafter()


class TestEarlyExitNoReuseContract(DrafterContract):
    def make(self):
        return EarlyExitDrafter(EarlyExitDrafterConfig(reuse_kv=False, exit_layer=3))


class TestEarlyExitContractQwen3(DrafterContract):
    arch = "qwen3"

    def make(self):
        return EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=1))


def _info(n: int) -> ModelInfo:
    return ModelInfo(num_layers=n, hidden_size=64, vocab_size=128, max_context=512)


def _state(adapter, seed=0, **flags) -> DecodeState:
    state = DecodeState(adapter, random_prompt(6, 128, seed), 64, **flags)
    state.append(state.prefill().argmax(-1)[:, None])
    return state


def _prefix_greedy(adapter, tokens: torch.Tensor, e: int, k: int) -> list[int]:
    """Greedy continuation of the first-e-blocks model after the full-model KV of ``tokens[:-1]``,
    recomputed from scratch (a brand-new cache) at every step."""
    n_committed = tokens.shape[1] - 1
    plan = LayerPlan.from_indices(adapter.arch.num_layers, exit_layer=e)
    seq, out = tokens, []
    for _ in range(k):
        cache = adapter.new_cache(seq.shape[1])
        adapter.forward(tokens[:, :n_committed], torch.arange(n_committed)[None], cache, logits_at=None)
        cache.commit(n_committed)
        logits = adapter.forward(
            seq[:, n_committed:], torch.arange(n_committed, seq.shape[1])[None], cache, plan
        ).logits
        out.append(int(logits[0, -1].argmax()))
        seq = torch.cat([seq, torch.tensor([[out[-1]]])], dim=1)
    return out


@pytest.mark.parametrize("e", [1, 2, 3])
def test_draft_is_the_prefix_model(llama_adapter, e):
    state = _state(llama_adapter, seed=2)
    want = _prefix_greedy(llama_adapter, state.tokens, e, 4)
    # the skip bits of a plan are ignored: the draft is the unchanged prefix
    plan = LayerPlan.from_indices(L, attn=[0], mlp=[1], exit_layer=e)
    draft = EarlyExitDrafter().draft(state, plan, FixedLength(FixedLengthConfig(k=4)), 4)
    assert draft.tokens[0].tolist() == want
    assert draft.plan == LayerPlan.from_indices(L, exit_layer=e)
    assert draft.plan.skip_ratio == (L - e) / L


def test_exit_layer_from_plan_else_config():
    d = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=2))
    d.setup(_info(L))
    assert d.exit_layer(LayerPlan.full(L)) == 2
    assert d.exit_layer(LayerPlan.from_indices(L, exit_layer=3)) == 3
    for n, ratio, want in ((30, 0.25, 8), (4, 0.25, 1), (6, 0.25, 2), (4, 0.99, 3), (30, 0.8, 24)):
        r = EarlyExitDrafter(EarlyExitDrafterConfig(exit_ratio=ratio))
        r.setup(_info(n))
        assert r.exit_layer(LayerPlan.full(n)) == want, (n, ratio)


def test_bad_exit_layers():
    d = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=4))
    with pytest.raises(
        ConfigError, match=r"^--drafter\.exit_layer must be in \[1, 3\] \(the model has 4 blocks\), got 4$"
    ):
        d.setup(_info(L))
    with pytest.raises(ConfigError, match=r"exit_layer must be an integer >= 1, got 0"):
        EarlyExitDrafterConfig(exit_layer=0)
    for bad in (0.0, 1.0, -0.5):
        with pytest.raises(ConfigError, match=r"exit_ratio must be in \(0, 1\)"):
            EarlyExitDrafterConfig(exit_ratio=bad)
    with pytest.raises(ConfigError, match="on_stop must be one of keep, drop, got 'discard'"):
        build_config(EarlyExitDrafterConfig, {"on_stop": "discard"})
    ok = EarlyExitDrafter()
    ok.setup(_info(L))
    with pytest.raises(ValueError, match=r"the plan's exit_layer must be in \[1, 3\], got 4"):
        ok.exit_layer(LayerPlan.from_indices(L, exit_layer=L))
    with pytest.raises(ConfigError, match="at least 2 blocks"):
        EarlyExitDrafter().setup(_info(1))


@pytest.mark.parametrize("e", [1, 2, 3])
def test_reuse_gives_the_full_verification(llama_adapter, e):
    """A verify pass after a reusing draft equals one after a non-reusing draft: same logits (to
    rounding), same hidden states; it evaluates E fewer blocks at each drafted position."""
    outs = {}
    for reuse in (True, False):
        state = _state(llama_adapter, seed=3, capture_hidden=True)
        drafter = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=e, reuse_kv=reuse))
        drafter.setup(llama_adapter.arch.info())
        draft = drafter.draft(state, LayerPlan.full(L), FixedLength(FixedLengthConfig(k=3)), 3)
        evals = llama_adapter.executor.block_evals
        res = GreedyVerifier().verify(state, draft)
        evals = llama_adapter.executor.block_evals - evals
        state.commit(res)
        drafter.observe(state, draft, res)  # the drafter reads the reuse counters here
        outs[reuse] = (res, evals, state, drafter.summary())
    (r1, ev1, _, summ), (r0, ev0, s0, _) = outs[True], outs[False]
    assert torch.equal(r1.new_tokens, r0.new_tokens)
    torch.testing.assert_close(r1.hidden_states, r0.hidden_states, atol=1e-10, rtol=0)
    assert ev0 == 4 * L  # [pending, d1, d2, d3] through every block
    assert ev1 == ev0 - 3 * e  # the three fed positions reuse blocks < E
    assert summ["verify_blocks_saved"] == 3 * e and summ["reused_positions"] == 3
    assert s0.stats.verify_blocks_saved == 0


def test_reuse_over_a_generation_is_lossless_and_counted(llama_adapter):
    """Decoding with reuse equals vanilla; the saving equals E x the positions the draft fed."""
    prompt = random_prompt(7, 128, 4)
    stop = StopCondition(30)
    want = VanillaDecoder(llama_adapter).generate(prompt, stop).tokens
    saved = {}
    for reuse in (True, False):
        drafter = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=2, reuse_kv=reuse))
        dec = SpeculativeDecoder(
            llama_adapter,
            StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
            FixedLength(FixedLengthConfig(k=3)),
            drafter,
            GreedyVerifier(),
        )
        evals = llama_adapter.executor.block_evals
        res = dec.generate(prompt, stop)
        assert res.tokens == want
        summ = res.strategy_summary["drafter"]
        saved[reuse] = (llama_adapter.executor.block_evals - evals, summ.get("verify_blocks_saved", 0), res)
    (ev1, s1, res1), (ev0, s0, _) = saved[True], saved[False]
    assert s0 == 0 and s1 > 0
    assert s1 == 2 * res1.drafted  # every drafted token's input position was fed (k fixed: no break)
    assert ev0 - ev1 == s1


def test_drop_breaks_before_appending(llama_adapter):
    """on_stop='drop' discards the token that stopped the draft (DEL's break); the verification
    then reuses every verified position (the last one's blocks < E ran in the dropped step)."""
    length = ConfidenceLength(ConfidenceLengthConfig(threshold=0.999, max_length=8))  # stops at once
    for on_stop, want_len in (("keep", 1), ("drop", 0)):
        state = _state(llama_adapter, seed=5, need_confidence=True)
        drafter = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=2, on_stop=on_stop))
        drafter.setup(llama_adapter.arch.info())
        draft = drafter.draft(state, LayerPlan.full(L), length, 8)
        assert draft.length == want_len
        res = GreedyVerifier().verify(state, draft)
        # keep: [pending, d1] verified, pending fed; drop: [pending] verified, pending fed
        assert state.stats.reused_positions == 1 and state.stats.verify_blocks_saved == 2
        assert res.new_tokens.shape[1] == res.accepted + 1 <= want_len + 1
    assert drafter.summary()["dropped"] == 1
    # at the cap the last token is kept whatever on_stop says
    state = _state(llama_adapter, seed=5)
    draft = drafter.draft(state, LayerPlan.full(L), FixedLength(FixedLengthConfig(k=2)), 2)
    assert draft.length == 2


@pytest.mark.parametrize("on_stop", ["keep", "drop"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equality_with_confidence_stops(arch, on_stop):
    adapter = adapter_for(cached_tiny_model(arch, 4))
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
        ConfidenceLength(ConfidenceLengthConfig(threshold=0.05, max_length=6)),
        EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=3, on_stop=on_stop)),
        GreedyVerifier(),
    )
    for seed in (0, 1):
        prompt = random_prompt(6, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, StopCondition(24)).tokens
        res = dec.generate(prompt, StopCondition(24))
        assert res.tokens == want
        assert 0 <= res.accepted <= res.drafted


def test_sampling_verifier_with_reuse_runs(llama_adapter):
    """Speculative sampling verifies through the reusing path too (tokens valid, KV consistent)."""
    dec = SpeculativeDecoder(
        llama_adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
        FixedLength(FixedLengthConfig(k=3)),
        EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=2)),
        SamplingVerifier(SamplingVerifierConfig(temperature=1.0)),
    )
    res = dec.generate(random_prompt(6, 128, 0), StopCondition(20))
    assert len(res.tokens) == 20 and res.strategy_summary["drafter"]["verify_blocks_saved"] > 0


def test_drop_refuses_a_stop_rule_on_the_sampled_token_under_speculative_sampling(llama_adapter):
    """As for layer_skip: dropping a sampled token because of its own probability would bias
    speculative sampling (`DecodeState.drop_draft_step`); the top-1 rule does not depend on the sample."""
    verifier = SamplingVerifier(SamplingVerifierConfig(seed=0))
    for stop_on, ok in (("top1", True), ("sampled", False)):
        state = DecodeState(
            llama_adapter, random_prompt(6, 128, 0), 64, need_confidence=True, need_draft_probs=True
        )
        state.append(state.prefill().argmax(-1)[:, None])
        state.draft_sampler, state.random = verifier.draft_sampler(), verifier.random
        length = ConfidenceLength(ConfidenceLengthConfig(threshold=0.999, stop_on=stop_on))
        drafter = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=2, on_stop="drop"))
        drafter.setup(llama_adapter.arch.info())
        if ok:
            assert drafter.draft(state, LayerPlan.full(L), length, 8).length == 0
        else:
            with pytest.raises(ValueError, match="biases speculative sampling"):
                drafter.draft(state, LayerPlan.full(L), length, 8)


def _named(name: str, layers: int) -> ModelInfo:
    return ModelInfo(num_layers=layers, hidden_size=64, vocab_size=128, max_context=512, name=name)


def test_a_layerskip_checkpoint_exits_where_its_paper_did():
    d = EarlyExitDrafter(EarlyExitDrafterConfig(exit_ratio=0.8))
    d.setup(_named("facebook/layerskip-llama2-7B", 32))
    assert d.exit_layer(LayerPlan.full(32)) == 8  # LayerSkip's E8, not 0.8 x 32
    assert "E8-gamma6" in d.summary()["checkpoint_exit"]
    d.setup(_named("/models/layerskip-llama2-13B/", 40))  # a local directory of that name
    assert d.exit_layer(LayerPlan.full(40)) == 7
    d.setup(_named("/models/layerskip-llama3.2-1B", 16))
    assert d.exit_layer(LayerPlan.full(16)) == 3


def test_checkpoint_exit_needs_the_name_and_the_depth_and_yields_to_an_explicit_exit():
    ratio = EarlyExitDrafter(EarlyExitDrafterConfig(exit_ratio=0.8))
    ratio.setup(_named("meta-llama/Llama-2-7b-hf", 32))  # not a LayerSkip checkpoint
    assert ratio.exit_layer(LayerPlan.full(32)) == 26 and ratio.checkpoint is None
    ratio.setup(_named("facebook/layerskip-llama2-7B", 30))  # another depth: not that checkpoint
    assert ratio.exit_layer(LayerPlan.full(30)) == 24
    explicit = EarlyExitDrafter(EarlyExitDrafterConfig(exit_layer=12))
    explicit.setup(_named("facebook/layerskip-llama2-7B", 32))
    assert explicit.exit_layer(LayerPlan.full(32)) == 12
    off = EarlyExitDrafter(EarlyExitDrafterConfig(exit_ratio=0.5, checkpoint_exit=False))
    off.setup(_named("facebook/layerskip-llama2-7B", 32))
    assert off.exit_layer(LayerPlan.full(32)) == 16 and "checkpoint_exit" not in off.summary()
