"""Grammars under speculation (`framework.engine.grammar`, issue 47, items 2-3): the matcher
follows each row's prefix and rolls back; greedy output with a grammar equals HF ``generate`` with
the same engine's mask and our plain constrained decoding, for registered combinations and the
grammar-forced drafter composed with the others; forced tokens are drafted and still verified;
bad grammars get one line."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder  # noqa: E402
from framework.engine.grammar import CompiledGrammar, Grammar, GrammarError, GrammarProcessor  # noqa: E402
from framework.engine.processing import GenerationControls  # noqa: E402
from framework.testing import (  # noqa: E402
    default_strategy_instance,
    prepare_context,
    random_prompt,
    tiny_json_tokenizer,
)
from framework.testing.contracts import CONTRACT_SCHEMA  # noqa: E402
from strategies.drafters.grammar_forced import GrammarForcedDrafter, GrammarForcedDrafterConfig  # noqa: E402

N = 40
EOS = (2,)
SCHEMA = CONTRACT_SCHEMA  # color, size, ok: keys and punctuation the grammar forces


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_json_tokenizer()


@pytest.fixture(scope="module")
def compiled(tokenizer):
    return CompiledGrammar(Grammar.json_schema(SCHEMA), tokenizer, 128)


def _stop(compiled):
    return StopCondition(
        N, eos_token_ids=EOS, controls=GenerationControls(eos_token_ids=EOS, grammar=compiled)
    )


def _hf(model, prompt, compiled):
    """HF ``generate`` (greedy) with a logits processor applying the same engine's mask."""
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=N,
            pad_token_id=0,
            eos_token_id=list(EOS),
            logits_processor=[GrammarProcessor(compiled.start(prompt.shape[1]))],
        )
    new = out[0, prompt.shape[1] :].tolist()
    return new[: new.index(EOS[0]) + 1] if EOS[0] in new else new


def _json(tokenizer, tokens):
    return json.loads(tokenizer.decode([t for t in tokens if t not in EOS]))


def test_plain_constrained_decoding_equals_hf_generate_and_matches_the_schema(
    tiny_models, adapters, tokenizer, compiled
):
    model, adapter = tiny_models["llama"], adapters["llama"]
    for seed in (0, 1, 2):
        prompt = random_prompt(9, 128, seed)
        got = VanillaDecoder(adapter).generate(prompt, _stop(compiled))
        assert got.tokens == _hf(model, prompt, compiled), seed
        value = _json(tokenizer, got.tokens)
        assert set(value) == {"color", "size", "ok"} and value["color"] in ("red", "green", "blue")


def _forced(then, **options):
    cfg = GrammarForcedDrafterConfig(then=then, then_config=options or None)
    return GrammarForcedDrafter(cfg)


def _spec(adapter, selector, length, drafter, verifier):
    parts = []
    for kind, name in (
        ("selector", selector),
        ("length", length),
        ("drafter", drafter),
        ("verifier", verifier),
    ):
        parts.append(name if not isinstance(name, str) else default_strategy_instance(kind, name, fast=True))
    dec = SpeculativeDecoder(adapter, *parts)
    dec.prepare(prepare_context(adapter))
    return dec


COMBOS = {
    "layer_skip": ("static", "fixed", "layer_skip", "greedy"),
    "tree": ("static", "confidence", "layer_skip", "tree"),
    "early_exit": ("del_tpl", "del_dynamic", "early_exit", "greedy"),
    "hybrid": ("static", "confidence", "hybrid", "greedy"),
    "forced_only": ("static", "fixed", lambda: _forced("none"), "greedy"),
    "forced+layer_skip": ("static", "fixed", lambda: _forced("layer_skip"), "greedy"),
    "forced+hybrid": ("static", "confidence", lambda: _forced("hybrid", skip_gate=True), "greedy"),
    "forced+cascade": ("static", "confidence", lambda: _forced("cascade"), "greedy"),
    "forced+prompt_lookup": ("static", "fixed", lambda: _forced("prompt_lookup"), "greedy"),
    "forced+early_exit": ("del_tpl", "del_dynamic", lambda: _forced("early_exit"), "greedy"),
    "forced+tree": ("static", "confidence", lambda: _forced("layer_skip"), "tree"),
}


@pytest.mark.parametrize("name", sorted(COMBOS))
def test_speculative_constrained_decoding_equals_plain_constrained_decoding(name, deep_adapters, compiled):
    adapter = deep_adapters["llama"]
    sel, length, drafter, verifier = COMBOS[name]
    dec = _spec(adapter, sel, length, drafter() if callable(drafter) else drafter, verifier)
    drafted = forced = 0
    for seed in (0, 1, 2):
        prompt = random_prompt(9, 128, seed)
        want = VanillaDecoder(adapter).generate(prompt, _stop(compiled)).tokens
        got = dec.generate(prompt, _stop(compiled))
        assert got.tokens == want, (name, seed)
        drafted += got.drafted
        forced += got.strategy_summary.get("drafter", {}).get("forced", 0)
    assert drafted > 0
    if name.startswith("forced"):
        assert forced > 0  # the grammar forced keys and separators, drafted without a forward


def test_forced_tokens_are_verified_and_accepted(deep_adapters, compiled):
    """Every forced token goes through verification (the verified tokens count them) and is
    accepted: the target's rows are masked by the same grammar."""
    adapter = deep_adapters["llama"]
    dec = _spec(adapter, "static", "fixed", _forced("none"), "greedy")
    res = dec.generate(random_prompt(9, 128, 0), _stop(compiled))
    s = res.strategy_summary["drafter"]
    assert s["forced"] > 0 and s["forced_accepted"] == s["forced"] and s["forced_refused"] == 0
    assert res.drafted == s["forced"] and res.verify_tokens == res.drafted + len(res.rounds)
    assert res.draft_forwards == 0  # forced runs cost no draft forward


def test_forced_runs_inside_a_draft_ride_along_with_the_next_draft_step(deep_adapters, compiled, tokenizer):
    """After a drafted token the grammar forces a run (the next key): it is inserted without a
    draft step of its own and verified; a verification never refuses a forced token first (its
    row allows nothing else; a run after a refused drafted token goes with it)."""
    from framework.testing import default_strategy_instance

    adapter = deep_adapters["llama"]
    fixed = default_strategy_instance("length", "fixed", fast=True)
    dec = _spec(adapter, "static", fixed, _forced("layer_skip"), "greedy")
    inserted = refused = 0
    for seed in (0, 1, 2, 3):
        prompt = random_prompt(9, 128, seed)
        res = dec.generate(prompt, _stop(compiled))
        assert res.tokens == VanillaDecoder(adapter).generate(prompt, _stop(compiled)).tokens
        s = res.strategy_summary["drafter"]
        inserted += s["inserted_runs"]
        refused += s["forced_refused"]
    assert inserted > 0 and refused == 0


def test_the_matcher_rolls_back_to_each_prefix_it_is_asked_about(compiled, tokenizer):
    """After a prefix that diverges from the held one, the mask is a fresh matcher's."""
    ids = tokenizer.encode('{"color": "red", "size": 12, "ok": true}')
    state = compiled.start(0)
    for i in range(len(ids) + 1):
        assert state.allowed(ids[:i]) is not None
    assert state.counts["rollbacks"] == 0
    other = tokenizer.encode('{"color": "blue", "size": 3')
    for prefix in (ids[:5], other, ids[:3], ids):
        fresh = compiled.start(0)
        assert torch.equal(state.allowed(prefix), fresh.allowed(prefix)), prefix
        assert state.forced(prefix, 8) == fresh.forced(prefix, 8)
    assert state.counts["rollbacks"] >= 2


def test_a_prefix_the_grammar_refuses_leaves_its_row_unmasked(compiled, tokenizer):
    bad = tokenizer.encode('{"colour"')
    state = compiled.start(0)
    assert state.allowed(bad) is None
    scores = torch.zeros(1, 128)
    GrammarProcessor(state)(torch.tensor([bad]), scores)
    assert torch.isfinite(scores).all()


def test_bad_grammars_get_one_line_naming_the_flag(tokenizer):
    cases = [
        (Grammar.json_schema({"type": "objectx"}), "--json-schema: does not compile"),
        (Grammar.regex("[a-"), "--regex: does not compile"),
        (Grammar.lark("start: foo"), "--grammar: does not compile"),
        (Grammar.regex("\u4e00+"), "--regex: no token of this tokenizer can start"),
    ]
    for grammar, message in cases:
        with pytest.raises(GrammarError, match=message) as err:
            CompiledGrammar(grammar, tokenizer, 128)
        assert "\n" not in str(err.value)
    with pytest.raises(GrammarError, match="--json-schema: not JSON"):
        Grammar("json_schema", "{not json")


def test_regex_and_lark_grammars_constrain_plain_and_speculative_decoding_alike(deep_adapters, tokenizer):
    adapter = deep_adapters["llama"]
    for grammar in (
        Grammar.regex(r"[a-c]{3}-[0-9]{2,4}"),
        Grammar.lark('start: "ab" ("," NUM)+\nNUM: /[0-9]/'),
    ):
        compiled = CompiledGrammar(grammar, tokenizer, 128)
        dec = _spec(adapter, "static", "fixed", _forced("layer_skip"), "greedy")
        prompt = random_prompt(9, 128, 4)
        want = VanillaDecoder(adapter).generate(prompt, _stop(compiled)).tokens
        assert dec.generate(prompt, _stop(compiled)).tokens == want
        text = tokenizer.decode([t for t in want if t not in EOS])
        if grammar.kind == "regex":
            import re

            assert re.fullmatch(r"[a-c]{3}-[0-9]{2,4}", text), text


def test_the_forced_drafter_refuses_bad_options_with_their_names():
    from framework.config_fields import ConfigError

    with pytest.raises(ConfigError, match="then must be 'none' or a registered drafter"):
        GrammarForcedDrafterConfig(then="nope")
    with pytest.raises(ValueError, match="skip_gate"):
        GrammarForcedDrafterConfig(then="cascade", then_config={"skip_gate": False})
    with pytest.raises(ConfigError, match="then_config.nope"):
        GrammarForcedDrafterConfig(then="hybrid", then_config="{nope: 1}")
    with pytest.raises(ConfigError, match="then must be another drafter"):
        GrammarForcedDrafterConfig(then="grammar_forced")


def test_with_the_target_as_its_own_draft_every_drafted_token_is_accepted(deep_adapters, compiled):
    """A plan that skips nothing drafts the target's own tokens: every round's draft is accepted
    whole (the forced runs inside it fed in their places, so the steps after them see them)."""
    from strategies.selectors.static import StaticSelector, StaticSelectorConfig

    adapter = deep_adapters["llama"]
    whole = StaticSelector(StaticSelectorConfig(skip_ratio=0.0))
    fixed = default_strategy_instance("length", "fixed", fast=True)
    dec = _spec(adapter, whole, fixed, _forced("layer_skip"), "greedy")
    inserted = 0
    for seed in (0, 1, 2):
        res = dec.generate(random_prompt(9, 128, seed), _stop(compiled))
        assert res.accepted == res.drafted, seed
        inserted += res.strategy_summary["drafter"]["inserted_runs"]
    assert inserted > 0
