"""Logits processors and stopping criteria under speculation (`framework.engine.processing`,
issue 47, item 1): greedy output with transformers' processors equals HF ``generate`` with the
same settings and our plain decoding with them, for registered combinations; each verify row is
processed with its own prefix; stopping criteria cut where ``generate`` stops."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor

from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.processing import GenerationControls, LogitsProcessing
from framework.engine.state import DecodeState
from framework.testing import default_strategy_instance, prepare_context, random_prompt

N = 24
SETTINGS = {
    "repetition": dict(repetition_penalty=1.8),
    "ngram": dict(no_repeat_ngram_size=2),
    "suppress": dict(suppress_tokens=(3, 5, 7), begin_suppress_tokens=(11,)),
    "bad_words": dict(bad_words_ids=((4,), (9, 10))),
    "min_new": dict(min_new_tokens=10),
}
EOS = (2,)


def _generate(model, prompt, **kwargs):
    """HF ``generate``'s greedy new tokens (N at most) for ``prompt``, with ``kwargs``."""
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),  # a prompt token 0 is not padding
            do_sample=False,
            max_new_tokens=N,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, prompt.shape[1] :].tolist()


def _hf(model, prompt, settings):
    hf_kwargs = {
        k: (list(map(list, v)) if k == "bad_words_ids" else list(v) if isinstance(v, tuple) else v)
        for k, v in settings.items()
    }
    new = _generate(model, prompt, eos_token_id=list(EOS), **hf_kwargs)
    return new[: new.index(EOS[0]) + 1] if EOS[0] in new else new


def _spec(adapter, selector="static", length="fixed", drafter="layer_skip", verifier="greedy"):
    parts = (
        default_strategy_instance(kind, name, fast=True)
        for kind, name in (
            ("selector", selector),
            ("length", length),
            ("drafter", drafter),
            ("verifier", verifier),
        )
    )
    dec = SpeculativeDecoder(adapter, *parts)
    dec.prepare(prepare_context(adapter))
    return dec


def _stop(settings):
    return StopCondition(N, eos_token_ids=EOS, controls=GenerationControls(eos_token_ids=EOS, **settings))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_plain_decoding_with_processors_equals_hf_generate(name, tiny_models, adapters):
    model, adapter = tiny_models["llama"], adapters["llama"]
    for seed in (0, 1):
        prompt = random_prompt(9, 128, seed)
        got = VanillaDecoder(adapter).generate(prompt, _stop(SETTINGS[name]))
        assert got.tokens == _hf(model, prompt, SETTINGS[name]), (name, seed)


COMBOS = [
    ("static", "fixed", "layer_skip", "greedy"),
    ("static", "confidence", "layer_skip", "tree"),
    ("del_tpl", "del_dynamic", "early_exit", "greedy"),  # early-exit reuse
    ("static", "fixed", "prompt_lookup", "greedy"),
    ("static", "confidence", "hybrid", "greedy"),
    ("swift", "confidence", "layer_skip", "tree"),
]


def _recording(adapter, seed):
    """A started generation whose processor records each row's prefix (``seen``), cleared after
    the prefill; and its committed tokens."""
    seen: list[list[int]] = []

    def record(input_ids, scores):
        seen.append(input_ids[0].tolist())
        return scores

    state = DecodeState(adapter, random_prompt(5, 128, seed), 32)
    state.processing = LogitsProcessing(record)
    state.append(state.prefill().argmax(-1)[:, None])
    seen.clear()
    return state, seen, state.tokens[0].tolist()


def test_each_verify_row_is_processed_with_its_own_prefix(llama_adapter):
    """Row j of a verified block [pending, d_1..d_K] sees the committed tokens and d_1..d_j."""
    state, seen, committed = _recording(llama_adapter, 0)
    state.forward_verify(torch.tensor([[committed[-1], 7, 8, 9]]))
    assert seen == [committed, committed + [7], committed + [7, 8], committed + [7, 8, 9]]


def test_a_stopping_criterion_cuts_where_generate_stops(tiny_models, adapters):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AfterToken(StoppingCriteria):
        def __init__(self, token: int) -> None:
            self.token = token

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == self.token

    model, adapter = tiny_models["llama"], adapters["llama"]
    prompt = random_prompt(9, 128, 3)
    plain = VanillaDecoder(adapter).generate(prompt, StopCondition(N)).tokens
    token = plain[5]
    criteria = StoppingCriteriaList([AfterToken(token)])
    want = _generate(model, prompt, eos_token_id=None, stopping_criteria=criteria)
    for dec in (VanillaDecoder(adapter), _spec(adapter)):
        got = dec.generate(prompt, StopCondition(N, criteria=criteria))
        assert got.tokens == want == plain[: plain.index(token) + 1]
        assert got.stop_reason == "stopping_criteria"


def test_controls_refuse_bad_settings_with_their_names():
    with pytest.raises(ValueError, match="repetition_penalty"):
        GenerationControls(repetition_penalty=0)
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        GenerationControls(no_repeat_ngram_size=-1)
    with pytest.raises(ValueError, match="min_new_tokens needs"):
        GenerationControls(min_new_tokens=3)
    assert not GenerationControls().active and GenerationControls(repetition_penalty=1.1).active


def test_each_draft_row_is_processed_with_the_tokens_drafted_before_it(llama_adapter):
    state, seen, committed = _recording(llama_adapter, 1)
    plan = state.prefix_plan(2)
    state.forward_draft(state.pending, plan)
    state.forward_draft(torch.tensor([[7]]), plan)
    state.forward_draft(torch.tensor([[8, 9]]), plan, logits_at="all")
    assert seen == [committed, committed + [7], committed + [7, 8], committed + [7, 8, 9]]


def test_a_criterion_is_checked_at_every_token_a_round_commits():
    from framework.engine.processing import stop_cut

    calls = []

    def at_length(input_ids, scores):
        calls.append(input_ids.shape[1])
        return torch.tensor([input_ids.shape[1] == 6])

    prompt = torch.tensor([[1, 2, 3]])
    assert stop_cut(at_length, prompt, [4, 5, 6, 7, 8], 0) == 3  # the third new token: 6 in all
    assert calls == [4, 5, 6]
    assert stop_cut(at_length, prompt, [4, 5, 6, 7, 8], 3) is None  # from the fourth on: none


# ---- under speculation, against HF generate (issue 54, class 2) --------------------------------
# Speculative and plain decoding share the code that hands a processor its prefix, so both can be
# wrong in the same way; only a comparison with HF ``generate`` running the same processors sees
# that: the prefix of the first new token (the whole prompt), the ``min_new_tokens`` boundary at
# an end-of-sequence token, and the prefix of every verify and draft row.
class PrefixWave(LogitsProcessor):
    """A processor that reads the whole prefix: it adds a wave over the vocabulary whose phase is
    set by every token of the prefix and its length, as large as the logits' spread, so a row
    processed with any other prefix (one token short, the prompt without its last token) is
    scored otherwise and most often chooses another token."""

    def __call__(self, input_ids, scores):
        phase = input_ids.double().sum(-1) * 0.11 + input_ids.shape[-1] * 1.3  # (B,)
        wave = torch.sin(torch.arange(scores.shape[-1], dtype=torch.float64) * 0.37 + phase[:, None])
        return scores + wave.to(scores.dtype)


HF_SETTINGS = {
    "repetition": dict(repetition_penalty=1.8),
    "ngram": dict(no_repeat_ngram_size=2),
    "min_new": dict(min_new_tokens=10),
    "prefix": dict(processors=(PrefixWave(),)),
}


def _hf_with(model, prompt, settings, eos=EOS):
    """HF ``generate`` with ``settings`` (a custom processor through ``logits_processor``)."""
    from transformers import LogitsProcessorList

    settings = dict(settings)
    extra = settings.pop("processors", ())
    new = _generate(
        model, prompt, eos_token_id=list(eos), logits_processor=LogitsProcessorList(extra), **settings
    )
    return new[: new.index(eos[0]) + 1] if eos[0] in new else new


def _hf_model(adapter):
    return adapter.arch.model


@pytest.mark.parametrize("combo", [None, *COMBOS], ids=lambda c: "plain" if c is None else "-".join(c))
@pytest.mark.parametrize("name", sorted(HF_SETTINGS))
def test_speculative_decoding_with_processors_equals_hf_generate_with_them(combo, name, deep_adapters):
    """Plain and speculative decoding with processors, each against HF ``generate`` with the same
    processors (so speculative equals plain too): the registered drafters, early-exit reuse, trees
    and a selector that changes its plan."""
    adapter = deep_adapters["llama"]
    dec = VanillaDecoder(adapter) if combo is None else _spec(adapter, *combo)
    drafted = 0
    for seed in (0, 1):
        prompt = random_prompt(9, 128, seed)
        prompt = torch.cat([prompt, prompt[:, :4], prompt], dim=1)  # something to copy for lookup
        got = dec.generate(prompt, _stop(HF_SETTINGS[name]))
        assert got.tokens == _hf_with(_hf_model(adapter), prompt, HF_SETTINGS[name]), (combo, name, seed)
        drafted += got.drafted
    assert combo is None or drafted > 0


@pytest.mark.parametrize("combo", [None, *COMBOS[:3]], ids=lambda c: "plain" if c is None else "-".join(c))
def test_min_new_tokens_holds_an_eos_back_up_to_the_boundary_generate_keeps(combo, deep_adapters):
    """The end-of-sequence token is a token plain greedy decoding first gives at new position j:
    with ``min_new_tokens`` j - 1 or j it ends the output there, with j + 1 it is held back once
    (as ``generate`` holds it), whichever decoder."""
    adapter = deep_adapters["llama"]
    model = _hf_model(adapter)
    dec = VanillaDecoder(adapter) if combo is None else _spec(adapter, *combo)
    prompt = random_prompt(9, 128, 4)
    plain = VanillaDecoder(adapter).generate(prompt, StopCondition(N)).tokens
    j = next(i for i in range(3, N) if plain[i] not in plain[:i])
    eos = (plain[j],)
    lengths = []
    for min_new in (j - 1, j, j + 1):
        controls = GenerationControls(eos_token_ids=eos, min_new_tokens=min_new)
        got = dec.generate(prompt, StopCondition(N, eos_token_ids=eos, controls=controls)).tokens
        assert got == _hf_with(model, prompt, {"min_new_tokens": min_new}, eos), (combo, min_new)
        lengths.append(len(got))
    assert lengths[:2] == [j + 1, j + 1] and lengths[2] > j + 1  # the boundary is where generate has it


@pytest.mark.parametrize("head", [False, True], ids=["full-head", "reduced-head"])
@pytest.mark.parametrize("name", sorted(HF_SETTINGS))
def test_draft_rows_are_processed_so_the_target_as_its_own_draft_is_always_accepted(
    name, head, deep_adapters, tmp_path, monkeypatch
):
    """A draft that runs every sub-layer proposes the target's own token, provided its rows are
    processed as the verify rows are (with the tokens drafted before them, and through the reduced
    draft head's scores too): every drafted token is accepted. A draft row left unprocessed
    proposes the unprocessed argmax, and acceptance falls while the output stays lossless (so only
    acceptance shows it). The reduced head holds every token but one that no output here
    contains."""
    import json

    from framework import REGISTRIES
    from framework.config_fields import build_config
    from strategies.length.fixed import FixedLength, FixedLengthConfig
    from strategies.selectors.static import StaticSelector, StaticSelectorConfig
    from strategies.verifiers.greedy import GreedyVerifier

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    adapter = deep_adapters["llama"]
    prompts = [random_prompt(9, 128, seed) for seed in (0, 1)]
    wants = [_hf_with(_hf_model(adapter), p, HF_SETTINGS[name]) for p in prompts]
    vocab = adapter.arch.info().vocab_size
    options: dict = {}
    if head:
        seen = {t for p, w in zip(prompts, wants, strict=True) for t in (*p[0].tolist(), *w)}
        left_out = next(t for t in range(vocab) if t not in seen and t not in EOS)
        ranking = tmp_path / "ranking.json"
        ranking.write_text(json.dumps([t for t in range(vocab) if t != left_out]))
        options = {"draft_vocab": vocab - 1, "vocab_file": str(ranking)}
    entry = REGISTRIES["drafter"].entry("layer_skip")
    drafter = entry.cls(build_config(entry.config, options))
    dec = SpeculativeDecoder(
        adapter,
        StaticSelector(StaticSelectorConfig(skip_ratio=0.0)),
        FixedLength(FixedLengthConfig(k=3)),
        drafter,
        GreedyVerifier(),
    )
    dec.prepare(prepare_context(adapter))
    assert (drafter.draft_head() is not None) == head
    for prompt, want in zip(prompts, wants, strict=True):
        res = dec.generate(prompt, _stop(HF_SETTINGS[name]))
        assert res.tokens == want
        assert res.drafted > 0 and res.accepted == res.drafted, (name, head, res.accepted, res.drafted)
