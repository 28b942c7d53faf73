"""The experiment runner on a tiny random model: records, lossless check, incremental output."""

from __future__ import annotations

import json

import pytest

import strategies.selectors.selfsd_bo as selfsd
from framework.config_fields import ConfigError
from framework.data.prompts import load_prompts
from framework.drafting.gate import GatedLength
from framework.runner.pipeline import run
from framework.session.run_config import RunConfig
from framework.session.session import Session, build_decoder
from framework.testing import plain_table

VOCAB = 128


@pytest.fixture
def data(tmp_path):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w4", "w5 w6"]},
        {"question_id": 2, "category": "qa", "turns": ["w7 w8 w9"]},
        {"question_id": 3, "category": "qa", "turns": ["w10 w11 w12 w13 w14"]},
    ]
    p = tmp_path / "q.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def cfg_for(data, out, **kw):
    base = dict(
        data=str(data),
        output=str(out),
        max_new_tokens=10,
        warmup=1,
        logger="none",
    )
    if "selector" not in kw:  # the tests' method: static at 0.3, fixed k = 3
        base |= {"selector": "static", "selector.skip_ratio": 0.3}
    if "length" not in kw:
        base |= {"length": "fixed", "length.k": 3}
    base.update(kw)
    return RunConfig.of(**base)


def test_run_writes_one_line_per_prompt_and_method(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "r"
    result = run(cfg_for(data, out), log=lambda s: None, model=model, tokenizer=tok)
    lines = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [(r["question_id"], r["method"]) for r in lines] == [
        (1, "vanilla"),
        (1, "static+fixed"),
        (2, "vanilla"),
        (2, "static+fixed"),
        (3, "vanilla"),
        (3, "static+fixed"),
    ]
    for r in lines:
        assert r["category"] in ("mt_bench", "qa")
        assert len(r["turns"]) == (2 if r["question_id"] == 1 else 1)
        assert r["new_tokens"] == sum(len(t["tokens"]) for t in r["turns"])
        assert all(1 <= len(t["tokens"]) <= 10 for t in r["turns"])
        assert r["lossless"] is True
        assert r["wall_time"] > 0
        if r["method"] != "vanilla":
            assert sum(r["accept_lengths"]) >= r["new_tokens"] - len(
                r["turns"]
            )  # prefill token not in a round
            assert r["accepted"] <= r["drafted"]
            assert r["strategies"]["selector"]["config"]["skip_ratio"] == 0.3
    assert "| static+fixed |" in plain_table(result["table"]) and "| 0/3 |" in plain_table(result["table"])
    assert (out / "bench.md").read_text() == result["report"] and (out / "meta.json").exists()
    # The saved configuration reproduces the run (`run.py --config r/config.yaml`).
    assert RunConfig.load(out / "config.yaml").to_dict() == cfg_for(data, out).to_dict()


def test_gate_wraps_the_length_controller(tiny, data, tmp_path):
    model, tok = tiny
    cfg = cfg_for(data, tmp_path / "g.jsonl")
    exp = Session(cfg, model, tok)
    assert not isinstance(exp.spec.length, GatedLength)
    gated_cfg = cfg.replace(**{"gate.enabled": True, "gate.probe": 4})
    decoder = build_decoder(exp.adapter, gated_cfg)
    assert isinstance(decoder.length, GatedLength)
    res = run(
        gated_cfg.replace(output=str(tmp_path / "g.jsonl")), log=lambda s: None, model=model, tokenizer=tok
    )
    spec = [r for r in res["records"] if r["method"] != "vanilla"]
    assert spec and all(r["lossless"] for r in spec)


def test_second_turn_sees_the_first_answer(tiny, data, tmp_path):
    model, tok = tiny
    exp = Session(cfg_for(data, tmp_path / "x.jsonl"), model, tok)
    prompt = load_prompts(data)[0]
    (r1, t1), (r2, _) = exp.decode_prompt(exp.vanilla, prompt)
    assert r1.new_tokens >= 1 and r2.new_tokens >= 1
    assert t1 == exp.text(r1.tokens)


def test_interrupted_run_keeps_finished_prompts(tiny, data, tmp_path, monkeypatch):
    model, tok = tiny
    out = tmp_path / "r"
    calls = {"n": 0}
    real = Session.decode_prompt

    def flaky(self, decoder, prompt, max_new_tokens=None):
        if max_new_tokens is None and prompt.question_id == 2:
            calls["n"] += 1
            raise KeyboardInterrupt
        return real(self, decoder, prompt, max_new_tokens)

    monkeypatch.setattr(Session, "decode_prompt", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(cfg_for(data, out), log=lambda s: None, model=model, tokenizer=tok)
    lines = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [(r["question_id"], r["method"]) for r in lines] == [(1, "vanilla"), (1, "static+fixed")]


def test_a_second_run_into_the_same_file_is_refused_unless_it_resumes(tiny, data, tmp_path):
    """Appending a second run's records would make one table of two runs (each prompt counted
    twice); the file is refused without ``--resume`` and left as it was."""
    model, tok = tiny
    out = tmp_path / "r"
    run(cfg_for(data, out), log=lambda s: None, model=model, tokenizer=tok)
    before = (out / "records.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"--output must be a new or empty directory .*or --resume"):
        run(cfg_for(data, out), log=lambda s: None, model=model, tokenizer=tok)
    assert (out / "records.jsonl").read_text() == before
    res = run(cfg_for(data, out, resume=True), log=lambda s: None, model=model, tokenizer=tok)
    assert len(res["records"]) == len(before.splitlines()), "resuming a finished run decodes nothing more"


def test_bad_input_is_rejected_before_anything_is_written(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "never"
    too_long = tmp_path / "long.jsonl"
    too_long.write_text(
        json.dumps({"question_id": 9, "category": "qa", "turns": [" ".join(["w3"] * 300)]}) + "\n"
    )
    with pytest.raises(ConfigError, match="at most the model's context of 256 tokens"):
        run(cfg_for(too_long, out), log=lambda s: None, model=model, tokenizer=tok)
    with pytest.raises(ConfigError, match=r"--selector.skip_attn must be block indices in \[0, 3\]"):
        run(
            cfg_for(data, out, selector="static", **{"selector.skip_attn": (7,)}),
            log=lambda s: None,
            model=model,
            tokenizer=tok,
        )
    every = tuple(range(4))
    with pytest.raises(ConfigError, match="at least one sub-layer"):
        run(
            cfg_for(
                data,
                out,
                selector="static",
                **{"selector.skip_attn": every, "selector.skip_mlp": every},
            ),
            log=lambda s: None,
            model=model,
            tokenizer=tok,
        )
    with pytest.raises(ConfigError, match="--max-new-tokens must be an integer >= 1"):
        cfg_for(data, out, max_new_tokens=0)
    assert not out.exists()


def test_warmup_does_not_leak_carried_state(tiny, data, tmp_path, monkeypatch):
    """Strategies are rebuilt after warm-up: the measured run starts from fresh instances."""
    model, tok = tiny
    built = []
    real = Session.rebuild

    def spy(self):
        real(self)
        built.append(self.spec)

    monkeypatch.setattr(Session, "rebuild", spy)
    run(cfg_for(data, tmp_path / "w.jsonl", warmup=1), log=lambda s: None, model=model, tokenizer=tok)
    assert len(built) == 2 and built[0] is not built[1]


def test_baseline_only_runs_vanilla_alone(tiny, data, tmp_path):
    model, tok = tiny
    out = tmp_path / "v"
    result = run(cfg_for(data, out, baseline_only=True), log=lambda s: None, model=model, tokenizer=tok)
    lines = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    assert [r["method"] for r in lines] == ["vanilla"] * 3
    assert list(result["summary"]["methods"]) == ["vanilla"]
    assert "| vanilla | " in plain_table(result["table"]) and "n/a (baseline)" in result["table"]


def test_offline_search_runs_once_before_warmup_and_is_saved(tiny, data, tmp_path, monkeypatch):
    """selfsd_bo's search runs in prepare (before the warm-up), is reused by the fresh instances
    built after it, and its result lands next to the results file; --skip-set then skips it."""
    model, tok = tiny
    calls = []
    real = selfsd.search
    monkeypatch.setattr(selfsd, "search", lambda ctx, c: calls.append(ctx.artifact_stem) or real(ctx, c))
    fast = {"selector.iterations": 3, "selector.calib_limit": 2, "selector.calib_max_new_tokens": 6}
    out = tmp_path / "sd"
    res = run(
        cfg_for(data, out, selector="selfsd_bo", **fast),
        log=lambda s: None,
        model=model,
        tokenizer=tok,
    )
    assert len(calls) == 1 and str(calls[0]) == str(out / "selfsd_bo+fixed")  # the method's stem
    saved = out / "selfsd_bo+fixed.skipset.json"
    assert json.loads(saved.read_text())["bits"]
    spec = [r for r in res["records"] if r["method"] != "vanilla"]
    assert all(r["lossless"] for r in spec)
    assert spec[0]["turns"][0]["strategy_summary"]["selector"]["skip_set"] == str(saved)

    reuse = {"selector.skip_set": str(saved)}
    run(
        cfg_for(data, tmp_path / "again.jsonl", selector="selfsd_bo", **reuse),
        log=lambda s: None,
        model=model,
        tokenizer=tok,
    )
    assert len(calls) == 1, "a saved skip set must not be searched again"


def test_a_run_with_processors_is_lossless_and_they_change_the_output(tiny, data, tmp_path):
    """Issue 47: the generation section's processors (`--repetition-penalty`,
    `--no-repeat-ngram-size`, `--suppress-tokens`) apply to both decoders: the speculative output
    still equals the vanilla output with them, and it is not the output without them."""
    model, tok = tiny
    outs = {}
    for name, kw in (("plain", {}), ("processed", dict(repetition_penalty=1.8, no_repeat_ngram_size=2))):
        out = tmp_path / name
        run(cfg_for(data, out, max_new_tokens=16, **kw), log=lambda s: None, model=model, tokenizer=tok)
        lines = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
        assert all(r["lossless"] for r in lines)
        outs[name] = [t["tokens"] for r in lines if r["method"] == "vanilla" for t in r["turns"]]
    assert outs["plain"] != outs["processed"]
    cfg = RunConfig.from_preset(
        "static_confidence", **{"repetition_penalty": "1.3", "suppress_tokens": "3,5"}
    )
    assert cfg.generation.repetition_penalty == 1.3 and cfg.generation.suppress_tokens == (3, 5)
    with pytest.raises(ConfigError, match="--repetition-penalty"):
        RunConfig.of(repetition_penalty=0.0)
