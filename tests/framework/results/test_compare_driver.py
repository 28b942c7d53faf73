"""The one comparison driver (`compare_methods`) and the one record format (`prompt_record`)."""

from __future__ import annotations

import pytest

from framework.data.prompts import Prompt
from framework.engine.decoding import PLAIN_ROUND, GenerationResult
from framework.results.compare import Method, compare_methods
from framework.results.records import OPTIONAL_FIELDS, prompt_record

PROMPTS = [Prompt(i, "qa", "qa", (f"question {i}",)) for i in range(4)]


def _result(tokens: list[int], wall: float = 0.5) -> GenerationResult:
    return GenerationResult(tokens, wall, "max_new_tokens", [PLAIN_ROUND] * (len(tokens) - 1), plain=True)


class Scripted:
    """A decoder whose tokens are given per prompt (``wrong``: prompts where it differs)."""

    def __init__(self, wrong: set[int] = frozenset()) -> None:
        self.wrong = wrong


def _decoder(calls: list[str]):
    def decode(m: Method, p: Prompt):
        calls.append(m.label)
        tokens = [1, 2, 3, 4]
        if p.question_id in m.decoder.wrong:
            tokens = [1, 2, 9, 4]
        return [(_result(tokens), "text")]

    return decode


def test_each_prompt_rotates_the_order_by_one_method():
    calls: list[str] = []
    methods = [Method("vanilla", Scripted()), Method("a", Scripted()), Method("b", Scripted())]
    out = list(compare_methods(methods, PROMPTS, _decoder(calls), start_turn=1))
    assert [c.order for c in out] == [
        ["a", "b", "vanilla"],
        ["b", "vanilla", "a"],
        ["vanilla", "a", "b"],
        ["a", "b", "vanilla"],
    ]
    assert calls == [label for c in out for label in c.order]  # decoded in that order
    assert [c.turn for c in out] == [1, 2, 3, 4]


def test_mismatches_are_checked_against_the_baseline_and_explained():
    explained = []

    def explain(prompt, base, got, where):
        explained.append((prompt.question_id, where))
        return {**where, "margin": 0.5}

    methods = [Method("vanilla", Scripted()), Method("bad", Scripted({1, 3})), Method("good", Scripted())]
    out = list(compare_methods(methods, PROMPTS, _decoder([]), explain=explain))
    assert [c.lossless("bad") for c in out] == [True, False, True, False]
    assert all(c.lossless("good") and c.lossless("vanilla") for c in out)
    assert explained == [(1, {"turn": 0, "position": 2}), (3, {"turn": 0, "position": 2})]
    rec = out[1].record("bad", repeat=0)
    assert rec["lossless"] is False and rec["first_mismatch"] == {"turn": 0, "position": 2, "margin": 0.5}
    assert rec["position"] == out[1].order.index("bad") and rec["repeat"] == 0


def test_a_sampling_method_is_not_checked_token_for_token():
    methods = [Method("vanilla", Scripted(), greedy=False), Method("s", Scripted({0, 1, 2, 3}), greedy=False)]
    out = list(compare_methods(methods, PROMPTS, _decoder([])))
    assert all(c.lossless("s") is None and c.mismatches == {} for c in out)


def test_the_baseline_may_be_named_and_must_decode():
    methods = [Method("a", Scripted({0})), Method("vanilla", Scripted())]
    first = next(compare_methods(methods, PROMPTS, _decoder([]), baseline="vanilla"))
    assert first.lossless("a") is False and first.lossless("vanilla") is True
    with pytest.raises(ValueError, match="baseline 'nope'"):
        next(compare_methods(methods, PROMPTS, _decoder([]), baseline="nope"))

    def no_baseline(m, p):
        return None if m.label == "vanilla" else [(_result([1]), "")]

    with pytest.raises(RuntimeError, match="baseline 'vanilla' produced no result"):
        next(compare_methods(methods, PROMPTS, no_baseline, baseline="vanilla"))


def test_a_method_that_returns_nothing_is_left_out_of_that_prompt():
    methods = [Method("vanilla", Scripted()), Method("hf", Scripted())]

    def decode(m, p):
        return None if (m.label == "hf" and p.question_id == 2) else [(_result([1, 2]), "")]

    out = list(compare_methods(methods, PROMPTS, decode))
    assert [sorted(c.results) for c in out] == [["hf", "vanilla"]] * 2 + [["vanilla"]] + [["hf", "vanilla"]]
    assert [r["method"] for r in out[2].records()] == ["vanilla"]


def test_one_record_format_with_optional_fields():
    turns = [(_result([1, 2, 3], wall=0.5), "a"), (_result([4, 5], wall=0.25), "b")]
    rec = prompt_record(PROMPTS[0], "m", turns, True)
    assert (
        rec["new_tokens"] == 5 and rec["wall_time"] == 0.75 and rec["tokens_per_s"] == pytest.approx(5 / 0.75)
    )
    assert [t["text"] for t in rec["turns"]] == ["a", "b"] and rec["accept_lengths"] == [1, 1, 1]
    assert not OPTIONAL_FIELDS & set(rec)  # only what the writer asks for
    full = prompt_record(
        PROMPTS[0], "m", turns, True, repeat=1, position=0, kind="preset", rank=2, strategies={}
    )
    assert OPTIONAL_FIELDS <= set(full)
    with pytest.raises(ValueError, match="unknown record fields"):
        prompt_record(PROMPTS[0], "m", turns, True, speed=3)
