"""The Spec-Bench-style benchmark (framework/benchmark/bench.py, experiments/bench.py) on a tiny random
model: the table, the ratio of means, mismatches, HF generate against our vanilla, repeats,
incremental output and bad input."""

from __future__ import annotations

import json
import statistics

import pytest

from framework.benchmark.bench import BenchConfig, HFGenerateDecoder, main, run_benchmark
from framework.config import ConfigError
from framework.engine.adapter import adapter_for
from framework.engine.decoding import VanillaDecoder
from framework.experiment.metrics import cost_model_prediction, rounds_prediction
from framework.testing import synthetic_cost_model, tiny_model, tiny_tokenizer

VOCAB = 128
METHODS = ("vanilla", "hf_generate", "hf_prompt_lookup", "hf_early_exit", "static_confidence")


@pytest.fixture(scope="module")
def tiny():
    model = tiny_model("llama", num_layers=4, vocab_size=VOCAB, max_position_embeddings=256)
    return model, tiny_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w4", "w5 w6"]},
        {"question_id": 2, "category": "qa", "turns": ["w7 w8 w9 w7 w8 w9"]},
        {"question_id": 3, "category": "qa", "turns": ["w10 w11 w12 w13 w14"]},
        {"question_id": 4, "category": "rag", "turns": ["w20 w21 w22"]},
    ]
    p = tmp_path_factory.mktemp("data") / "question.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


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
    cfg = BenchConfig(
        methods=METHODS,
        data=str(data),
        max_new_tokens=10,
        repeats=2,
        out=str(out),
        dtype="float64",
        cost_model=str(cm),
        command="python experiments/bench.py --test",
    )
    res = run_benchmark(cfg, model, tok, log=lambda s: None, custom={"broken": Broken(model)})
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return res, records, out


def test_table_has_every_method_and_category(bench):
    res, _, out = bench
    report = (out / "bench.md").read_text()
    assert report == res["report"]
    header = next(line for line in report.splitlines() if line.startswith("| method | mt_bench"))
    assert header.startswith("| method | mt_bench | qa | rag | **overall** | spread")
    for m in (*METHODS, "broken"):
        assert any(line.startswith(f"| {m} | ") for line in report.splitlines()), m
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
    row = next(line for line in res["report"].splitlines() if line.startswith("| static_confidence |"))
    assert f"**{entry['speedup']['overall']:.3f}x**" in row
    assert f"± {entry['std']:.3f} ({entry['min']:.3f}-{entry['max']:.3f})" in row


def test_mismatches_are_counted(bench):
    res, records, _ = bench
    methods = res["summary"]["methods"]
    assert methods["broken"]["mismatches"] == 4
    assert all(not r["lossless"] for r in records if r["method"] == "broken")
    assert "| 4/4 |" in next(line for line in res["report"].splitlines() if line.startswith("| broken |"))
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
    row = next(line for line in res["report"].splitlines() if line.startswith("| static_confidence |"))
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
    cfg = BenchConfig(
        methods=("vanilla", "hf_generate"),
        data=str(data),
        max_new_tokens=6,
        warmup=0,
        out=str(tmp_path),
        cost_model="none",
        plots=False,
    )
    with pytest.raises(KeyboardInterrupt):
        run_benchmark(cfg, model, tok, log=lambda s: None)
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
    cfg = BenchConfig(
        methods=("vanilla", "hf_generate", "hf_early_exit"),
        data=str(data),
        categories=("qa",),
        max_new_tokens=6,
        out=str(tmp_path),
        cost_model="none",
        plots=False,
    )
    res = run_benchmark(cfg, model, tok, log=lambda s: None)
    row = next(line for line in res["report"].splitlines() if line.startswith("| hf_early_exit |"))
    assert "ERROR: RuntimeError: early exit is not supported here" in row
    assert "**hf_early_exit failed**" in res["report"]
    assert res["summary"]["methods"]["hf_generate"]["prompts"] == 2
    errs = [r for r in res["records"] if r.get("error")]
    assert [r["method"] for r in errs] == ["hf_early_exit"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--methods", "vanilla,warp_drive"],
            "--methods must be a comma-separated list of vanilla, hf_generate",
        ),
        (["--methods", "vanilla,clasp,clasp"], "each method once"),
        (["--methods", "vanilla"], "at least one method besides vanilla"),
        (["--methods", "vanilla,selfsd_sampling"], "a greedy preset"),
        (["--categories", "poetry"], "--categories: unknown 'poetry'; available: mt_bench, qa, rag"),
        (["--repeats", "0"], "--repeats must be an integer >= 1"),
        (["--preset-args", "swift=--selector.skip_ratio 0.3"], "--preset-args must be a preset among"),
        (["--preset-args", "static_confidence=--no-such-flag 1"], "run.py flags"),
        (["--cost-model", "missing.json"], "--cost-model must be 'measure', 'none' or a CostModel"),
        (["--early-exit-layer", "4"], "--early-exit-layer must be in [1, 3]"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(tiny, data, tmp_path, capsys, argv, message):
    model, tok = tiny
    base = ["--data", str(data), "--out", str(tmp_path / "o"), "--max-new-tokens", "4", "--warmup", "0"]
    base += ["--methods", "vanilla,hf_generate,hf_early_exit,static_confidence", "--cost-model", "none"]
    code = main(base + argv, model=model, tokenizer=tok)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o" / "records.jsonl").exists()


def test_preset_args_and_skip_set_reach_the_preset(tmp_path):
    from framework.benchmark.bench import MethodSpec, _preset_run_config

    cfg = BenchConfig(
        methods=("vanilla", "static_confidence", "selfsd"),
        preset_args=(("static_confidence", "--selector.skip_ratio 0.5 --length.threshold 0.9"),),
        skip_set=str(tmp_path / "s.skipset.json"),
    )
    rc = _preset_run_config(MethodSpec("static_confidence", "preset", "static_confidence"), cfg)
    assert rc.selector.config.skip_ratio == 0.5 and rc.length.config.threshold == 0.9
    assert rc.method_name == "static_confidence"
    rc = _preset_run_config(MethodSpec("selfsd", "preset", "selfsd"), cfg)
    assert rc.selector.config.skip_set == str(tmp_path / "s.skipset.json")
    with pytest.raises(ConfigError, match="records.jsonl exists"):
        (tmp_path / "records.jsonl").write_text("{}\n")
        run_benchmark(BenchConfig(methods=("vanilla", "hf_generate"), out=str(tmp_path)), object(), None)


def test_plan_plots_come_from_the_first_repeat(tmp_path):
    from framework.benchmark.bench import make_plots

    def rec(method, plans, exits, repeat=0):
        turn = {"plans": plans, "exit_layers": exits}
        return {
            "method": method,
            "kind": "preset",
            "repeat": repeat,
            "drafted": 2,
            "accept_lengths": [2, 1],
            "turns": [turn],
        }

    records = [
        rec("dyn", ["10000000", "01000001"], [None, None]),
        rec("static", ["10000000", "10000000"], [None, None]),
        rec("early", ["00011111", "00111111"], [3, 2]),
        rec("dyn2", ["10000000", "10000000"], [None, None]),
        rec("dyn2", ["01000000"], [None], repeat=1),  # later repeats are not drawn
    ]
    summary = {"methods": {"dyn": {"speedup": {"overall": 1.1}}, "vanilla": {"speedup": {"overall": 1.0}}}}
    out = make_plots(tmp_path, summary, records, num_layers=4)
    names = sorted(p.name for p in tmp_path.glob("*.png"))
    assert names == ["accept_lengths.png", "exit_layer_early.png", "skip_dyn.png", "speedup_by_category.png"]
    assert set(out) == {
        "speedup by category",
        "accepted tokens per round",
        "dyn: skip set per round",
        "early: exit layer per round",
    }


def test_cost_model_of_another_model_is_refused(tiny, data, tmp_path, capsys):
    model, tok = tiny
    cm = tmp_path / "cm.json"
    cm.write_text(json.dumps(synthetic_cost_model(10).to_dict()))
    argv = ["--data", str(data), "--out", str(tmp_path / "o"), "--methods", "vanilla,hf_generate"]
    assert main(argv + ["--cost-model", str(cm)], model=model, tokenizer=tok) == 2
    assert "a cost model of a 4-layer model, not 10" in capsys.readouterr().err
