"""Spec-Bench answer files (framework/data/specbench.py, ``--specbench-answers``), checked
with our own few-line re-implementation of what Spec-Bench's ``evaluation/speed.py`` and
``evaluation/equal.py`` compute from them: the speedup equals our benchmark's, every lossless
answer is equal, the raw categories survive, the flag is validated."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from framework.benchmark.hf import HFGenerateDecoder
from framework.benchmark.report import summarize
from framework.config_fields import ConfigError
from framework.data.specbench import (
    ANSWER_KEYS,
    CHOICE_KEYS,
    AnswerFileError,
    check_answer_dir,
    read_answer_file,
    write_answer_files,
)
from framework.results.records import config_differences, read_records
from framework.runner import cli as bench_cli
from framework.runner import cli as run_cli
from framework.runner.pipeline import run
from framework.session.run_config import RunConfig, RunnerConfig

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
ROWS = [
    {"question_id": 1, "category": "writing", "turns": ["w1 w2 w3 w4", "w5 w6"]},
    {"question_id": 2, "category": "roleplay", "turns": ["w7 w8 w9 w7 w8 w9"]},
    {"question_id": 3, "category": "qa", "turns": ["w10 w11 w12 w13 w14"]},
    {"question_id": 4, "category": "qa", "turns": ["w20 w21 w22"]},
    {"question_id": "t-1", "category": "translation", "turns": ["w30 w31 w30 w31"]},
]
RAW = {str(r["question_id"]): r["category"] for r in ROWS}
METHODS = ("vanilla", "hf_generate", "static_confidence")


# ---- our re-implementation of Spec-Bench's evaluation (its semantics, not its code) ----------
def _lines(path: Path, task: str) -> list[dict]:
    """An answer file's lines of a Spec-Bench task: ``overall``, ``mt_bench`` (its eight raw
    categories) or one raw category."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        obj = json.loads(line)
        cat = obj["category"]
        if task == "overall" or (task == "mt_bench" and cat in MT_BENCH) or cat == task:
            out.append(obj)
    return out


def speed(method_file: Path, base_file: Path, task: str = "overall") -> tuple[float, list[int]]:
    """speed.py's speedup and accepted lengths: per question, tokens/s = new tokens summed over
    the turns / wall time summed over the turns; speedup = mean over the method's questions /
    mean over the baseline's (a ratio of means); "mean accepted tokens" = the mean of every
    question's ``accept_lengths`` pooled. (speed.py counts the baseline's tokens by re-tokenizing
    its text, minus one per turn; here the baseline's ``new_tokens``, the count that re-tokenizing
    reproduces when the text round-trips and the tokenizer adds one BOS token.)"""
    speeds, accepts = [], []
    for obj in _lines(method_file, task):
        c = obj["choices"][0]
        speeds.append(sum(c["new_tokens"]) / sum(c["wall_time"]))
        accepts.extend(c["accept_lengths"])
    base = []
    for obj in _lines(base_file, task):
        c = obj["choices"][0]
        base.append(sum(c["new_tokens"]) / sum(c["wall_time"]))
    return statistics.mean(speeds) / statistics.mean(base), accepts


def equal(file1: Path, file2: Path) -> bool:
    """equal.py: the files' answers (each line's ``str(turns)``) compared line by line, in order."""

    def contents(path: Path) -> list[str]:
        return [str(json.loads(x)["choices"][0]["turns"]) for x in Path(path).read_text().splitlines()]

    # equal.py stops at the shorter file (zip); the tests check the lengths themselves
    return all(a == b for a, b in zip(contents(file1), contents(file2), strict=False))


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "question.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


@pytest.fixture(scope="module")
def bench(tiny, data, tmp_path_factory):
    """A two-repeat benchmark of vanilla, HF generate and a drafting preset, with answer files."""
    model, tok = tiny
    out = tmp_path_factory.mktemp("bench")
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=8,
        dtype="float64",
        warmup=0,
        plots=False,
        methods=METHODS,
        repeats=2,
        output=str(out),
        cost_model="none",
        preset_args=(
            (
                "static_confidence",
                "--selector.skip_ratio 0.3 --length fixed --length.k 3 --gate.enabled false",
            ),
        ),
        specbench_answers=str(out / "specbench"),
    )
    res = run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    return res, out / "specbench"


# ---- the benchmark's answer files ---------------------------------------------------------------
def test_one_file_per_method_and_repeat_with_every_field(bench):
    res, answers = bench
    want = sorted(str(answers / f"run_{r}" / f"{m}.jsonl") for r in (1, 2) for m in METHODS)
    assert sorted(res["specbench_answers"]) == want
    assert sorted(str(p) for p in answers.rglob("*.jsonl")) == want
    for path in map(Path, want):
        lines = read_answer_file(path)  # our validator
        assert [str(x["question_id"]) for x in lines] == ["1", "2", "3", "4", "t-1"]  # sorted, as eval.py
        for x in lines:
            assert set(ANSWER_KEYS) <= set(x) and set(CHOICE_KEYS) <= set(x["choices"][0])
            c = x["choices"][0]
            n = 2 if x["question_id"] == 1 else 1
            assert c["index"] == 0 and len(c["turns"]) == n
            assert len(c["new_tokens"]) == len(c["wall_time"]) == len(c["decoding_steps"]) == n
            assert all(isinstance(a, int) and a >= 1 for a in c["accept_lengths"])  # flat, per step
            assert x["model_id"].endswith(path.stem)


def test_speedup_from_the_answer_files_equals_our_summary(bench):
    res, answers = bench
    summary = summarize(res["records"], list(METHODS))
    assert set(summary["categories"]) == {"mt_bench", "qa", "translation", "overall"}
    for method in METHODS:
        entry = summary["methods"][method]
        accepts = []
        for cat in summary["categories"]:
            per_run = []
            for r in (1, 2):
                s, acc = speed(
                    answers / f"run_{r}" / f"{method}.jsonl", answers / f"run_{r}" / "vanilla.jsonl", cat
                )
                per_run.append(s)
                if cat == "overall":
                    accepts += acc
            # our cell: the mean over repeats of each repeat's ratio of means (speed.py per run,
            # then the mean over runs as its --mean-report does)
            mine = statistics.mean(per_run)
            assert round(mine, 2) == round(entry["speedup"][cat], 2)
            assert mine == pytest.approx(entry["speedup"][cat], rel=1e-9)
            if cat == "overall":
                assert per_run == pytest.approx(entry["overall_by_repeat"], rel=1e-9)
        # speed.py's "mean accepted tokens" is our M
        assert statistics.mean(accepts) == pytest.approx(entry["M"], rel=1e-12)
        if method != "static_confidence":
            assert set(accepts) == {1}  # vanilla and plain generate commit one token per step
    assert summary["methods"]["static_confidence"]["M"] > 1  # it drafted and accepted


def test_equal_finds_every_lossless_answer_identical(bench, tmp_path):
    res, answers = bench
    assert all(r["lossless"] for r in res["records"])
    for r in (1, 2):
        base = answers / f"run_{r}" / "vanilla.jsonl"
        for method in METHODS:
            assert equal(base, answers / f"run_{r}" / f"{method}.jsonl"), (r, method)
    # and it would notice a change
    lines = (answers / "run_1" / "hf_generate.jsonl").read_text().splitlines()
    obj = json.loads(lines[2])
    obj["choices"][0]["turns"][0] += " w1"
    lines[2] = json.dumps(obj)
    changed = tmp_path / "changed.jsonl"
    changed.write_text("\n".join(lines) + "\n")
    assert not equal(answers / "run_1" / "vanilla.jsonl", changed)


def test_raw_categories_survive(bench):
    res, answers = bench
    assert {r["category"] for r in res["records"]} == {"mt_bench", "qa", "translation"}
    for path in answers.rglob("*.jsonl"):
        assert {str(x["question_id"]): x["category"] for x in read_answer_file(path)} == RAW


def test_interrupted_benchmark_writes_the_finished_prompts(tiny, data, tmp_path, monkeypatch):
    model, tok = tiny
    calls = {"n": 0}
    real = HFGenerateDecoder.generate

    def flaky(self, ids, stop):
        calls["n"] += 1
        if calls["n"] == 3:  # the second prompt (the first takes two calls, one per turn)
            raise KeyboardInterrupt
        return real(self, ids, stop)

    monkeypatch.setattr(HFGenerateDecoder, "generate", flaky)
    cfg = RunConfig.of(
        data=str(data),
        max_new_tokens=6,
        warmup=0,
        plots=False,
        methods=("vanilla", "hf_generate"),
        output=str(tmp_path / "b"),
        cost_model="none",
        specbench_answers=str(tmp_path / "a"),
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, model=model, tokenizer=tok, log=lambda s: None)
    for m in ("vanilla", "hf_generate"):
        assert [x["question_id"] for x in read_answer_file(tmp_path / "a" / f"{m}.jsonl")] == [1]


# ---- run.py ---------------------------------------------------------------------------------------
def test_run_writes_answer_files_and_the_converter_agrees(tiny, data, tmp_path, capsys):
    from experiments import specbench_answers as converter

    model, tok = tiny
    out = tmp_path / "r"
    cfg = RunConfig.of(
        model="tiny-random",  # the tiny model is passed in; named, so that the metadata says which
        data=str(data),
        output=str(out),
        max_new_tokens=8,
        warmup=0,
        logger="none",
        plots=False,
        selector="static",
        **{"selector.skip_ratio": 0.3},
        length="fixed",
        **{"length.k": 3},
        specbench_answers=str(tmp_path / "sb"),
    )
    res = run(cfg, log=lambda s: None, model=model, tokenizer=tok)
    files = {Path(p).name for p in res["specbench_answers"]}
    assert files == {"vanilla.jsonl", "static+fixed.jsonl"}
    base, spec = tmp_path / "sb" / "vanilla.jsonl", tmp_path / "sb" / "static+fixed.jsonl"
    assert equal(base, spec)
    assert [x["category"] for x in read_answer_file(spec)] == [r["category"] for r in ROWS]
    # run.py's table: the ratio of mean tokens/s, as speed.py
    records = read_records(out)
    tps = {
        m: statistics.mean(r["new_tokens"] / r["wall_time"] for r in records if r["method"] == m)
        for m in ("vanilla", "static+fixed")
    }
    assert speed(spec, base)[0] == pytest.approx(tps["static+fixed"] / tps["vanilla"], rel=1e-9)
    assert f"{tps['static+fixed'] / tps['vanilla']:.3f}x" in res["table"]

    # the converter rewrites the same files from the results file (all but the time stamp)
    assert converter.main([str(out), str(tmp_path / "conv")]) == 0
    assert read_answer_file(spec)[0]["model_id"] == "tiny-random-static+fixed"
    for name in files:
        a, b = read_answer_file(tmp_path / "sb" / name), read_answer_file(tmp_path / "conv" / name)
        assert [{**x, "tstamp": 0} for x in a] == [{**x, "tstamp": 0} for x in b]
    assert "vanilla" in capsys.readouterr().out
    assert converter.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "c2")]) == 2


def test_interrupted_run_writes_the_finished_prompts(tiny, data, tmp_path, monkeypatch):
    from framework.session.session import Session

    model, tok = tiny
    real = Session.decode_prompt

    def flaky(self, decoder, prompt, max_new_tokens=None):
        if max_new_tokens is None and prompt.question_id == 2:
            raise KeyboardInterrupt
        return real(self, decoder, prompt, max_new_tokens)

    monkeypatch.setattr(Session, "decode_prompt", flaky)
    cfg = RunConfig.of(
        data=str(data),
        output=str(tmp_path / "r.jsonl"),
        max_new_tokens=6,
        warmup=0,
        logger="none",
        plots=False,
        specbench_answers=str(tmp_path / "sb"),
    )
    with pytest.raises(KeyboardInterrupt):
        run(cfg, log=lambda s: None, model=model, tokenizer=tok)
    for name in ("vanilla", cfg.method.label):
        assert [x["question_id"] for x in read_answer_file(tmp_path / "sb" / f"{name}.jsonl")] == [1]


def test_flag_is_accepted_resumable_and_validated(tiny, data, tmp_path, capsys):
    # accepted by both command lines, off by default
    args = run_cli.build_parser().parse_args(["--specbench-answers", "sb"])
    assert run_cli.config_from_args(args).runner.specbench_answers == "sb"
    assert RunConfig().runner.specbench_answers == "" and RunConfig.of().runner.specbench_answers == ""
    args = bench_cli.build_parser(bench=True).parse_args(
        ["--methods", "vanilla,hf_generate", "--specbench-answers", "sb"]
    )
    assert bench_cli.config_from_args(args, "cmd").runner.specbench_answers == "sb"
    # where the answers go does not change a result: --resume accepts another directory
    assert (
        config_differences(
            RunConfig().describe(), RunConfig(runner=RunnerConfig(specbench_answers="elsewhere"))
        )
        == {}
    )
    # bad values: a clear error naming the flag
    with pytest.raises(ConfigError, match="--specbench-answers must be a string, got 3"):
        RunConfig.of(specbench_answers=3)
    with pytest.raises(ConfigError, match="--specbench-answers must be a directory path"):
        RunConfig.of(specbench_answers="  ")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    out = tmp_path / "r"
    argv = ["--data", str(data), "--model", "tiny-random", "--logger", "none", "--output", str(out)]
    assert run_cli.main([*argv, "--specbench-answers", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert f"error: --specbench-answers must be a directory for the answer files ({a_file} is a file)" in err
    assert not out.exists()  # refused before anything was written
    model, tok = tiny
    bench_argv = ["--data", str(data), "--methods", "vanilla,hf_generate", "--out", str(tmp_path / "b")]
    assert (
        bench_cli.bench_main(
            [*bench_argv, "--specbench-answers", str(a_file / "sub")], model=model, tokenizer=tok
        )
        == 2
    )
    assert "--specbench-answers must be a directory" in capsys.readouterr().err
    assert not (tmp_path / "b" / "records.jsonl").exists()
    # an answer file that would overwrite the results file (a run's records.jsonl, or any it protects)
    clash = tmp_path / "c" / "vanilla.jsonl"
    clash.parent.mkdir()
    with pytest.raises(ConfigError, match="overwrites the results file"):
        check_answer_dir(clash.parent, ["vanilla"], [clash])


def test_reader_rejects_what_speed_py_cannot_read(tmp_path):
    rec = {
        "question_id": 1,
        "category": "qa",
        "subcategory": "qa",
        "method": "m",
        "turns": [{"text": "a b", "new_tokens": 3, "wall_time": 0.5, "accept_lengths": [1, 1]}],
    }
    path = write_answer_files([rec], tmp_path)["m"]
    (x,) = read_answer_file(path)
    assert x["choices"][0]["accept_lengths"] == [1, 1] and x["choices"][0]["decoding_steps"] == [2]
    x["choices"][0]["accept_lengths"] = [[1, 1]]  # per-turn lists: speed.py's np.mean fails on them
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(x) + "\n")
    with pytest.raises(AnswerFileError, match=r"bad.jsonl:1: .*flat list"):
        read_answer_file(bad)
    del x["choices"]
    bad.write_text(json.dumps(x) + "\n")
    with pytest.raises(AnswerFileError, match="missing key"):
        read_answer_file(bad)
