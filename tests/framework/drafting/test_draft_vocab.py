"""framework/drafting/draft_vocab.py: the draft_vocab option of drafters that run the LM head: its
config checks, its preparation, what the decoder does with the head, and the drafts it produces."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from framework import REGISTRIES
from framework.config import ConfigError, build_config
from framework.drafting.draft_vocab import MIN_DRAFT_VOCAB, DraftVocab, DraftVocabConfig
from framework.engine.adapter import adapter_for
from framework.engine.cost_model import CostModel
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.draft_head import DraftHead
from framework.kernels import cpu as kernels
from framework.testing import prepare_context, random_prompt, tiny_model
from strategies.length.fixed import FixedLength, FixedLengthConfig
from strategies.selectors.static import StaticSelector, StaticSelectorConfig
from strategies.verifiers.greedy import GreedyVerifier

HEAD_DRAFTERS = ("layer_skip", "early_exit", "hybrid")


@pytest.fixture(scope="module")
def adapter():
    return adapter_for(tiny_model("llama", num_layers=4, seed=7))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))


def _drafter(name: str, **overrides):
    entry = REGISTRIES["drafter"].entry(name)
    return entry.cls(build_config(entry.config, overrides))


def _spied_decoder(
    adapter, drafter, attr: str, seen: dict, state_attr: str | None = None
) -> SpeculativeDecoder:
    """A decoder (static plan skipping two MLPs, k = 3, greedy) whose selector records the
    preparation context's ``attr`` and the round view's ``state_attr`` (default ``attr``) in
    ``seen["ctx"]`` / ``seen["state"]``."""

    class Spy(StaticSelector):
        def prepare(self, ctx):
            seen["ctx"] = getattr(ctx, attr)

        def plan(self, state):
            seen["state"] = getattr(state, state_attr or attr)
            return super().plan(state)

    return SpeculativeDecoder(
        adapter,
        Spy(StaticSelectorConfig(skip_mlp=(1, 2))),
        FixedLength(FixedLengthConfig(k=3)),
        drafter,
        GreedyVerifier(),
    )


def test_every_drafter_that_runs_the_lm_head_offers_the_option():
    for name in HEAD_DRAFTERS:
        cfg = REGISTRIES["drafter"].entry(name).config
        assert issubclass(cfg, DraftVocabConfig), name
        assert issubclass(REGISTRIES["drafter"].get(name), DraftVocab) or name == "hybrid"
        fields = {f.name for f in dataclasses.fields(cfg)}
        assert {"draft_vocab", "vocab_file", "vocab_context", "draft_weights"} <= fields
    assert not issubclass(REGISTRIES["drafter"].entry("prompt_lookup").config, DraftVocabConfig)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"draft_vocab": MIN_DRAFT_VOCAB - 1}, "draft_vocab"),
        ({"draft_vocab": -5}, "draft_vocab"),
        ({"draft_vocab": 1.5}, "draft_vocab"),
        ({"vocab_file": "ranking.json"}, "vocab_file"),
        ({"draft_vocab": 64, "vocab_context": "maybe"}, "vocab_context"),
        ({"draft_weights": "int4"}, "draft_weights"),
    ],
)
@pytest.mark.parametrize("name", HEAD_DRAFTERS)
def test_config_rejects_bad_values(name, overrides, field):
    with pytest.raises(ConfigError, match=field) as err:
        REGISTRIES["drafter"].entry(name).config(**overrides)
    assert err.value.allowed


def test_cli_strings_build_the_config():
    cfg = build_config(
        REGISTRIES["drafter"].entry("layer_skip").config, {"draft_vocab": "64", "vocab_context": "false"}
    )
    assert (cfg.draft_vocab, cfg.vocab_context) == (64, False)


def test_draft_vocab_of_the_whole_vocabulary_or_more_is_the_full_head(adapter):
    """A preset's K fits a model of any vocabulary: K >= V drafts with the full head."""
    for k in (128, 1000):
        d = _drafter("layer_skip", draft_vocab=k)
        d.prepare(prepare_context(adapter))
        assert d.draft_head() is None and d.head_summary() == {}


def test_a_bad_ranking_file_fails_at_prepare_naming_the_file(adapter, tmp_path):
    bad = tmp_path / "ranking.json"
    bad.write_text('{"format": "nope"}')
    d = _drafter("early_exit", draft_vocab=32, vocab_file=str(bad))
    with pytest.raises(ConfigError, match="vocab_file") as err:
        d.prepare(prepare_context(adapter))
    assert "ranking.json" in str(err.value)


def test_using_the_head_before_prepare_is_a_clear_error(adapter):
    d = _drafter("layer_skip", draft_vocab=32)
    dec = SpeculativeDecoder(adapter, StaticSelector(), FixedLength(), d, GreedyVerifier())
    with pytest.raises(RuntimeError, match=r"prepare\(ctx\)"):
        dec.generate(random_prompt(5, 128, 0), StopCondition(4))


@pytest.mark.parametrize("name", HEAD_DRAFTERS)
def test_prepare_builds_the_head_and_the_decoder_hands_it_on(adapter, name):
    d = _drafter(name, draft_vocab=32)
    seen: dict = {}
    dec = _spied_decoder(adapter, d, "draft_head", seen)
    dec.prepare(prepare_context(adapter))
    head = d.draft_head()
    assert isinstance(head, DraftHead) and head.size == 32
    assert seen["ctx"] is head
    prompt = random_prompt(6, 128, 1)
    res = dec.generate(prompt, StopCondition(16))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    live = seen["state"]
    assert live.base is head
    summary = res.strategy_summary["drafter"]
    assert summary["draft_vocab"] == 32 and summary["draft_vocab_now"] == live.size
    assert 0.0 <= summary["vocab_coverage"] <= 1.0


@pytest.mark.parametrize("name", ["layer_skip", "early_exit"])
def test_drafted_tokens_and_candidates_lie_in_the_head(adapter, name):
    d = _drafter(name, draft_vocab=24, vocab_context=False)
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_mlp=(1,))),
        FixedLength(FixedLengthConfig(k=4)),
        d,
        REGISTRIES["verifier"].get("tree")(),
    )
    dec.prepare(prepare_context(adapter))
    allowed = set(d.draft_head().ids.tolist())
    drafts = []
    orig = d.draft

    def record(state, plan, length, k):
        out = orig(state, plan, length, k)
        drafts.append(out)
        return out

    d.draft = record
    prompt = random_prompt(6, 128, 2)
    res = dec.generate(prompt, StopCondition(20))
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(20)).tokens
    assert drafts
    for draft in drafts:
        assert set(draft.tokens.flatten().tolist()) <= allowed
        assert set(draft.top_tokens.flatten().tolist()) <= allowed
        # confidences are top-1 probabilities of q over the head's tokens: the best candidate's
        assert torch.allclose(draft.confidences, draft.top_probs[..., 0])
        assert torch.allclose(draft.top_probs.sum(-1), draft.top_probs.sum(-1).clamp(max=1.0))


def test_the_cost_model_prices_drafts_with_the_head(adapter):
    d = _drafter("layer_skip", draft_vocab=32)
    ctx = prepare_context(adapter)
    d.prepare(ctx)
    full = ctx.cost_model()
    priced = dataclasses.replace(ctx, draft_head=d.draft_head()).cost_model()
    assert priced.draft_vocab == 32 and full.draft_vocab == 0
    assert priced.verify_costs == full.verify_costs and priced.attn == full.attn
    assert priced.base == pytest.approx(full.base - full.head + priced.head)
    assert priced.full_head == full.full_head
    assert ctx.prepared.get(CostModel, (d.draft_head().key, "float32")) is priced


# ---- draft_weights: a compressed copy of the weights for draft passes -----------------------------


@pytest.fixture(scope="module")
def kernel_adapter():
    if not kernels.available():
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason}")
    return adapter_for(tiny_model("llama", num_layers=4, seed=7, dtype=torch.float32), fast_kernels=True)


@contextlib.contextmanager
def _counting_mlp(branches):
    """Count the calls of ``branches.mlp_branch`` (a `FusedBlocks`) while the block runs: yields a
    one-element list holding the count."""
    count = [0]
    real = branches.mlp_branch

    def counting(*a, **k):
        count[0] += 1
        return real(*a, **k)

    branches.mlp_branch = counting
    try:
        yield count
    finally:
        del branches.mlp_branch


@pytest.mark.parametrize("name", HEAD_DRAFTERS)
@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_prepare_builds_the_weights_and_every_draft_pass_runs_them(kernel_adapter, name, fmt):
    adapter = kernel_adapter
    d = _drafter(name, draft_weights=fmt)
    seen: dict = {"passes": 0}
    dec = _spied_decoder(adapter, d, "draft_weights", seen, "compressed_drafts")
    dec.prepare(prepare_context(adapter))
    weights = d.draft_weights()
    assert weights is adapter.draft_branches(fmt) and weights.weights == fmt
    assert seen["ctx"] is weights
    prompt = random_prompt(6, 128, 1)
    with _counting_mlp(weights) as calls:
        res = dec.generate(prompt, StopCondition(16))
    seen["passes"] = calls[0]
    assert res.tokens == VanillaDecoder(adapter).generate(prompt, StopCondition(16)).tokens
    assert seen["state"] is True  # the round's view says the drafts run a compressed copy
    assert seen["passes"] > 0  # the drafts ran the compressed copy ...
    assert res.strategy_summary["drafter"]["draft_weights"] == fmt


def test_verification_and_plain_steps_never_run_the_compressed_copy(kernel_adapter):
    adapter = kernel_adapter
    d = _drafter("layer_skip", draft_weights="int8")
    dec = SpeculativeDecoder(
        adapter, StaticSelector(), FixedLength(FixedLengthConfig(k=3)), d, GreedyVerifier()
    )
    dec.prepare(prepare_context(adapter))
    with _counting_mlp(adapter.fused) as own:
        res = dec.generate(random_prompt(6, 128, 2), StopCondition(12))
    calls = {"own": own[0]}
    # the prefill (6 tokens) and every verification ran every block's own MLP; the drafts none
    assert res.drafted > 0
    assert calls["own"] == adapter.num_layers * (1 + len(res.accept_lengths))


def test_compressed_weights_fall_back_to_the_model_where_there_are_no_kernels(adapter):
    """A float64 model has no fused branches: drafts run the model's own weights, and the run says so."""
    d = _drafter("layer_skip", draft_weights="int8")
    notes: list[str] = []
    d.prepare(dataclasses.replace(prepare_context(adapter), log=notes.append))
    assert d.draft_weights() is None
    assert any("draft_weights=int8 needs the CPU kernels" in n for n in notes)
    assert d.summary()["draft_weights"] == "float32"


def test_early_exit_reuse_is_off_with_compressed_weights(kernel_adapter):
    d = _drafter("early_exit", draft_weights="int8", exit_layer=2)  # reuse_kv defaults to true
    dec = SpeculativeDecoder(
        kernel_adapter, StaticSelector(), FixedLength(FixedLengthConfig(k=3)), d, GreedyVerifier()
    )
    dec.prepare(prepare_context(kernel_adapter))
    prompt = random_prompt(6, 128, 3)
    res = dec.generate(prompt, StopCondition(16))
    assert res.tokens == VanillaDecoder(kernel_adapter).generate(prompt, StopCondition(16)).tokens
    assert res.drafted > 0 and res.strategy_summary["drafter"].get("verify_blocks_saved", 0) == 0


def test_the_cost_model_prices_drafts_with_the_weights(kernel_adapter):
    adapter = kernel_adapter
    d = _drafter("layer_skip", draft_weights="int8")
    ctx = prepare_context(adapter)
    d.prepare(ctx)
    own = ctx.cost_model()
    priced = dataclasses.replace(ctx, draft_weights=d.draft_weights()).cost_model()
    assert (own.draft_weights, priced.draft_weights) == ("float32", "int8")
    assert priced.verify_costs == own.verify_costs and priced.base == own.base
    assert priced.attn > 0 and priced.mlp > 0
    assert ctx.prepared.get(CostModel, ("", "int8")) is priced
    assert "(int8 weights)" in priced.describe()
