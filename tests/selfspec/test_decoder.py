"""selfspec.Decoder: the Python API over presets, strategy names/classes/instances and loaded models."""

from __future__ import annotations

import pytest
import torch

import selfspec
from framework import ConfigError, LayerPlan, LayerSelector
from framework.testing import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", num_layers=4, seed=3), tiny_tokenizer()


PROMPT = "w5 w9 w13 w2 w7"


def quiet(**kw):
    return dict(log=None, **kw)


def test_from_preset_generates_exactly_the_vanilla_tokens(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset(
        "static_confidence", model=model, tokenizer=tok, max_new_tokens=24, **quiet()
    )
    out = dec.generate(PROMPT)
    van = dec.generate_vanilla(PROMPT)
    assert out.tokens == van.tokens and len(out.tokens) > 0
    assert out.text == van.text
    s = out.stats
    assert s.new_tokens == len(out.tokens)
    assert s.rounds == len(s.accept_lengths) == len(s.draft_lengths)
    assert sum(s.accept_lengths) == s.new_tokens - 1  # the prefill's token is not a round's
    assert 0.0 <= s.acceptance_rate <= 1.0 and s.mean_accepted_length >= 1.0
    assert all(isinstance(p, LayerPlan) and p.num_layers == 4 for p in s.plans)
    assert len(s.plans) == sum(1 for k in s.draft_lengths if k)
    assert {"prefill", "draft", "verify"} <= set(s.phase_times)
    assert dec.method.label == "static_confidence"


def test_the_vanilla_preset_decodes_plainly(model_and_tokenizer):
    """Issue 39, item 2: ``from_preset("vanilla")`` decodes as run.py and bench.py decode the
    ``vanilla`` preset, with the baseline alone (it drafted in 7 of 8 rounds before)."""
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset("vanilla", model=model, tokenizer=tok, max_new_tokens=16, **quiet())
    out = dec.generate(PROMPT)
    assert out.tokens == dec.generate_vanilla(PROMPT).tokens and len(out.tokens) == 16
    s = out.stats
    assert s.drafted == 0 and not any(s.draft_lengths) and s.mean_accepted_length == 1.0 and not s.plans
    assert dec.method.baseline_only and dec.method.label == "vanilla" and dec.strategies == {}
    assert "vanilla: plain decoding" in repr(dec)
    cmp = dec.compare(PROMPT, 8, warmup=False)
    assert cmp.lossless and cmp.method.stats.drafted == 0


def test_a_preset_means_the_same_in_run_bench_and_the_decoder(capsys):
    """Issue 39, item 2: every shipped preset resolves to one method section whether run.py
    (``--method NAME``), bench.py (``--methods NAME``) or ``Decoder.from_preset(NAME)`` reads it,
    and the baseline-only preset is the vanilla baseline in all three."""
    import dataclasses
    import json

    import yaml

    from framework.runner.cli import main
    from framework.session.methods import method_section, parse_methods
    from framework.session.presets import list_presets
    from framework.session.run_config import RunConfig

    for name in list_presets():
        method = RunConfig.from_preset(name).method  # what Decoder.from_preset builds on
        assert main(["--method", name, "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)["method"]
        assert printed["name"] == name and printed["baseline_only"] == method.baseline_only
        for kind in ("selector", "length", "drafter", "verifier"):
            spec = getattr(method, kind)
            want = json.loads(json.dumps({"name": spec.name, **dataclasses.asdict(spec.config)}))
            assert printed[kind] == want, (name, kind)  # (the printed YAML has lists for tuples)
        assert printed["gate"] == json.loads(json.dumps(dataclasses.asdict(method.gate))), name
        (bench,) = [s for s in parse_methods([name, "hf_generate"]) if s.label == name]
        if method.baseline_only:
            assert bench.kind == "baseline"  # bench.py's own vanilla row
        else:
            assert bench.kind == "preset" and method_section(bench.source) == method, name


def test_overrides_reach_the_strategies(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset(
        "swift", model=model, tokenizer=tok, **{"length.threshold": 0.7, "gate.enabled": False}, **quiet()
    )
    assert dec.method.length.config.threshold == 0.7
    assert dec.strategies["length"].config.threshold == 0.7
    with pytest.raises(ConfigError, match=r"^length\.threshold must be"):  # Python names, not flags
        selfspec.Decoder.from_preset(
            "swift", model=model, tokenizer=tok, **{"length.threshold": 1.5}, **quiet()
        )


class EveryOtherMlp(LayerSelector):
    """An unregistered researcher's selector: skip the MLP of every other block."""

    def __init__(self) -> None:
        super().__init__(config=object())
        self.calls = 0

    def plan(self, state):
        self.calls += 1
        n = state.info.num_layers
        return LayerPlan.from_indices(n, mlp=range(1, n, 2))


def test_from_strategies_takes_names_and_instances(model_and_tokenizer):
    model, tok = model_and_tokenizer
    mine = EveryOtherMlp()
    dec = selfspec.Decoder.from_strategies(
        selector=mine, length="fixed", model=model, tokenizer=tok, **{"length.k": 3}, **quiet()
    )
    assert dec.strategies["selector"] is mine
    assert dec.strategies["length"].config.k == 3
    cmp = dec.compare(PROMPT, max_new_tokens=16)
    assert mine.calls > 0
    assert cmp.lossless is True and cmp.first_mismatch is None
    assert cmp.method.tokens == cmp.vanilla.tokens
    assert cmp.speedup > 0 and cmp.repeats == 1
    assert all(p.mlp_skip == (False, True, False, True) for p in cmp.method.stats.plans)
    assert "speedup" in str(cmp)


def test_prompts_as_chat_and_as_ids(model_and_tokenizer):
    model, tok = model_and_tokenizer
    dec = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, **quiet())
    ids = dec.encode(PROMPT)
    assert torch.equal(dec.encode([{"role": "user", "content": PROMPT}]), ids)
    assert (
        dec.generate(ids[0].tolist(), max_new_tokens=8).tokens
        == dec.generate(PROMPT, max_new_tokens=8).tokens
    )


def test_bad_input_is_named(model_and_tokenizer):
    model, tok = model_and_tokenizer
    with pytest.raises(ValueError, match="both hf_model and tokenizer"):
        selfspec.Decoder.from_preset("swift", model=model, **quiet())
    # a decoder takes the model, method and generation sections only
    for key, section in (
        ("logger", "runner"),
        ("resume", "runner"),
        ("limit", "data"),
        ("num_nodes", "runner"),
    ):
        with pytest.raises(ConfigError, match=f"it is the {section} section's option"):
            selfspec.Decoder.from_preset("swift", model="tiny-random", **{key: "x"}, **quiet())
    with pytest.raises(ConfigError, match="it is no option"):
        selfspec.Decoder.from_preset("swift", model="tiny-random", sampler=1, **quiet())
    dec = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, **quiet())
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate("  ")
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        dec.compare(PROMPT, repeats=0)


def test_named_model_loads_offline():
    dec = selfspec.Decoder.from_preset("static_confidence", model="tiny-random", max_new_tokens=8, **quiet())
    out = dec.generate(PROMPT)
    assert out.tokens == dec.generate_vanilla(PROMPT).tokens


# ---- a generate-shaped API (issue 29) ------------------------------------------------------------


@pytest.fixture(scope="module")
def dec(model_and_tokenizer):
    model, tok = model_and_tokenizer
    return selfspec.Decoder.from_preset(
        "static_confidence", model=model, tokenizer=tok, max_new_tokens=12, **quiet()
    )


def test_a_list_of_prompts_is_decoded_one_after_another_in_order(dec):
    prompts = [PROMPT, "w3 w4", [{"role": "user", "content": "w8 w9 w10"}]]
    outs = dec.generate(prompts, max_new_tokens=6)
    assert isinstance(outs, list) and len(outs) == 3
    assert [o.tokens for o in outs] == [dec.generate(p, max_new_tokens=6).tokens for p in prompts]
    ids = [dec.encode(p)[0].tolist() for p in ("w1 w2", "w5 w6")]
    assert [o.tokens for o in dec.generate(ids, max_new_tokens=4)] == [
        dec.generate(i, max_new_tokens=4).tokens for i in ids
    ]


def test_a_list_of_prompts_decodes_in_batches_with_each_prompts_own_tokens(dec):
    prompts = [PROMPT, "w3 w4", [{"role": "user", "content": "w8 w9 w10"}], "w5 w6 w7"]
    alone = [dec.generate(p, max_new_tokens=6).tokens for p in prompts]
    for size in (2, 3):
        outs = dec.generate(prompts, max_new_tokens=6, batch_size=size, repetition_penalty=1.2)
        assert [o.tokens for o in outs] == [
            dec.generate(p, max_new_tokens=6, repetition_penalty=1.2).tokens for p in prompts
        ]
    assert [o.tokens for o in dec.generate(prompts, max_new_tokens=6, batch_size=4)] == alone
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            dec.generate(prompts, batch_size=bad)


def test_max_new_tokens_is_validated_like_a_python_argument(dec):
    assert len(dec.generate(PROMPT, max_new_tokens=1).tokens) == 1  # not silently the default
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        dec.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(TypeError, match="max_new_tokens must be an int, got float 2.5"):
        dec.generate(PROMPT, max_new_tokens=2.5)
    with pytest.raises(TypeError, match="do_sample must be True, False or None"):
        dec.generate(PROMPT, do_sample="yes")
    with pytest.raises(ValueError, match="top_p must be > 0 and <= 1"):
        dec.generate(PROMPT, do_sample=True, top_p=1.5)
    with pytest.raises(ValueError, match="temperature=0.7: sampling settings need do_sample=True"):
        dec.generate(PROMPT, temperature=0.7, do_sample=False)


def test_sampling_arguments_switch_to_speculative_sampling_and_back(dec):
    sampled = dec.generate(PROMPT, do_sample=True, temperature=0.8, top_k=20, seed=3)
    v = dec.strategies["verifier"]
    assert v.name == "sampling" and (v.config.temperature, v.config.top_k, v.config.seed) == (0.8, 20, 3)
    again = dec.generate(PROMPT, do_sample=True, temperature=0.8, top_k=20, seed=3)
    assert len(sampled.tokens) > 0 and again.stats.new_tokens > 0
    assert again.tokens == sampled.tokens  # the same seed: the same tokens (issue 39, item 6)
    others = [dec.generate(PROMPT, do_sample=True, temperature=0.8, top_k=20, seed=s).tokens for s in (4, 5)]
    assert any(o != sampled.tokens for o in others)  # other seeds: other samples
    unseeded = [dec.generate(PROMPT, do_sample=True, temperature=0.8, top_k=20).tokens for _ in range(2)]
    assert unseeded[0] != unseeded[1]  # no seed: the sampler's stream goes on
    greedy = dec.generate(PROMPT)  # no sampling arguments: as configured (greedy) again
    assert dec.strategies["verifier"].name == "greedy"
    assert greedy.tokens == dec.generate_vanilla(PROMPT).tokens


def test_a_tree_verifier_refuses_sampling_with_the_reason(model_and_tokenizer):
    model, tok = model_and_tokenizer
    swift = selfspec.Decoder.from_preset("swift", model=model, tokenizer=tok, max_new_tokens=8, **quiet())
    with pytest.raises(ValueError, match="verifies a token tree greedily"):
        swift.generate(PROMPT, do_sample=True)


def test_a_transformers_generation_config_applies_and_what_it_cannot_do_is_refused(dec):
    from transformers import GenerationConfig

    out = dec.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=5))
    assert len(out.tokens) == 5 and dec.strategies["verifier"].name == "greedy"
    assert len(dec.generate(PROMPT, 3, generation_config=GenerationConfig(max_new_tokens=5)).tokens) == 3
    dec.generate(
        PROMPT,
        generation_config=GenerationConfig(max_new_tokens=4, do_sample=True, temperature=0.5, top_k=40),
    )
    v = dec.strategies["verifier"].config
    assert (v.temperature, v.top_k) == (0.5, 40)
    with pytest.raises(ValueError, match="generation_config.num_beams=4: not supported"):
        dec.generate(PROMPT, generation_config=GenerationConfig(num_beams=4))
    dec.generate(PROMPT, max_new_tokens=2)  # back to greedy for the other tests


def test_a_transformers_streamer_receives_the_prompt_then_every_committed_token(dec):
    from transformers import TextStreamer

    class Recorder(TextStreamer):
        def __init__(self, tokenizer):
            super().__init__(tokenizer, skip_prompt=True)
            self.puts: list[list[int]] = []
            self.ended = 0
            self.text = ""

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())
            super().put(value)

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

        def end(self):
            self.ended += 1
            super().end()

    rec = Recorder(dec.tokenizer)
    out = dec.generate(PROMPT, max_new_tokens=10, streamer=rec)
    assert rec.puts[0] == dec.encode(PROMPT)[0].tolist()  # the prompt first, as generate does
    assert sum(rec.puts[1:], []) == out.tokens and rec.ended == 1
    assert len(rec.puts) - 1 <= out.stats.rounds + 1  # one put per round (and the prefill's token)
    assert rec.text.strip() == dec.tokenizer.decode(out.tokens, skip_special_tokens=True).strip()
    with pytest.raises(ValueError, match="streaming takes one prompt at a time"):
        dec.generate([PROMPT, PROMPT], streamer=rec)


def test_generate_takes_transformers_processing_and_stopping_settings(dec, model_and_tokenizer):
    """Issue 47, item 1: the processors' settings, a LogitsProcessorList and a
    StoppingCriteriaList through the API; greedy output equals transformers' generate with them
    (the same processors, built with transformers' own classes)."""
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        StoppingCriteriaList,
        TemperatureLogitsWarper,
    )
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model, _ = model_and_tokenizer
    ids = dec.encode(PROMPT)
    settings = dict(
        repetition_penalty=1.7, no_repeat_ngram_size=2, suppress_tokens=[3], bad_words_ids=[[5, 6]]
    )
    got = dec.generate(PROMPT, 16, **settings)
    with torch.inference_mode():
        hf = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16, pad_token_id=0,
            eos_token_id=sorted(dec.experiment.eos), **settings,
        )  # fmt: skip
    want = hf[0, ids.shape[1] :].tolist()
    cut = next((i + 1 for i, t in enumerate(want) if t in dec.experiment.eos), len(want))
    assert got.tokens == want[:cut]
    assert dec.generate(PROMPT, 16, generation_config=GenerationConfig(**settings)).tokens == got.tokens
    plain = dec.generate(PROMPT, 16).tokens
    assert plain != got.tokens  # the settings changed something
    # a processor of one's own (a greedy argmax is unchanged by a temperature), and a criterion
    same = dec.generate(PROMPT, 16, logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)]))
    assert same.tokens == plain
    stopped = dec.generate(
        PROMPT, 16, stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(ids.shape[1] + 3)])
    )
    assert stopped.tokens == plain[:3] and stopped.stats.stop_reason == "stopping_criteria"
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        dec.generate(PROMPT, repetition_penalty=0.0)
    with pytest.raises(TypeError, match="no_repeat_ngram_size must be an int"):
        dec.generate(PROMPT, no_repeat_ngram_size=1.5)


def test_a_quiet_decoder_asks_its_preparations_for_no_progress_bar(model_and_tokenizer):
    """Issue 48, item 8: ``log=None`` is quiet: its preparation context says no progress bar
    (`PrepareView.progress`, which selfsd_bo's search bar follows); a decoder that logs keeps them."""
    model, tok = model_and_tokenizer
    quiet_dec = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, **quiet())
    loud = selfspec.Decoder.from_preset("static_confidence", model=model, tokenizer=tok, log=lambda m: None)
    assert quiet_dec.experiment.prepare_ctx.progress is False and loud.experiment.prepare_ctx.progress is True


def test_benchmark_runs_the_pipeline_of_run_and_bench_with_the_decoder_itself(dec, tmp_path):
    """Issue 48: the Python API's comparison on a prompt file is the one pipeline: the decoder's
    own method (its strategy objects) against vanilla, records and report in a folder."""
    res = dec.benchmark(
        methods=["hf_generate"],
        output=str(tmp_path / "b"),
        limit=1,
        categories="qa,rag",
        logger="none",
        plots=False,
    )
    recs = res["records"]
    assert sorted({r["method"] for r in recs}) == ["hf_generate", "static_confidence", "vanilla"]
    assert {r["kind"] for r in recs if r["method"] == "static_confidence"} == {"custom"}
    assert len(recs) == 6 and all(r["lossless"] for r in recs if r["method"] != "vanilla")
    assert (tmp_path / "b" / "records.jsonl").is_file() and (tmp_path / "b" / "bench.md").is_file()
    assert "static_confidence" in res["summary"]["methods"]
    with pytest.raises(ConfigError, match="--limit"):
        dec.benchmark(output=str(tmp_path / "c"), limit=0)


# ---- HF habits (issue 55, item 4) -----------------------------------------------------------------


def test_what_apply_chat_template_returns_is_a_prompt(dec):
    """transformers 5's ``apply_chat_template(..., add_generation_prompt=True)`` returns a
    ``BatchEncoding``; ``generate`` and ``compare`` take it, its text form (``tokenize=False``), a
    dict with ``input_ids`` (a row or a batch of one, list or tensor) and a padded batch."""
    tok = dec.tokenizer
    msgs = [{"role": "user", "content": PROMPT}]
    want = dec.generate(PROMPT, 8).tokens
    ids = dec.encode(PROMPT)[0].tolist()
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert enc["input_ids"] == ids or enc["input_ids"] == [ids]
    assert dec.generate(enc, 8).tokens == want
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str) and dec.encode(text)[0].tolist() == ids  # formatted once, not twice
    assert dec.generate(text, 8).tokens == want
    pt = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert dec.generate(pt, 8).tokens == want
    assert dec.generate({"input_ids": [ids]}, 8).tokens == want
    assert dec.generate({"input_ids": torch.tensor(ids)}, 8).tokens == want
    # a padded batch of two: each row without its padding, in order
    tok.pad_token = "<unk>"
    other = dec.encode("w3 w4")[0].tolist()
    padded = {
        "input_ids": [ids, [0] * (len(ids) - len(other)) + other],
        "attention_mask": [[1] * len(ids), [0] * (len(ids) - len(other)) + [1] * len(other)],
    }
    assert [g.tokens for g in dec.generate(padded, 6)] == [dec.generate(i, 6).tokens for i in (ids, other)]
    assert dec.compare(enc, 8, warmup=False).lossless
    with pytest.raises(ValueError, match="input_ids must be token ids"):
        dec.generate({"input_ids": "w1 w2"})


def test_compare_takes_generates_controls_and_a_grammar_and_checks_losslessness_under_them(
    model_and_tokenizer,
):
    """``compare(..., repetition_penalty=1.3, json_schema=...)`` applies both to vanilla decoding
    and to the method and runs its lossless check under them."""
    import json

    from framework.testing import tiny_json_tokenizer
    from framework.testing.contracts import CONTRACT_SCHEMA

    model, _ = model_and_tokenizer
    dec = selfspec.Decoder.from_preset(
        "static_confidence", model=model, tokenizer=tiny_json_tokenizer(), max_new_tokens=40, **quiet()
    )
    ids = dec.encode("w1")[0].tolist()
    plain = dec.compare(ids, 24, warmup=False)
    penalised = dec.compare(ids, 24, warmup=False, repetition_penalty=1.3)
    assert plain.lossless and penalised.lossless
    assert penalised.method.tokens == dec.generate(ids, 24, repetition_penalty=1.3).tokens
    assert penalised.method.tokens != plain.method.tokens  # the penalty reached both decodes
    both = dec.compare(ids, 40, repeats=2, repetition_penalty=1.3, json_schema=CONTRACT_SCHEMA)
    assert both.lossless and both.vanilla.tokens == both.method.tokens
    assert set(json.loads(both.method.text)) == {"color", "size", "ok"}
    with pytest.raises(TypeError, match="'repetition_penalty'"):
        dec.compare(ids, 4, repetition_penaltys=1.3)
    with pytest.raises(ValueError, match="repeats must be an integer >= 1"):
        dec.compare(ids, repeats=0)


def test_api_errors_name_the_python_argument_not_the_flag(dec, model_and_tokenizer):
    """The CLI names ``--json-schema``; the Python API names ``json_schema``."""
    from framework.engine.grammar import GrammarError
    from framework.testing import tiny_json_tokenizer

    model, _ = model_and_tokenizer
    json_dec = selfspec.Decoder.from_preset(
        "static_confidence", model=model, tokenizer=tiny_json_tokenizer(), max_new_tokens=8, **quiet()
    )
    with pytest.raises(GrammarError, match=r"^json_schema: not JSON \(Expecting value at line 2, column 8\)"):
        json_dec.generate([7, 8], 4, json_schema='{"a": 1,\n  "b": }')

    with pytest.raises(GrammarError, match=r"^json_schema: does not compile") as err:
        json_dec.generate([7, 8], 4, json_schema={"type": "no-such-type"})
    assert "--" not in str(err.value).split(":")[0]
    with pytest.raises(GrammarError, match=r"^regex: "):
        json_dec.generate([7, 8], 4, regex="(")
    with pytest.raises(ConfigError, match=r"^stop_strings must") as err:
        dec.generate(PROMPT, 4, stop_strings=[""])
    assert "--stop" not in str(err.value)
