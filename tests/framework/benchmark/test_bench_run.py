"""The benchmark's interleaved run (the one pipeline, framework/runner/pipeline.py, with several
methods) on a tiny random model: the table,
the ratio of means, mismatches, HF generate against our vanilla, the rotating method order,
incremental output and a failing HF method."""

from __future__ import annotations

import json
import statistics

import pytest

from framework.benchmark.hf import HFGenerateDecoder
from framework.config_fields import ConfigError
from framework.engine.adapter import adapter_for
from framework.engine.decoding import VanillaDecoder
from framework.models.loading import dtype_name
from framework.results.metrics import cost_model_prediction, rounds_prediction
from framework.runner.pipeline import run
from framework.session.methods import preset_run_config
from framework.session.methods import specs as methods_of
from framework.session.run_config import RunConfig
from framework.testing import plain_table, synthetic_cost_model

VOCAB = 128  # the tiny model of conftest.py
METHODS = ("vanilla", "hf_generate", "hf_prompt_lookup", "hf_early_exit", "static_confidence")


class Broken:
    """Vanilla decoding with the last token of every turn changed: a method that must mismatch."""

    def __init__(self, model):
        self.inner = VanillaDecoder(adapter_for(model))

    def generate(self, ids, stop):
        res = self.inner.generate(ids, stop)
        res.tokens[-1] = 5 + (res.tokens[-1] + 1) % (VOCAB - 5)
        return res


@pytest.fixture(scope="module")
def bench(tiny, data, tmp_path_factory):
    model, tok = tiny
    out = tmp_path_factory.mktemp("bench")
    cm = out.parent / "cost.json"
    cm.write_text(json.dumps({"cost_model": synthetic_cost_model(4).to_dict()}))
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=10,
        dtype="float64",
        methods=METHODS,
        repeats=2,
        output=str(out),
        cost_model=str(cm),
        command="python experiments/bench.py --test",
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None, custom={"broken": Broken(model)})
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return res, records, out


def test_table_has_every_method_and_category(bench):
    res, _, out = bench
    report = (out / "bench.md").read_text()
    assert report == res["report"]
    header = next(line for line in plain_table(report).splitlines() if line.startswith("| method | mt_bench"))
    assert header.startswith("| method | mt_bench | qa | rag | **overall** | spread")
    for m in (*METHODS, "broken"):
        assert any(line.startswith(f"| {m} | ") for line in plain_table(report).splitlines()), m
    assert "command: `python experiments/bench.py --test`" in report
    assert "torch threads" in report and "transformers" in report
    for png in ("speedup_by_category.png", "accept_lengths.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_speedup_is_the_ratio_of_means_averaged_over_repeats(bench):
    res, records, _ = bench
    by_rep = {}
    for rep in (0, 1):
        rs = [r for r in records if r["repeat"] == rep]

        def mean_tps(method, cat, rs=rs):
            vals = [
                r["new_tokens"] / r["wall_time"]
                for r in rs
                if r["method"] == method and (cat == "overall" or r["category"] == cat)
            ]
            return sum(vals) / len(vals)

        by_rep[rep] = {
            cat: mean_tps("static_confidence", cat) / mean_tps("vanilla", cat)
            for cat in ("mt_bench", "qa", "rag", "overall")
        }
    entry = res["summary"]["methods"]["static_confidence"]
    for cat in ("mt_bench", "qa", "rag", "overall"):
        want = (by_rep[0][cat] + by_rep[1][cat]) / 2
        assert entry["speedup"][cat] == pytest.approx(want, rel=1e-12)
    overall = [by_rep[0]["overall"], by_rep[1]["overall"]]
    assert entry["std"] == pytest.approx(statistics.stdev(overall))
    assert entry["min"] == pytest.approx(min(overall)) and entry["max"] == pytest.approx(max(overall))
    row = next(
        line for line in plain_table(res["report"]).splitlines() if line.startswith("| static_confidence |")
    )
    assert f"**{entry['speedup']['overall']:.3f}x**" in row
    assert f"± {entry['std']:.3f} ({entry['min']:.3f}-{entry['max']:.3f})" in row


def test_mismatches_are_counted(bench):
    res, records, _ = bench
    methods = res["summary"]["methods"]
    assert methods["broken"]["mismatches"] == 4
    assert all(not r["lossless"] for r in records if r["method"] == "broken")
    assert "| 4/4 |" in next(
        line for line in plain_table(res["report"]).splitlines() if line.startswith("| broken |")
    )
    # float64 tiny model: our speculative decoding and HF's generate agree with vanilla exactly
    for m in METHODS[1:]:
        assert methods[m]["mismatches"] == 0, m
    assert "broken: 4 prompt(s) differ from vanilla" in res["report"]


def test_hf_generate_greedy_equals_our_vanilla(bench, tiny):
    _, records, _ = bench
    van = {(r["repeat"], r["question_id"]): r for r in records if r["method"] == "vanilla"}
    hf = [r for r in records if r["method"] == "hf_generate"]
    assert len(hf) == 8
    for r in hf:
        want = van[(r["repeat"], r["question_id"])]
        assert [t["tokens"] for t in r["turns"]] == [t["tokens"] for t in want["turns"]]
        assert [t["stop_reason"] for t in r["turns"]] == [t["stop_reason"] for t in want["turns"]]
    # The assisted methods count the prefill's token outside the rounds, as our decoders do.
    for r in records:
        if r["method"] in ("hf_prompt_lookup", "hf_early_exit", "static_confidence"):
            for t in r["turns"]:
                assert sum(t["accept_lengths"]) == t["new_tokens"] - 1
                assert 0 <= t["accepted"] <= t["drafted"]


def test_records_rotate_the_method_order(bench):
    _, records, _ = bench
    first = {}
    for r in records:
        if r["position"] == 0:
            first[(r["repeat"], r["question_id"])] = r["method"]
    assert len(set(first.values())) >= 4  # 8 prompt runs, 6 methods: the first slot rotates


def test_cost_model_column_is_the_prediction_at_the_measured_alpha(bench):
    res, records, _ = bench
    e = res["summary"]["methods"]["static_confidence"]
    pred = cost_model_prediction(synthetic_cost_model(4), e["alpha"], e["skip_ratio"])
    mine = [r for r in records if r["method"] == "static_confidence"]
    rounds = rounds_prediction(synthetic_cost_model(4), mine)
    assert e["cost_model"] == dict(pred, rounds=rounds) and rounds is not None
    row = next(
        line for line in plain_table(res["report"]).splitlines() if line.startswith("| static_confidence |")
    )
    assert f"{pred['ceiling']:.3f}x (k={pred['ceiling_k']}) / {pred['drafting']:.3f}x" in row
    assert row.split(" | ")[-1].startswith(f"{pred['ceiling']:.3f}x") and f" / {rounds:.3f}x |" in row
    assert res["summary"]["methods"]["hf_prompt_lookup"]["cost_model"] is None


def test_interrupted_run_keeps_finished_prompts(tiny, data, tmp_path, monkeypatch):
    model, tok = tiny
    calls = {"n": 0}
    real = HFGenerateDecoder.generate

    def flaky(self, ids, stop):
        calls["n"] += 1
        if calls["n"] == 3:  # the second prompt's (first turn of the) decode
            raise KeyboardInterrupt
        return real(self, ids, stop)

    monkeypatch.setattr(HFGenerateDecoder, "generate", flaky)
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=6,
        warmup=0,
        plots=False,
        methods=("vanilla", "hf_generate"),
        output=str(tmp_path),
        cost_model="none",
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    lines = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert sorted((r["question_id"], r["method"]) for r in lines) == [(1, "hf_generate"), (1, "vanilla")]
    assert not (tmp_path / "bench.md").exists()


def test_hf_error_is_reported_in_its_row(tiny, data, tmp_path, monkeypatch):
    model, tok = tiny
    real = HFGenerateDecoder.generate

    def fails(self, ids, stop):
        if self.name == "hf_early_exit":
            raise RuntimeError("early exit is not supported here")
        return real(self, ids, stop)

    monkeypatch.setattr(HFGenerateDecoder, "generate", fails)
    cfg = RunConfig.of(
        methods=("vanilla", "hf_generate", "hf_early_exit"),
        data=str(data),
        categories="qa",
        max_new_tokens=6,
        output=str(tmp_path),
        cost_model="none",
        plots=False,
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    row = next(
        line for line in plain_table(res["report"]).splitlines() if line.startswith("| hf_early_exit |")
    )
    assert "ERROR: RuntimeError: early exit is not supported here" in row
    assert "**hf_early_exit failed**" in res["report"]
    assert res["summary"]["methods"]["hf_generate"]["prompts"] == 2
    errs = [r for r in res["records"] if r.get("error")]
    assert [r["method"] for r in errs] == ["hf_early_exit"]


def test_raw_runs_each_gated_preset_with_the_gate_off_too(tiny, data, tmp_path):
    """``--raw``: a gated preset gets a '<name>:raw' companion row decoded with the gate off (its
    own alpha and M even where the gate declines); ungated presets get none; the gate column says
    how often the gate declined, and an alpha that does not exist says why."""
    from framework.benchmark.report import _alpha_cell, _gate_cell
    from framework.session.methods import parse_methods

    specs = parse_methods(["static_confidence", "hybrid"], with_raw=True)
    assert [(s.label, s.raw) for s in specs] == [
        ("vanilla", False),
        ("static_confidence", False),
        ("static_confidence:raw", True),
        ("hybrid", False),  # its preset has no controller gate: nothing to compare
    ]
    model, tok = tiny
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=8,
        dtype="float64",
        limit=1,
        methods=("vanilla", "static_confidence"),
        output=str(tmp_path / "out"),
        cost_model="none",
        raw=True,
        preset_args=(("static_confidence", "--selector.skip_ratio 0.5"),),
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    raw = [r for r in records if r["method"] == "static_confidence:raw"]
    gated = [r for r in records if r["method"] == "static_confidence"]
    assert raw and gated and all(r["lossless"] for r in raw + gated)
    for rec in raw:  # the gate is off: no gate summary, and every round drafted
        for turn in rec["turns"]:
            assert "gate" not in turn["strategy_summary"].get("length", {})
            assert all(k > 0 for k in turn["draft_lengths"][:-1])
    assert all("gate" in t["strategy_summary"]["length"] for r in gated for t in r["turns"])
    methods = res["summary"]["methods"]
    assert methods["static_confidence:raw"]["gate"] is None
    assert methods["static_confidence:raw"]["alpha"] is not None
    gate = methods["static_confidence"]["gate"]
    assert gate["rounds"] > 0 and 0 <= gate["declined"] <= gate["rounds"]
    assert "| static_confidence:raw |" in res["report"] and "gate declined" in res["report"]
    # the cells, on made-up entries
    assert _gate_cell({"gate": None}) == "off"
    assert _gate_cell({"gate": {"rounds": 8, "declined": 6}}) == "75.0%"
    every = {"alpha": None, "M": 1.0, "gate": {"rounds": 8, "declined": 8}}
    assert _alpha_cell(every) == "n/a (gate declined every round)"
    assert _alpha_cell({"alpha": None, "M": 1.0, "gate": None}) == "n/a"
    assert _alpha_cell({"alpha": 0.25, "M": 1.3, "gate": None}) == "0.250"


def test_a_method_with_a_reduced_draft_head_is_priced_with_it(tiny, data, tmp_path, monkeypatch):
    """A preset drafting with ``draft_vocab`` gets its own cost model (`CostModel.with_head`): the
    cost-model column predicts with it and the report names the head."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    model, tok = tiny
    cm = tmp_path / "cost.json"
    cm.write_text(json.dumps({"cost_model": synthetic_cost_model(4).to_dict()}))
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=8,
        dtype="float64",
        limit=1,
        methods=("vanilla", "static_confidence"),
        output=str(tmp_path / "out"),
        cost_model=str(cm),
        preset_args=(
            ("static_confidence", "--selector.skip_ratio 0.5 --drafter.draft_vocab 32 --gate.enabled false"),
        ),
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    e = res["summary"]["methods"]["static_confidence"]
    assert e["mismatches"] == 0 and e["cost_model"] is not None
    line = next(
        x
        for x in plain_table(res["report"]).splitlines()
        if x.startswith("- static_confidence drafts with a 32-token head")
    )
    assert "before any sub-layer" in line and "full head" in line


def test_methods_share_one_preparation_store(tiny, data, tmp_path, monkeypatch):
    """A preset and its ':raw' companion search Self-SD's skip set once (one store for all methods)."""
    import strategies.selectors.selfsd_bo as selfsd_bo

    calls = []
    real = selfsd_bo.search
    monkeypatch.setattr(selfsd_bo, "search", lambda ctx, c: calls.append(1) or real(ctx, c))
    model, tok = tiny
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=4,
        dtype="float64",
        limit=1,
        categories=("qa",),
        methods=("vanilla", "selfsd_safe"),
        output=str(tmp_path / "out"),
        cost_model="none",
        raw=True,
        preset_args=(
            (
                "selfsd_safe",
                "--selector.iterations 2 --selector.calib_limit 1 --selector.calib_max_new_tokens 4 "
                "--selector.cache false --drafter.draft_vocab 0",
            ),
        ),
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    assert {"selfsd_safe", "selfsd_safe:raw"} <= set(res["summary"]["methods"])
    assert len(calls) == 1


def test_a_mismatch_records_the_targets_margin_and_the_report_names_it(bench):
    """At a method's first mismatch the record keeps the target's top-1/top-2 logit margin (one
    extra forward after the fact), and the notes under the table tell a near-tie from a bug."""
    res, records, _ = bench
    broken = [r for r in records if r["method"] == "broken"]
    for r in broken:
        fm = r["first_mismatch"]
        last = len(r["turns"][0]["tokens"]) - 1  # Broken changes the last token of every turn
        assert (fm["turn"], fm["position"]) == (0, last)
        assert fm["method_token"] == r["turns"][0]["tokens"][last] != fm["vanilla_token"]
        assert fm["margin"] > 0 and fm["dtype"] == "float64"
        assert fm["near_tie"] is False  # float64: a flip this wide is no rounding
    assert all(r["first_mismatch"] is None for r in records if r["method"] == "static_confidence")
    entry = res["summary"]["methods"]["broken"]
    assert set(entry["mismatch_at"]) == set(entry["mismatched"])
    note = next(line for line in res["report"].splitlines() if line.startswith("- broken:"))
    assert "(4/4, mismatch rate 100%; near-ties 0/4 (0%), other differences 4/4 (100%))" in note
    assert "top-1/top-2 margin" in note and "in float64: not a near-tie: a bug?" in note
    q = entry["mismatched"][0]
    assert f"q{q} (turn 0, pos {entry['mismatch_at'][q]['position']}, " in note


def test_mismatch_note_format():
    from framework.benchmark.report import mismatch_note

    near = {"turn": 1, "position": 17, "margin": 0.0012, "dtype": "bfloat16", "near_tie": True}
    assert (
        mismatch_note("3", near) == "q3 (turn 1, pos 17, top-1/top-2 margin 0.0012 in bfloat16: a near-tie)"
    )
    assert mismatch_note("4", {"turn": 0, "position": 2, "margin": None}) == "q4 (turn 0, pos 2)"
    assert mismatch_note("5", None) == "q5"


def test_the_header_names_the_resolved_dtype(tiny, data, tmp_path):
    """``--dtype auto`` is resolved where the model is (float32 on a CPU): the header says so."""
    model, tok = tiny
    cfg = RunConfig.of(
        methods=("vanilla", "static_confidence"),
        data=str(data),
        categories="qa",
        max_new_tokens=4,
        output=str(tmp_path),
        cost_model="none",
        plots=False,
        dtype="auto",
    )
    logs: list[str] = []
    run(cfg, model=model, tokenizer=tok, log=logs.append)
    header = next(line for line in logs if line.startswith("[selfspec]") and "to decode on" in line)
    assert f"({dtype_name(next(model.parameters()).dtype)}, cpu)" in header and "auto" not in header


def test_methods_may_be_method_sections(tiny, data, tmp_path):
    """In Python the benchmark takes method sections too: each decodes with the run's shared
    sections and its own strategies, under its label; a gated section gets its ':raw' companion."""
    from framework.session.methods import parse_methods
    from framework.session.run_config import MethodConfig

    mine = RunConfig.from_preset("static_confidence", name="mine", **{"selector.skip_ratio": 0.5}).method
    assert [(s.label, s.raw) for s in parse_methods(["vanilla", mine], with_raw=True)] == [
        ("vanilla", False),
        ("mine", False),
        ("mine:raw", True),
    ]
    with pytest.raises(ConfigError, match="each method once"):
        parse_methods([mine, mine])
    with pytest.raises(ConfigError, match="with strategies and its own name"):
        parse_methods([MethodConfig(baseline_only=True)])
    model, tok = tiny
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=8,
        dtype="float64",
        limit=1,
        methods=("vanilla", mine),
        output=str(tmp_path / "out"),
        cost_model="none",
        raw=True,
    )
    run_cfg = preset_run_config(methods_of(cfg)[1], cfg)
    assert run_cfg.method.selector.config.skip_ratio == 0.5 and run_cfg.method.name == "mine"
    assert run_cfg.data == cfg.data and run_cfg.generation == cfg.generation
    run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert {r["method"] for r in records} == {"vanilla", "mine", "mine:raw"}
    assert all(r["lossless"] for r in records)


def test_records_carry_graph_captures_and_the_report_counts_them(bench):
    """Every turn records the CUDA graphs its generation recorded (none without --cuda-graphs);
    the summary sums them per method, and the header line names what was recorded before and
    while timed."""
    from framework.benchmark.report import graphs_line, summarize

    _, records, _ = bench
    turns = [t for r in records if not r.get("error") for t in r["turns"]]
    assert turns and all(t["graph_captures"] == 0 and t["capture_seconds"] == 0.0 for t in turns)
    timed = json.loads(json.dumps(records))
    timed[0]["turns"][0].update(graph_captures=3, capture_seconds=0.25)
    summary = summarize(timed, ["vanilla", "static_confidence"])
    assert summary["methods"][timed[0]["method"]]["graph_captures"] == 3
    line = graphs_line((120, 4.5), summary)
    assert line.startswith("- CUDA graphs: 120 recorded before timing (4.5 s); recorded while timed: ")
    assert f"{timed[0]['method']} 3 (0.25 s)" in line


def test_the_report_names_the_head_a_method_drafts_with():
    """A method priced for its compressed weights drafts with the full head (``draft_vocab`` 0):
    the report says so, not "a 0-token head"."""
    import dataclasses

    from framework.benchmark.report import head_line

    base = synthetic_cost_model(4)
    full = head_line("m", dataclasses.replace(base, draft_vocab=0, draft_weights="int8"))
    assert full.startswith("- m drafts with the full LM head and int8 weights: its draft step costs")
    reduced = head_line("m", dataclasses.replace(base, draft_vocab=32))
    assert reduced.startswith("- m drafts with a 32-token head: ") and "0-token" not in full


def test_every_long_stage_says_when_it_starts_and_for_which_method(tiny, data, tmp_path):
    """Issue 55, item 1: a first run is never silent: preparing each method, measuring its cost
    model (named for the method), the warm-up and the timed decoding each print a line when they
    start, in that order, and every prompt its own line."""
    model, tok = tiny
    cfg = RunConfig.of(
        methods=("vanilla", "static_confidence"),
        data=str(data),
        categories="qa",
        max_new_tokens=4,
        output=str(tmp_path),
        cost_model="measure",
        plots=False,
        dtype="float64",
    )
    logs: list[str] = []
    run(cfg, model=model, tokenizer=tok, log=logs.append)

    def at(fragment: str) -> int:
        return next(i for i, line in enumerate(logs) if fragment in line)

    order = [
        at("[selfspec] preparing static_confidence ..."),
        at("[selfspec] measuring the cost model for static_confidence ("),
        at("[selfspec] cost model measured in"),
        at("[selfspec] warming up 2 method(s): 1 generation(s) of 4 tokens each"),
        at("[selfspec] decoding "),
        at("[1/"),
    ]
    assert order == sorted(order), logs
    assert "prompt(s), timed; a line per prompt" in logs[order[4]]
