"""Logits processors and stopping criteria under speculation (`framework.engine.processing`,
issue 47, item 1): greedy output with transformers' processors equals HF ``generate`` with the
same settings and our plain decoding with them, for registered combinations; each verify row is
processed with its own prefix; stopping criteria cut where ``generate`` stops."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("name", ["repetition", "ngram", "min_new"])
def test_speculative_decoding_with_processors_equals_plain_decoding_with_them(combo, name, deep_adapters):
    adapter = deep_adapters["llama"]
    dec = _spec(adapter, *combo)
    drafted = 0
    for seed in (0, 1, 2):
        prompt = random_prompt(9, 128, seed)
        prompt = torch.cat([prompt, prompt[:, :4], prompt], dim=1)  # something to copy for lookup
        want = VanillaDecoder(adapter).generate(prompt, _stop(SETTINGS[name])).tokens
        got = dec.generate(prompt, _stop(SETTINGS[name]))
        assert got.tokens == want, (combo, name, seed)
        drafted += got.drafted
    assert drafted > 0


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
