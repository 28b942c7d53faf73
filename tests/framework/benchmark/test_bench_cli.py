"""The benchmark's command line (framework/runner/cli.py with ``bench=True``, experiments/bench.py):
flags generated from `RunConfig` keep their meaning, and bad input exits with status 2 and a
clear message before anything is written."""

from __future__ import annotations

import json

import pytest

from framework.runner.cli import bench_main as main
from framework.runner.cli import build_parser as _build_parser
from framework.runner.cli import config_from_args
from framework.testing import synthetic_cost_model


def build_parser():
    return _build_parser(bench=True)


def _config(argv):
    return config_from_args(build_parser().parse_args(argv), "cmd")


def test_flags_keep_their_meaning():
    cfg = _config(
        [
            "--methods", "vanilla,hf_prompt_lookup,swift",
            "--data", "q.jsonl", "--categories", "qa,rag", "--limit", "2", "--max-new-tokens", "64",
            "--threads", "2", "--warmup", "0", "--repeats", "3", "--out", "runs/b", "--model", "m",
            "--dtype", "float64", "--device", "cpu", "--seed", "7", "--prompt-lookup-num-tokens", "5",
            "--max-matching-ngram-size", "3", "--early-exit-layer", "2", "--hf-kernels",
            "--cost-model", "none", "--skip-set", "s.json", "--no-plots",
            "--preset-args", "swift=--selector.skip_ratio 0.3",
        ]
    )  # fmt: skip
    run = cfg
    assert cfg.compare.methods == ("vanilla", "hf_prompt_lookup", "swift") and cfg.compare.command == "cmd"
    assert (run.data.path, run.data.categories, run.data.limit, run.generation.max_new_tokens) == (
        "q.jsonl",
        ("qa", "rag"),
        2,
        64,
    )
    assert (run.runner.threads, run.runner.warmup, run.model.name_or_path, run.model.dtype, run.model.device, run.generation.seed) == (
        2, 0, "m", "float64", "cpu", 7
    )  # fmt: skip
    assert run.runner.plots is False and run.model.kernels is True
    assert (cfg.compare.repeats, cfg.runner.output, cfg.compare.cost_model, cfg.compare.skip_set) == (
        3,
        "runs/b",
        "none",
        "s.json",
    )
    assert (
        cfg.compare.prompt_lookup_num_tokens,
        cfg.compare.max_matching_ngram_size,
        cfg.compare.early_exit_layer,
    ) == (5, 3, 2)
    assert cfg.compare.hf_kernels is True
    assert cfg.compare.preset_args == (
        ("swift", {"selector.skip_ratio": "0.3"}),
    )  # read once, into overrides
    default = _config([])
    # The first run's story: the gated default, the same ungated, and the hybrid drafter.
    assert default.compare.methods == ("vanilla", "static_confidence", "static_confidence:raw", "hybrid")
    assert (default.generation.max_new_tokens, default.model.dtype, default.runner.warmup, default.compare.repeats) == (
        128, "auto", 1, 1
    )  # fmt: skip
    assert default.runner.plots and not default.compare.hf_kernels and default.compare.cost_model == "measure"


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
        (
            ["--preset-args", "static_confidence=--selector.skip_ratio 1.5"],
            "--selector.skip_ratio must be in [0, 1)",
        ),
        (["--preset-args", "static_confidence"], "--preset-args must be METHOD=FLAGS"),
        (["--dtype", "float8"], "--dtype must be one of float32, float16, bfloat16, float64"),
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


def test_cost_model_of_another_model_is_refused(tiny, data, tmp_path, capsys):
    model, tok = tiny
    cm = tmp_path / "cm.json"
    cm.write_text(json.dumps(synthetic_cost_model(10).to_dict()))
    argv = ["--data", str(data), "--out", str(tmp_path / "o"), "--methods", "vanilla,hf_generate"]
    assert main(argv + ["--cost-model", str(cm)], model=model, tokenizer=tok) == 2
    assert "a cost model of a 4-layer model, not 10" in capsys.readouterr().err


def test_synthetic_acceptance_forces_every_preset_and_lists_with_l(tiny, data, tmp_path, capsys):
    """Issue 55, item 5: ``bench.py --synthetic-acceptance P`` runs every preset at one forced
    acceptance (run.py's flag, for all of them); ``-l`` is ``--list``."""
    from framework.session.methods import preset_run_config
    from framework.session.methods import specs as methods_of

    cfg = _config(["--methods", "vanilla,static_confidence,hybrid", "--synthetic-acceptance", "0.7"])
    assert cfg.compare.synthetic == 0.7 and cfg.method.synthetic_acceptance is None
    presets = [preset_run_config(s, cfg).method for s in methods_of(cfg) if s.kind == "preset"]
    assert [m.synthetic_acceptance for m in presets] == [0.7, 0.7]
    model, tok = tiny
    out = tmp_path / "b"
    argv = ["--data", str(data), "--limit", "1", "--categories", "qa", "--max-new-tokens", "4", "--dtype",
            "float64", "--methods", "vanilla,static_confidence", "--synthetic-acceptance", "0.7",
            "--output", str(out), "--logger", "none", "--no-plots", "--cost-model", "none"]  # fmt: skip
    assert main(argv, model=model, tokenizer=tok) == 0
    recs = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    forced = [r for r in recs if r["method"] == "static_confidence"]
    assert forced and all(r["synthetic_acceptance"] == 0.7 and r["lossless"] is None for r in forced)
    capsys.readouterr()
    assert main(["-l"]) == 0 and "selectors (--selector):" in capsys.readouterr().out
    code = main(["--synthetic-acceptance", "1.5", "--print-config"])
    assert code == 2 and "--synthetic-acceptance must be in [0, 1]" in capsys.readouterr().err
