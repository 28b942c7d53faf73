"""Synthetic acceptance (`framework.engine.synthetic`, issue 47, item 5): each draft token is
accepted with probability P from a seeded stream whatever the target says; the KV cache stays
consistent; the output is marked everywhere, never checked for equality and never written as a
Spec-Bench answer file."""

from __future__ import annotations

import pytest
import torch

from framework.benchmark.report import results_markdown, summarize
from framework.config_fields import ConfigError
from framework.data.prompts import Prompt
from framework.data.specbench import AnswerFileError, write_answer_files
from framework.engine.decoding import SpeculativeDecoder, StopCondition, VanillaDecoder
from framework.engine.synthetic import SyntheticAcceptance, synthetic_label
from framework.results.compare import Method, compare_methods
from framework.session.run_config import RunConfig
from framework.testing import default_strategy_instance, prepare_context, random_prompt


def _decoder(adapter, p, seed=0, length="fixed"):
    parts = [
        default_strategy_instance(kind, name, fast=True)
        for kind, name in (
            ("selector", "static"),
            ("length", length),
            ("drafter", "layer_skip"),
            ("verifier", "greedy"),
        )
    ]
    dec = SpeculativeDecoder(adapter, *parts, synthetic=SyntheticAcceptance(p, seed))
    dec.prepare(prepare_context(adapter))
    return dec


def test_the_stream_accepts_at_the_forced_rate():
    s = SyntheticAcceptance(0.3, seed=1)
    firsts = [s.accepted(1) for _ in range(4000)]
    assert abs(sum(firsts) / len(firsts) - 0.3) < 0.03
    assert SyntheticAcceptance(0.0).accepted(8) == 0 and SyntheticAcceptance(1.0).accepted(8) == 8
    a, b = SyntheticAcceptance(0.5, seed=7), SyntheticAcceptance(0.5, seed=7)
    assert [a.accepted(4) for _ in range(50)] == [b.accepted(4) for _ in range(50)]
    with pytest.raises(ValueError, match="probability in"):
        SyntheticAcceptance(1.5)


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_extremes_accept_nothing_or_everything(p, deep_adapters):
    res = _decoder(deep_adapters["llama"], p).generate(random_prompt(9, 128, 0), StopCondition(32))
    assert res.synthetic == p and res.drafted > 0
    assert res.accepted == (res.drafted if p == 1.0 else 0)


def test_each_round_ends_with_the_targets_token_after_what_it_committed(deep_adapters):
    """Over-accepting draft tokens the target refused keeps the KV consistent: the last token of
    every round is the argmax of a fresh full forward over the committed sequence before it."""
    adapter = deep_adapters["llama"]
    prompt = random_prompt(9, 128, 3)
    res = _decoder(adapter, 0.8, seed=3).generate(prompt, StopCondition(40))
    plain = VanillaDecoder(adapter).generate(prompt, StopCondition(40)).tokens
    assert res.tokens != plain  # the forced rate accepted tokens the target refused
    seq = torch.cat([prompt, torch.tensor([res.tokens])], dim=1)
    with torch.inference_mode():
        argmax = adapter.arch.model(seq).logits[0].argmax(-1).tolist()
    p, at = prompt.shape[1], 1  # the prefill's token is the target's
    assert res.tokens[0] == argmax[p - 1]
    for r in res.rounds:
        at += r.accepted + 1
        if at <= len(res.tokens):
            assert res.tokens[at - 1] == argmax[p + at - 2], at


def _records(adapter, prompt_ids):
    prompt = Prompt("q1", "qa", "qa", ("w1",))
    spec = _decoder(adapter, 0.5)
    methods = [Method("vanilla", VanillaDecoder(adapter), "baseline"), Method("m@synthetic-0.5", spec)]
    cmp = next(
        compare_methods(
            methods, [prompt], lambda m, _: [(m.decoder.generate(prompt_ids, StopCondition(24)), "")]
        )
    )
    return cmp.records()


def test_records_are_marked_and_never_checked_for_equality(deep_adapters):
    recs = _records(deep_adapters["llama"], random_prompt(9, 128, 5))
    base, synth = recs
    assert "synthetic_acceptance" not in base and synth["synthetic_acceptance"] == 0.5
    assert synth["lossless"] is None and synth["first_mismatch"] is None
    summary = summarize([dict(r, repeat=0) for r in recs], [r["method"] for r in recs])
    assert summary["methods"][synth["method"]]["synthetic"] == 0.5
    assert "n/a (synthetic)" in results_markdown(summary)  # never counted as lossless or not


def test_synthetic_records_are_never_written_as_answer_files(deep_adapters, tmp_path):
    recs = _records(deep_adapters["llama"], random_prompt(9, 128, 6))
    with pytest.raises(AnswerFileError, match="synthetic acceptance"):
        write_answer_files(recs, tmp_path / "answers")
    assert not (tmp_path / "answers").exists()


def test_the_config_marks_the_label_and_refuses_what_it_cannot_do(tmp_path):
    cfg = RunConfig.from_preset("static_confidence", synthetic_acceptance=0.2)
    assert cfg.method.label == "static_confidence@synthetic-0.2" == synthetic_label("static_confidence", 0.2)
    with pytest.raises(ConfigError, match="--specbench-answers must be off with --synthetic-acceptance"):
        RunConfig.from_preset("static_confidence", synthetic_acceptance=0.2, specbench_answers=str(tmp_path))
    with pytest.raises(ConfigError, match="chain verifier"):
        RunConfig.from_preset("swift", synthetic_acceptance=0.5)
    with pytest.raises(ConfigError, match="--synthetic-acceptance"):
        RunConfig.from_preset("static_confidence", synthetic_acceptance=1.5)


def test_the_benchmark_report_marks_a_synthetic_method_and_counts_no_mismatch(deep_adapters):
    from framework.benchmark.report import _notes, results_markdown, summarize

    recs = _records(deep_adapters["llama"], random_prompt(9, 128, 7))
    for r in recs:
        r["kind"] = "baseline" if r["method"] == "vanilla" else "preset"
        r["repeat"] = 0
    summary = summarize(recs, ["vanilla", "m@synthetic-0.5"])
    entry = summary["methods"]["m@synthetic-0.5"]
    assert entry["mismatches"] == 0 and entry["synthetic"] == 0.5
    assert "n/a (synthetic)" in results_markdown(summary)
    assert any("NOT the model's" in n for n in _notes(summary))
